"""The demo is the front door: it must run end to end on real processes and pass its own checks. The test reads the
summary the demo writes as JSON (``--summary-json``), not its rendered tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.demo import HEADLINE_METRICS

# Every capability the demo shows, by the start of its scene's title: each must have played and passed.
SCENES = (
    "circuit breaker",
    "stuck episodes",
    "4-bit gradient compression",
    "paused sampling",
    "liveness",
    "roles inferred",
    "Prometheus /metrics",
    "policy engine",
    "webhooks",
    "state snapshots",
    "restart from snapshots",
    "healing",
    "actor restart",
    "degraded device",
    "memory quotas",
    "memory burst",
    "room for a burst",
    "training processes finished cleanly",
    "simulator",
)


@pytest.mark.timeout(240)
def test_demo_runs_to_its_summary(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    path = tmp_path / "summary.json"
    proc = subprocess.run(
        # Long enough for the breaker scene: a fault window, four escalations/acks and three step-downs.
        [sys.executable, "-m", "dsec.cli", "demo", "--workers", "2", "--duration", "30", "--summary-json", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert path.exists(), f"no summary written (exit {proc.returncode}): {out[-4000:]}"
    summary = json.loads(path.read_text())
    failed = [title for title, ok in summary["scenes"].items() if not ok]
    assert failed == [], f"scenes failed: {failed}\n{out[-4000:]}"
    assert proc.returncode == summary["exit_code"] == 0, out[-4000:]
    for prefix in SCENES:
        assert any(title.startswith(prefix) for title in summary["scenes"]), f"no scene {prefix!r}"
    for name in HEADLINE_METRICS:
        assert summary["rows"][f"{name} (mid-run)"] != "missing", name
    # What the scenes' checks rest on, as counts: a meltdown and its recovery, a worker lost, directives acked.
    events = summary["events"]
    assert events.get("meltdown", 0) >= 1 and events.get("recovered", 0) >= 1, events
    assert events.get("directive_acked", 0) >= 1 and events.get("lost", 0) >= 1, events
    notes = "\n".join(summary["notes"])
    assert "back to level 0" in notes and "_episode_stuck_collision_3x" in notes, notes
