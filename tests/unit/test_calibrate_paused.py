"""The pure parts of benchmarks/calibrate_paused.py: configuration names and the per-configuration summary."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import load_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "calibrate_paused.py"


def _bench() -> Any:
    sys.path.insert(0, str(BENCH.parent))  # it imports calibrate_efficiency's sign test from its own folder
    return load_module("calibrate_paused", BENCH)


cal = _bench()


def _run(config: str, seed: int, seconds: float, steps: int, reached: bool = True, held: bool | None = True) -> dict:
    return {
        "config": config,
        "seed": seed,
        "reached": reached,
        "seconds": seconds,
        "env_steps": steps,
        "updates": steps // 512,
        "mean_policy_lag": 4.0,
        "learner_wait_fraction": 0.6,
        "pause_held": None if config == "none" else held,
    }


def test_configuration_names() -> None:
    assert cal.paused_count("none") == 0
    assert cal.paused_count("paused1") == 1
    assert cal.paused_count("paused12") == 12
    for bad in ("paused", "paused0", "pausedx", "all", "Paused1"):
        with pytest.raises(ValueError, match=bad):
            cal.paused_count(bad)


def test_summary_ratios_against_none_and_the_two_models() -> None:
    runs = [
        _run("none", 1, 10.0, 50_000),
        _run("none", 2, 12.0, 60_000),
        _run("none", 3, 14.0, 55_000),
        _run("paused1", 1, 13.0, 48_000),
        _run("paused1", 2, 16.0, 60_000),
        _run("paused1", 3, 18.0, 50_000),
    ]
    out = cal.summarize(runs, actors=4)
    none, p1 = out["none"], out["paused1"]
    assert none["paused_actors"] == 0 and "progress_ratio" not in none
    assert none["median_seconds"] == 12.0 and none["median_env_steps"] == 55_000
    assert p1["progress_ratio"] == pytest.approx(12.0 / 16.0, abs=1e-3)
    assert p1["sample_efficiency"] == pytest.approx(55_000 / 50_000, abs=1e-3)
    assert p1["model_mean_of_workers"] == 0.8 and p1["model_actor_share"] == 0.75
    assert p1["paired_ratios"] == [round(10 / 13, 3), 0.75, round(14 / 18, 3)]
    assert p1["sign_test_p"] == 0.25  # 3 of 3 below 1: two-sided 2 x 1/8
    lo, hi = p1["ci90"]
    # Resampled medians range over the runs themselves: from 10/18 to 14/13.
    assert 10 / 18 - 1e-3 <= lo <= p1["progress_ratio"] <= hi <= 14 / 13 + 1e-3
    assert p1["pauses_held"] is True and p1["not_reached"] == 0


def test_unreached_runs_stay_out_of_the_ratios_and_a_pause_not_held_is_reported() -> None:
    runs = [
        _run("none", 1, 10.0, 50_000),
        _run("none", 2, 10.0, 50_000),
        _run("paused2", 1, 20.0, 50_000),
        _run("paused2", 2, 300.0, 400_000, reached=False, held=False),
    ]
    p2 = cal.summarize(runs, actors=4)["paused2"]
    assert p2["not_reached"] == 1
    assert p2["median_seconds"] == 20.0 and p2["progress_ratio"] == 0.5
    assert p2["paired_ratios"] == [0.5]
    assert p2["model_mean_of_workers"] == 0.6 and p2["model_actor_share"] == 0.5
    assert p2["pauses_held"] is False


def test_summarize_reads_run_records_of_several_sittings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    runs = tmp_path / "runs.jsonl"
    sittings = [[_run("none", 1, 10.0, 50_000), _run("paused1", 1, 14.0, 52_000)],
                [_run("none", 6, 12.0, 55_000), _run("paused1", 6, 15.0, 56_000)]]  # fmt: skip
    for sitting in sittings:
        with runs.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in sitting)
    assert cal.main(["--summarize", str(runs)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["seeds"] == [1, 6] and len(out["runs"]) == 4
    assert out["configs"]["paused1"]["paired_ratios"] == [round(10 / 14, 3), 0.8]
