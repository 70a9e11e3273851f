"""The pure parts of benchmarks/calibrate_efficiency.py: medians with unreached runs, efficiency, the summary."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from conftest import load_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "calibrate_efficiency.py"


def _bench() -> Any:
    return load_module("calibrate_efficiency", BENCH)


cal = _bench()


def _run(config: str, seed: int, steps: int | None, updates: int = 10) -> dict[str, Any]:
    return {
        "config": config,
        "seed": seed,
        "reached": steps is not None,
        "env_steps": steps if steps is not None else 400_000,
        "updates": updates,
        "optimizer_steps": updates * 32,
        "seconds": 30.0,
    }


def test_median_counts_unreached_runs_as_more_than_the_limit() -> None:
    assert cal.median_steps([30, 10, 20]) == 20
    assert cal.median_steps([10, None, 20]) == 20  # the unreached run sorts last
    assert cal.median_steps([10, None, None]) == math.inf  # most runs failed: no finite median
    assert math.isnan(cal.median_steps([]))


def test_efficiency_is_baseline_over_config() -> None:
    assert cal.efficiency(100.0, 200.0) == 0.5
    assert cal.efficiency(100.0, 80.0) == 1.25
    assert cal.efficiency(100.0, math.inf) is None
    assert cal.efficiency(math.nan, 100.0) is None


def test_summary_per_configuration() -> None:
    runs = [
        *(_run("uncompressed", s, n) for s, n in ((1, 100), (2, 120), (3, 110))),
        *(_run("4bit", s, n) for s, n in ((1, 105), (2, 90), (3, 130))),
        *(_run("accum4", s, n) for s, n in ((1, 300), (2, None), (3, 250))),
    ]
    out = cal.summarize(runs)
    assert set(out) == {"uncompressed", "4bit", "accum4"}
    base, four, acc = out["uncompressed"], out["4bit"], out["accum4"]
    assert base["efficiency"] == 1.0 and base["resolved"] is False
    assert four["seeds"] == [1, 2, 3] and four["steps_to_target"] == [105, 90, 130]
    assert (four["median"], four["min"], four["max"], four["not_reached"]) == (105, 90, 130, 0)
    assert four["efficiency"] == round(110 / 105, 3)
    assert four["paired_ratios"] == [round(100 / 105, 3), round(120 / 90, 3), round(110 / 130, 3)]
    assert four["separated"] is False and four["resolved"] is False  # its range overlaps the baseline's
    assert four["sign_test_p"] == 1.0  # one seed slower, two faster
    lo, hi = four["efficiency_ci90"]
    assert lo < 1.0 < hi
    assert acc["steps_to_target"] == [300, None, 250] and acc["not_reached"] == 1
    assert (acc["median"], acc["min"], acc["max"]) == (300, 250, 300)
    assert acc["efficiency"] == round(110 / 300, 3)
    assert acc["paired_ratios"] == [round(100 / 300, 3), 0.0, round(110 / 250, 3)]  # unreached: ratio 0
    assert acc["separated"] is False  # a run that failed leaves the range open
    assert acc["sign_test_p"] == 0.25 and acc["resolved"] is False  # 3 of 3 below 1 is no evidence yet
    json.dumps(out)  # the last stdout line carries it


def test_resolved_when_every_seed_is_slower_and_the_interval_excludes_one() -> None:
    base = (100, 120, 90, 200, 110, 95)
    runs = [_run("uncompressed", s, n) for s, n in enumerate(base)]
    runs += [_run("accum4", s, 2 * n) for s, n in enumerate(base)]
    acc = cal.summarize(runs)["accum4"]
    assert acc["paired_ratios"] == [0.5] * 6
    assert acc["sign_test_p"] == round(2 / 64, 4)
    assert acc["efficiency_ci90"][1] < 1.0
    assert acc["resolved"] is True and acc["separated"] is False  # the ranges overlap (200 vs 180)
    # Five seeds are not enough for the sign test at 5%, however clear the difference.
    five = [r for r in runs if r["seed"] < 5]
    assert cal.summarize(five)["accum4"]["resolved"] is False


def test_sign_test() -> None:
    assert cal.sign_test_p([]) is None
    assert cal.sign_test_p([1.0, 1.0]) is None  # ties only
    assert cal.sign_test_p([0.5] * 10) == 2 / 1024
    assert cal.sign_test_p([0.5, 2.0]) == 1.0


def test_expected_optimizer_steps_under_accumulation() -> None:
    assert cal.expected_optimizer_steps(10, 8, 4, 1) == 320
    assert cal.expected_optimizer_steps(10, 8, 4, 4) == 80


@pytest.mark.parametrize("name", list(cal.CONFIGS))
def test_configurations_are_valid_probe_settings(name: str) -> None:
    bits, accum = cal.CONFIGS[name]
    assert bits in (32, 16, 8, 4) and 1 <= accum <= 1024
    assert cal.BASELINE in cal.CONFIGS and cal.CONFIGS[cal.BASELINE] == (32, 1)


def test_report_is_one_json_object_with_the_summary() -> None:
    runs = [
        {**_run("uncompressed", 1, 100), "settings_held": True, "accum_from_start": True},
        {**_run("accum4", 1, 200), "settings_held": True, "accum_from_start": False},
    ]
    args = argparse.Namespace(target_return=475.0, total_steps=400_000)
    out = json.loads(json.dumps(cal.report(runs, args, 12.5)))
    assert out["configs"]["accum4"]["efficiency"] == 0.5
    assert out["seeds"] == [1] and out["baseline"] == "uncompressed" and len(out["runs"]) == 2
    assert out["all_settings_held"] is True and out["all_accum_from_start"] is False
    assert out["paused_actor_fraction"].startswith("not calibrated")
