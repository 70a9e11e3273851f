#!/usr/bin/env bash
# Creates .venv in the repository and installs everything DSec needs. Idempotent: when the
# virtualenv already matches pyproject.toml it returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.dsec-setup-stamp
# DSEC_SETUP_EXTRAS adds extras to the default set: `make test-slow` adds `rllib` (ray[rllib] pins gymnasium to its
# own version and pulls pandas/pyarrow/scipy, which only the slow RLlib coverage test needs).
EXTRAS="torch,gym,postgres,ray,sim,dev${DSEC_SETUP_EXTRAS:+,$DSEC_SETUP_EXTRAS}"
want=$( (cat pyproject.toml scripts/setup.sh scripts/fetch-promtool.sh scripts/fetch-chromium.sh; echo "$EXTRAS") | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/dsec" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first and pinned exactly: the CPU wheel for 2.13.0 is what this machine carries; any looser
# spec can resolve to a multi-GB CUDA build. The extras' range (<2.14) is then already satisfied.
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    "${PIP[@]}" install "torch==2.13.0"
fi
"${PIP[@]}" install -e ".[$EXTRAS]" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c 'import dsec, torch, fastapi, gymnasium, matplotlib'
bash scripts/fetch-promtool.sh
bash scripts/fetch-chromium.sh
echo "$want" > "$STAMP"
