"""Terminal tables (dsec.render): what the workers table shows for a directive."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from dsec.render import workers_table


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
