#!/usr/bin/env bash
# Puts promtool (from Debian's prometheus package, unpacked, not installed: ~19 MB instead of ~330 MB)
# into .venv/tools/bin for the metrics-format test. Best effort: without apt the test says why it skips.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=.venv/tools
[ -x "$DEST/bin/promtool" ] && exit 0
command -v apt-get >/dev/null || { echo "apt-get not found; promtool test will skip" >&2; exit 0; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
if ! apt-get download prometheus >/dev/null 2>&1; then
    apt-get update -qq >/dev/null 2>&1 || true
    apt-get download prometheus >/dev/null 2>&1 || { echo "could not download prometheus .deb" >&2; exit 0; }
fi
dpkg-deb -x prometheus_*.deb root
cd - >/dev/null
mkdir -p "$DEST/bin"
cp "$tmp/root/usr/bin/promtool" "$DEST/bin/promtool"
