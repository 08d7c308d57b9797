#!/bin/sh
# Install the .deb for real, run the installed `cleave-app --self-test`, remove it.
#
#   sudo packaging/linux/smoke_test.sh [path/to/cleave-app_VERSION_ARCH.deb]
#
# Without an argument it builds the package first (`make package`, minutes). Needs
# root (dpkg) and changes the system: run it on a build machine or in a container,
# not on a machine with cleave-app installed for real (it is removed at the end).
# Not part of `make test`: the build alone takes several minutes.
set -eu

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
if [ $# -ge 1 ]; then
    DEB=$1
else
    make package
    VERSION=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' pyproject.toml | head -n 1)
    DEB=dist/cleave-app_${VERSION}_$(dpkg --print-architecture).deb
fi
[ -f "$DEB" ] || { echo "no package at $DEB" >&2; exit 1; }
if [ "$(id -u)" -ne 0 ]; then
    echo "run as root: dpkg installs and removes the package" >&2
    exit 1
fi

cleanup() {
    dpkg -r cleave-app >/dev/null 2>&1 || true
}
trap cleanup EXIT

echo "== installing $DEB"
if ! dpkg -i "$DEB"; then
    # Missing Depends leave the package unconfigured; apt fetches them and finishes.
    echo "== dpkg -i left dependencies unmet; completing with apt-get -f install"
    apt-get install -y -f --no-install-recommends
fi
dpkg -s cleave-app | grep -q '^Status: install ok installed' || {
    echo "cleave-app is not installed" >&2
    exit 1
}

echo "== checking the installed layout"
for path in /opt/cleave/cleave-app /usr/share/applications/cleave-app.desktop \
    /usr/share/icons/hicolor/256x256/apps/cleave-app.png \
    /usr/share/icons/hicolor/scalable/apps/cleave-app.svg; do
    [ -e "$path" ] || { echo "missing $path" >&2; exit 1; }
done
[ "$(command -v cleave-app)" = /usr/bin/cleave-app ] || {
    echo "cleave-app is not /usr/bin/cleave-app on PATH" >&2
    exit 1
}

echo "== cleave-app --self-test"
# A fresh config directory: the check must not depend on (or touch) root's settings.
CONFIG=$(mktemp -d)
status=0
QT_QPA_PLATFORM=offscreen CLEAVE_CONFIG_DIR="$CONFIG/cleave" cleave-app --self-test || status=$?
rm -rf "$CONFIG"
if [ "$status" -ne 0 ]; then
    echo "== self-test FAILED (exit $status)" >&2
    exit 1
fi

echo "== removing"
dpkg -r cleave-app
trap - EXIT
[ ! -e /usr/bin/cleave-app ] && [ ! -e /opt/cleave/cleave-app ] || {
    echo "dpkg -r left files behind" >&2
    exit 1
}
echo "== smoke test passed"
