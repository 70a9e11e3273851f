#!/usr/bin/env bash
# Puts promtool and prometheus (from Debian's prometheus package, unpacked, not installed) into .venv/tools/bin for
# the metrics-format test, the rule tests (deploy/prometheus) and the real-Prometheus scrape test. Best effort:
# without apt the tests say why they skip.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=.venv/tools
[ -x "$DEST/bin/promtool" ] && [ -x "$DEST/bin/prometheus" ] && exit 0
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
cp "$tmp/root/usr/bin/prometheus" "$DEST/bin/prometheus"
