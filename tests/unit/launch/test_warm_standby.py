"""A warm standby runs its order with exactly the order's environment: nothing of the launch it was started for
(a restart's DSEC_RESTORE, say) leaks into the worker it becomes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_the_order_environment_replaces_the_standbys(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text("import json, os\nprint(json.dumps({k: os.environ.get(k) for k in ('KEEP', 'LEAK')}))\n")
    env = {**os.environ, "LEAK": "from-the-restart", "KEEP": "old"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec.launch.warm"],  # no modules to warm: starts at once
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    order_env = {k: v for k, v in os.environ.items() if k != "LEAK"} | {"KEEP": "new"}
    out, err = proc.communicate(json.dumps({"argv": [str(script)], "env": order_env}).encode() + b"\n", timeout=60)
    assert proc.returncode == 0, err.decode()
    assert json.loads(out.decode().strip().splitlines()[-1]) == {"KEEP": "new", "LEAK": None}
