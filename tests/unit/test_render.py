"""Terminal tables (dsec.render): what the workers table shows for a directive."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from dsec.render import excluded_summary, workers_table


def _worker(**desired: Any) -> dict[str, Any]:
    return {
        "id": "w-1",
        "pool": "pool-a",
        "group": "default",
        "role": "learner",
        "rank": 0,
        "state": "active",
        "beats": 1,
        "last_beat_at": 0.0,
        "metrics": {},
        "directive": {
            "in_sync": True,
            "desired_version": 1,
            "acked_version": 1,
            "desired": {"compression_bits": None, "grad_accum_steps": 1, "async_sampling": True, **desired},
        },
    }


def _text(**desired: Any) -> str:
    console = Console(width=400, record=True)
    console.print(workers_table([_worker(**desired)], now=0.0))
    return console.export_text()


def test_null_compression_shows_default_and_32_shows_32_bits() -> None:
    assert "default/x1" in _text()
    assert "32b/x1" in _text(compression_bits=32)
    assert "4b/x4/paused" in _text(compression_bits=4, grad_accum_steps=4, async_sampling=False)


def _lines(table: Any, width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text().splitlines()


def test_default_workers_view_drops_metrics_then_beat_then_role_to_fit() -> None:
    workers = [{**_worker(), "id": f"w-{i:012x}", "metrics": {"step_ms_mean": 12.5}} for i in range(3)]
    head = {width: _lines(workers_table(workers, now=0.0, width=width), width)[2] for width in (100, 80, 68, 40)}
    assert "step ms" in head[100] and "last beat" in head[100] and "role" in head[100]
    assert "step ms" not in head[80] and "last beat" not in head[80] and "role" in head[80]
    assert "role" not in head[68] and "directive" in head[68]
    # Narrow terminals squeeze the other columns first; narrower than the ids, they fold but are never cut.
    assert all(any(w["id"] in line for line in _lines(workers_table(workers, width=40), 40)) for w in workers)
    folded = _lines(workers_table(workers, now=0.0, width=20), 20)
    first_column = "".join(line.split("│")[1].strip() for line in folded if line.startswith("│"))
    assert first_column == "".join(w["id"] for w in workers)


def test_wide_workers_view_has_every_column_whatever_the_width() -> None:
    head = " ".join(_lines(workers_table([_worker()], now=0.0, wide=True, width=60), 400)[:4])
    for header in ("group", "rank", "beats", "bits/accum", "directive desired/acked", "sync p99 ms", "mem GB"):
        assert header in head


def test_exclusions_are_counted_past_three_devices_per_reason() -> None:
    excluded = {f"gpu-{i:02d}": "not in the pool" for i in range(2, 16)} | {"gpu-01": "device is degraded"}
    assert excluded_summary(excluded) == "excluded: 14 devices (not in the pool); gpu-01 (device is degraded)"
    assert excluded_summary(excluded, wide=True).startswith("excluded: gpu-02, gpu-03, ")
    assert excluded_summary({"a": "x", "b": "x", "c": "x"}) == "excluded: a, b, c (x)"
