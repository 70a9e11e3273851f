"""The probe's memory metrics: what the process holds now, and how fast that grows.

``memory_growth_gb_per_h`` is what the control plane's device profiles learn leaky cards from
(``RunRecord.leak_gb_per_h``). It is the least-squares slope of ``memory_used_gb`` over the last
``WINDOW_S``: a slope through every sample, not (last - first), so one allocator spike at either end of
the window does not read as a leak. With too few samples, or samples spanning too little time, the
slope is noise and nothing is reported.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from dsec import telemetry

# Ten minutes: long enough that the caching allocator's step-to-step swings average out, short enough that
# a leak starting mid-run shows within one window.
WINDOW_S = 600.0
MIN_SAMPLES = 5
MIN_SPAN_S = 60.0


def growth_gb_per_h(
    samples: Sequence[tuple[float, float]], min_samples: int = MIN_SAMPLES, min_span_s: float = MIN_SPAN_S
) -> float | None:
    """Least-squares slope of ``(t_seconds, gb)`` samples in GB per hour; None with fewer than ``min_samples``
    samples or when they span less than ``min_span_s`` seconds."""
    n = len(samples)
    if n < max(2, min_samples):
        return None
    ts = [t for t, _ in samples]
    if max(ts) - min(ts) < min_span_s:
        return None
    t_mean = sum(ts) / n
    y_mean = sum(y for _, y in samples) / n
    # Centred sums: times are monotonic-clock seconds (large), and uncentred sums would lose precision.
    sxx = sum((t - t_mean) ** 2 for t in ts)
    sxy = sum((t - t_mean) * (y - y_mean) for t, y in samples)
    return sxy / sxx * 3600.0


class MemoryTrend:
    """``memory_used_gb`` samples of the last ``window_s`` (one per beat) and their slope."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        window_s: float = WINDOW_S,
        min_samples: int = MIN_SAMPLES,
        min_span_s: float = MIN_SPAN_S,
    ) -> None:
        self._clock = clock
        self.window_s = window_s
        self.min_samples = min_samples
        self.min_span_s = min_span_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, used_gb: float) -> float | None:
        """Record a sample now; the growth in GB/h over the window, or None while there is too little data."""
        now = self._clock()
        self._samples.append((now, used_gb))
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        return growth_gb_per_h(self._samples, self.min_samples, self.min_span_s)


def memory_metrics() -> dict[str, float]:
    """Memory held now: CUDA (per device, and reserved overall) when torch has initialized it, else the RSS."""
    out: dict[str, float] = {}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"cuda{i}_allocated_gb"] = torch.cuda.memory_allocated(i) / 2**30
            out[f"cuda{i}_reserved_gb"] = torch.cuda.memory_reserved(i) / 2**30
        out[telemetry.MEMORY_USED_GB.name] = torch.cuda.memory_reserved() / 2**30
        return out
    with contextlib.suppress(Exception):  # no psutil, or /proc unreadable: no memory figure this beat
        out[telemetry.MEMORY_USED_GB.name] = _this_process().memory_info().rss / 2**30
    return out


_process: Any = None


def _this_process() -> Any:
    """This process's psutil handle, made once (constructing one reads /proc and cost ~0.4 ms of each beat's ~1.1 ms);
    a forked child makes its own."""
    global _process
    import psutil

    if _process is None or _process.pid != os.getpid():
        _process = psutil.Process()
    return _process
