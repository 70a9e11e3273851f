"""grad_accum_steps=N is the mean gradient of N x world micro-batches at an unchanged learning rate,
applied once per N backward passes, with the LR schedule advancing once per update."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.control.server import free_port

pytest.importorskip("torch")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "accum_equivalence.py"


def test_accumulation_matches_the_hand_written_reference() -> None:
    proc = subprocess.run(
        [sys.executable, str(FIXTURE), str(free_port())], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_diff"] < 1e-6, result
    assert result["updates"] == 3 and result["skipped"] == 6 and result["syncs"] == 3, result
    # StepLR(gamma=0.5) is stepped after every micro-step, but only updates advance it.
    assert result["lrs"] == [0.05, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.025, 0.0125], result
