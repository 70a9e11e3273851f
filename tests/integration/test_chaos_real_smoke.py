"""Smoke run of benchmarks/chaos_real.py --quick: both runs (DSec off and on) train under the fault mix, the crash
restarts each of them, and the last stdout line is the JSON the benchmark promises. ~80 s on two cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("gymnasium")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos_real.py"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_chaos_real_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, result.get("error") or proc.stderr[-3000:]
    for key in ("goodput_ratio", "env_steps_ratio", "applied_updates_ratio", "baseline", "dsec", "schedule"):
        assert key in result
    assert result["goodput_ratio"] is not None and result["goodput_ratio"] > 0
    for side in ("baseline", "dsec"):
        run = result[side]
        assert "error" not in run
        assert run["ppo_updates"] > 0 and run["env_steps"] > 0 and run["optimizer_steps_per_s"] > 0
        assert run["restarts"] >= 1  # the benchmark's SIGKILL restarted the group
        assert run["recovery"][0]["killed_by_benchmark"]
        assert run["faults_seen"].get("sync_delay_ms")  # the straggler windows really ran
    assert result["baseline"]["directives_issued"] == 0
    assert result["baseline"]["recovery"][0]["resumed_from_update"] == 0  # from scratch
