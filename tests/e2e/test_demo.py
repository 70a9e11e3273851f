"""The demo is the front door: it must run end to end on real processes and pass its own checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(240)
def test_demo_runs_to_its_summary() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    proc = subprocess.run(
        # Long enough for the breaker scene: a fault window, four escalations/acks and three step-downs.
        [sys.executable, "-m", "dsec.cli", "demo", "--workers", "2", "--duration", "30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "DSec demo summary" in out
    assert "FAILED" not in out
    for check in (
        "acked",
        "lost",
        "training processes finished cleanly",
        "dsec_melt_down_count",
        "circuit breaker",
        "back to level 0",
        "_episode_stuck_collision_3x",
        "simulator",
    ):
        assert check in out, check
