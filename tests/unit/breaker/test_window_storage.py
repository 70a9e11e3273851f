"""The breaker's evidence window: which samples it keeps, and what keeping them costs per worker.

A control plane holds one breaker per worker (10,000 in the soak), so the window's storage is per-worker memory: a
deque took a 64-slot block (~0.5 KB) per window and a second one each time its samples crossed into the next block,
which 10,000 breakers started together did on the same beat (a one-time ~10 MB step in the soak's RSS)."""

from __future__ import annotations

import tracemalloc
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.breaker import Breaker, BreakerConfig, Caps

CAPS = Caps(bandwidth_mbps=128.0, latency_ms=85.0)


def _kept_by_reference(times: list[float], window_s: float) -> list[tuple[float, int]]:
    """What the window keeps, by its definition, as (time, beat index): each beat appends, then drops from the oldest
    end every sample older than ``window_s`` before the newest (in arrival order: a worker's clock may step back)."""
    kept: deque[tuple[float, int]] = deque()
    for i, ts in enumerate(times):
        kept.append((ts, i))
        while kept and kept[0][0] < ts - window_s:
            kept.popleft()
    return list(kept)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.floats(min_value=-2.0, max_value=5.0, allow_nan=False), min_size=1, max_size=60),
    window_s=st.sampled_from([0.5, 3.0, 10.0]),
)
def test_the_window_keeps_what_its_definition_keeps(steps: list[float], window_s: float) -> None:
    b = Breaker(BreakerConfig(window_s=window_s, min_samples=3))
    times, ts = [], 1000.0
    for i, dt in enumerate(steps):  # mostly forward, sometimes back (a worker's clock)
        ts += dt
        b.observe_values(ts, {"sync_latency_ms_p99": float(i)}, CAPS)
        times.append(ts)
    kept = _kept_by_reference(times, window_s)
    assert list(b._sample_ts) == [ts for ts, _ in kept]
    assert [v["sync_latency_ms_p99"] for v in b._samples] == [float(i) for _, i in kept]


def test_a_breakers_window_costs_little_memory_after_many_beats() -> None:
    """1,000 breakers, 40 beats each 1 s apart (a 3 s window keeps 3-4 samples): the windows' storage stays under
    0.4 KB per breaker (lists of 4: ~0.25 KB; a deque's blocks were ~1-2 KB per breaker: over the bound)."""
    config = BreakerConfig(window_s=3.0, min_samples=3)
    breakers = [Breaker(config) for _ in range(1000)]
    values = [{"sync_latency_ms_p99": 10.0} for _ in range(40)]  # made before tracing: the samples are not counted
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for beat in range(40):
            for b in breakers:
                b.observe_values(float(beat), values[beat], CAPS)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert all(len(b._sample_ts) == 4 for b in breakers)
    per_breaker = grown / len(breakers)
    assert per_breaker < 400, f"{per_breaker:.0f} bytes of window storage per breaker"
