"""The demo's training processes: started under ``dsec run`` (the probe injected), and the PPO script's result read
back from its log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from dsec.demo.state import Proc


def spawn(name: str, role: str, command: list[str], env: dict[str, str], logdir: Path) -> Proc:
    """``command`` under `dsec run`: the probe is injected into every Python process it starts. No ``--role``: the probe
    infers each process's role from what it does (``role`` is the demo's own bookkeeping, checked by a scene)."""
    log = logdir / f"{name}.log"
    dsec = [sys.executable, "-m", "dsec.cli", "run", "--"]
    with log.open("wb") as fh:
        # A session of its own: killing the group reaches the launcher and every process it started.
        popen = subprocess.Popen(
            [*dsec, *command], env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Proc(name, role, popen, log)


def ppo_result(proc: Proc) -> dict[str, Any]:
    lines = [ln for ln in proc.log.read_text().splitlines() if ln.startswith("{")]
    try:
        return dict(json.loads(lines[-1])) if lines else {}
    except ValueError:
        return {}
