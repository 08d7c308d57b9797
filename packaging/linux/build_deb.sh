#!/bin/sh
# Build dist/cleave-app_VERSION_ARCH.deb from the PyInstaller one-folder bundle.
#
#   packaging/linux/build_deb.sh [BUNDLE_DIR] [OUT_DIR]
#
# BUNDLE_DIR defaults to dist/cleave-app (what `make package` builds first), OUT_DIR
# to dist. Run from anywhere; paths are relative to the repository root. Needs only
# dpkg-deb, so any Debian or Ubuntu machine builds the package for its own
# architecture (the bundle holds native code: build on the architecture you ship).
#
# Layout installed:
#   /opt/cleave/                      the bundle (cleave-app + _internal/)
#   /usr/bin/cleave-app               symlink to /opt/cleave/cleave-app
#   /usr/share/applications/cleave-app.desktop
#   /usr/share/icons/hicolor/{256x256,scalable}/apps/cleave-app.{png,svg}
#   /usr/share/doc/cleave-app/copyright
# The desktop database and icon cache are refreshed by the dpkg triggers of
# desktop-file-utils and hicolor-icon-theme, so no maintainer scripts are needed.
set -eu

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
BUNDLE=${1:-dist/cleave-app}
OUT=${2:-dist}
PACKAGE=cleave-app
# The name and address the project commits under; set DEB_MAINTAINER to sign yours.
MAINTAINER=${DEB_MAINTAINER:-Cleave maintainers <maintainers@users.noreply.a-seed-c6433b62.example>}

if [ ! -x "$BUNDLE/cleave-app" ]; then
    echo "no bundle at $BUNDLE (build it with: make package)" >&2
    exit 1
fi
# The version is pyproject.toml's, so the .deb and the Python package never disagree.
VERSION=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' pyproject.toml | head -n 1)
if [ -z "$VERSION" ]; then
    echo "no version in pyproject.toml" >&2
    exit 1
fi
ARCH=$(dpkg --print-architecture)
STAGE=build/deb/${PACKAGE}_${VERSION}_${ARCH}
DEB=$OUT/${PACKAGE}_${VERSION}_${ARCH}.deb

rm -rf "$STAGE"
mkdir -p "$STAGE/DEBIAN" "$STAGE/opt" "$STAGE/usr/bin" "$STAGE/usr/share/applications" \
    "$STAGE/usr/share/icons/hicolor/256x256/apps" "$STAGE/usr/share/icons/hicolor/scalable/apps" \
    "$STAGE/usr/share/doc/$PACKAGE" "$OUT"
cp -a "$BUNDLE" "$STAGE/opt/cleave"
ln -s /opt/cleave/cleave-app "$STAGE/usr/bin/cleave-app"
install -m 644 packaging/linux/cleave-app.desktop "$STAGE/usr/share/applications/"
install -m 644 packaging/icons/cleave-256.png \
    "$STAGE/usr/share/icons/hicolor/256x256/apps/cleave-app.png"
install -m 644 packaging/icons/cleave.svg \
    "$STAGE/usr/share/icons/hicolor/scalable/apps/cleave-app.svg"
cat > "$STAGE/usr/share/doc/$PACKAGE/copyright" <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: cleave
Comment: /opt/cleave bundles Python, PyTorch, PySide6 (Qt, LGPL-3.0) and the other
 Python dependencies of cleave, each under its own licence; their licence files are
 in /opt/cleave/_internal where the packages ship them.

Files: *
License: Apache-2.0
 On Debian systems the full text is in /usr/share/common-licenses/Apache-2.0.
COPYRIGHT
# Files as the build user made them, but never writable by others once installed.
chmod -R u+rwX,go+rX,go-w "$STAGE"

INSTALLED_KB=$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)
# Depends: the system libraries the bundle links to but does not carry. PyInstaller
# copies most of them in (fontconfig, freetype, dbus, xkbcommon, X11, ICU, ...) and
# leaves out the ones that must match the machine's drivers and display server: libc,
# GL/EGL (glvnd) and libdrm, libxcb and the wayland client libraries. This list is
# what `ldd` on every library and plugin in the bundle resolves outside it (see
# docs/packaging.md); xcb-icccm and xcb-keysyms are needed by the xcb platform
# plugin. libc6 >= 2.28: the torch and PySide6 wheels are manylinux_2_28 builds.
cat > "$STAGE/DEBIAN/control" <<CONTROL
Package: $PACKAGE
Version: $VERSION
Architecture: $ARCH
Maintainer: $MAINTAINER
Installed-Size: $INSTALLED_KB
Section: science
Priority: optional
Depends: libc6 (>= 2.28), libgl1, libegl1, libdrm2, libxcb1, libxcb-icccm4, libxcb-keysyms1, libwayland-client0, libwayland-cursor0, libwayland-egl1
Description: volunteer computing for neural-network training (desktop worker)
 Cleave lets you donate this computer's spare CPU or GPU time to someone training
 a neural network. The desktop app joins a coordinator, receives signed,
 data-only bundles (two matrices), multiplies them with PyTorch and sends the
 product back. No code is ever received or executed.
 .
 The package carries its own Python, PyTorch (CPU build) and Qt under
 /opt/cleave; run "cleave-app --self-test" to check an installation.
CONTROL

# --root-owner-group: installed files belong to root whoever built the package.
# xz (dpkg's default) takes ~6 minutes on 2 cores and gives the smallest file that
# every dpkg installs; DEB_COMPRESSION=zstd is ~10x faster for local test builds but
# needs dpkg >= 1.21.18 (Debian 12, Ubuntu 21.10) to install.
dpkg-deb --root-owner-group -Z"${DEB_COMPRESSION:-xz}" --build "$STAGE" "$DEB"
echo "built $DEB ($(du -h "$DEB" | cut -f1), installs $((INSTALLED_KB / 1024)) MiB)"
