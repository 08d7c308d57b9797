#!/bin/sh
# Build dist/Cleave.app and dist/Cleave-VERSION.dmg on macOS.
#
#   packaging/macos/build_dmg.sh
#
# Needs Python 3.10+ from python.org or Homebrew and the Xcode command line tools
# (hdiutil, codesign). PyInstaller builds for the Mac it runs on: build on Apple
# silicon for arm64, on an Intel Mac for x86_64.
#
# Signing (optional): set CODESIGN_IDENTITY="Developer ID Application: ..." and the
# spec signs every binary with the hardened runtime and entitlements.plist; set
# NOTARY_PROFILE to a `xcrun notarytool store-credentials` profile to notarize and
# staple. Unsigned, Gatekeeper asks the volunteer to confirm with right-click > Open.
set -eu

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
VENV=build/macos/venv

# A venv of its own; PyPI's torch for macOS is the CPU (and MPS) build.
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet torch==2.13.0
"$VENV/bin/python" -m pip install --quiet '.[package]'
VERSION=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('cleave'))")
echo "building Cleave $VERSION"

"$VENV/bin/pyinstaller" --noconfirm --distpath dist --workpath build/pyinstaller \
    packaging/pyinstaller/cleave-app.spec

# The real worker path and the window, inside the finished app.
QT_QPA_PLATFORM=offscreen dist/Cleave.app/Contents/MacOS/cleave-app --self-test

if [ -n "${CODESIGN_IDENTITY:-}" ] && [ -n "${NOTARY_PROFILE:-}" ]; then
    ditto -c -k --keepParent dist/Cleave.app build/macos/Cleave.zip
    xcrun notarytool submit build/macos/Cleave.zip --keychain-profile "$NOTARY_PROFILE" --wait
    xcrun stapler staple dist/Cleave.app
fi

# The usual drag-to-install disk image: the app next to a link to /Applications.
STAGE=build/macos/dmg
rm -rf "$STAGE"
mkdir -p "$STAGE"
cp -R dist/Cleave.app "$STAGE/"
ln -s /Applications "$STAGE/Applications"
DMG=dist/Cleave-$VERSION.dmg
hdiutil create -volname "Cleave $VERSION" -srcfolder "$STAGE" -fs HFS+ -format UDZO -ov "$DMG"
if [ -n "${CODESIGN_IDENTITY:-}" ]; then
    codesign --sign "$CODESIGN_IDENTITY" --timestamp "$DMG"
fi
echo "built $DMG"
