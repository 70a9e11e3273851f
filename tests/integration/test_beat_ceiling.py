"""benchmarks/beat_ceiling.py at a small scale: it applies every beat it sends and reports consistent figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "beat_ceiling.py"


def test_beat_ceiling_small_run_applies_every_beat() -> None:
    args = ["--workers", "120", "--batch", "50", "--duration", "0.2", "--warmup", "2"]
    done = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["errors"] == 0  # every item answered 200 and not as a duplicate: seqs and tokens were right
    assert (result["workers"], result["batch"]) == (120, 50)
    for phase in ("alone", "serving"):
        us, per_s = result[f"{phase}_us_per_beat"], result[f"{phase}_beats_per_s"]
        assert us > 0
        assert result[f"{phase}_beats"] % 120 == 0 and result[f"{phase}_beats"] >= 120  # whole rounds
        assert abs(per_s - 1e6 / us) <= 0.01 * per_s + 1  # the rate is the time per beat's inverse
    # Parsing and answering a beat is a part of applying it, which parses and answers it too.
    assert 0 < result["json_us_per_beat"] < result["alone_us_per_beat"]
    assert result["vs_target"] == round(result["serving_beats_per_s"] / result["target_beats_per_s"], 3)
