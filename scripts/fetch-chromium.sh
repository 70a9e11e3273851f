#!/usr/bin/env bash
# Installs Debian's chromium for the dashboard's browser test (tests/integration/test_dashboard_browser.py), which
# drives it with Playwright (`executable_path`; Playwright's own browser download is never used). Best effort: without
# apt-get, or when not root, a warning, and the test says why it skips.
set -uo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "warning: chromium not installed (needs apt-get as root); the dashboard browser test will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# Another apt-get (a second checkout's setup) may hold the dpkg lock: wait for it rather than give up at once.
lock=(-o DPkg::Lock::Timeout=300)
if ! apt-get "${lock[@]}" install -y -qq --no-install-recommends chromium >/dev/null 2>&1; then
    apt-get "${lock[@]}" update -qq >/dev/null 2>&1 || true
    apt-get "${lock[@]}" install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
        || echo "warning: could not install chromium; the dashboard browser test will skip" >&2
fi
exit 0
