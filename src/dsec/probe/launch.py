"""``dsec run -- <command>``: run any command with the probe injected into every Python process it starts.

The injection is a ``sitecustomize`` module in ``dsec/probe/_site`` put first on PYTHONPATH; child
processes (torchrun workers, ``mp.spawn`` ranks, subprocesses) inherit it with the DSEC_* environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

SITE_DIR = Path(__file__).with_name("_site")


def probe_env(base: Mapping[str, str], settings: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus the DSEC_* ``settings`` and the injection path on PYTHONPATH."""
    env = dict(base)
    env.update(settings)
    parts = [str(SITE_DIR)]
    if env.get("PYTHONPATH"):
        parts += [p for p in env["PYTHONPATH"].split(os.pathsep) if p and p != str(SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def run(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``command``, forwarding SIGINT/SIGTERM to it; returns its exit status (128+N if killed)."""
    proc = subprocess.Popen(list(command), env=dict(env))

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code if code >= 0 else 128 - code
