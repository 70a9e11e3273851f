"""Streaming health indicators, computed where the data is (inside the training process) so the control
plane receives features, not raw streams. Pure Python, O(window) memory, no clock inside: callers
feed values in order.

- ``RollingCV``: coefficient of variation (std / mean) over the last N values — episode-length volatility.
- ``VarianceShift``: log-ratio of a recent window's variance to a reference window's — a change-point
  statistic for reward-variance shifts (0 = no change; |x| > ~1.4 is a 4x variance change).
- ``TrendSlope``: least-squares slope over the last N values — gradient-norm decay trend.
- ``Percentiles``: p50/p95/p99 of the values seen in the current interval (reset per report).
"""

from __future__ import annotations

import math
from collections import deque


class RollingCV:
    def __init__(self, window: int = 50) -> None:
        if window < 2:
            raise ValueError(f"window={window} is invalid: expected >= 2")
        self._values: deque[float] = deque(maxlen=window)

    def add(self, x: float) -> None:
        self._values.append(float(x))

    def value(self) -> float | None:
        n = len(self._values)
        if n < 2:
            return None
        mean = sum(self._values) / n
        if mean == 0:
            return None
        var = sum((v - mean) ** 2 for v in self._values) / (n - 1)
        return math.sqrt(var) / abs(mean)


def _variance(values: list[float]) -> float:
    n = len(values)
    mean = sum(values) / n
    return sum((v - mean) ** 2 for v in values) / (n - 1)


class VarianceShift:
    """log(var(recent) / var(reference)). The reference is the ``reference`` values preceding the
    ``recent`` ones; both slide, so a persistent change reads as a shift once and then fades."""

    def __init__(self, recent: int = 20, reference: int = 60) -> None:
        if recent < 3 or reference < 3:
            raise ValueError("recent and reference windows must hold at least 3 values")
        self._recent = recent
        self._values: deque[float] = deque(maxlen=recent + reference)

    def add(self, x: float) -> None:
        self._values.append(float(x))

    def value(self) -> float | None:
        if len(self._values) < self._recent + 3:
            return None
        values = list(self._values)
        ref, rec = values[: -self._recent], values[-self._recent :]
        v_ref, v_rec = _variance(ref), _variance(rec)
        eps = 1e-12 + 1e-9 * max(v_ref, v_rec)
        return math.log((v_rec + eps) / (v_ref + eps))


class TrendSlope:
    """Slope per sample of a least-squares line through the last N values (negative = decaying)."""

    def __init__(self, window: int = 50) -> None:
        if window < 3:
            raise ValueError(f"window={window} is invalid: expected >= 3")
        self._values: deque[float] = deque(maxlen=window)

    def add(self, x: float) -> None:
        self._values.append(float(x))

    def value(self) -> float | None:
        n = len(self._values)
        if n < 3:
            return None
        xm = (n - 1) / 2
        ym = sum(self._values) / n
        num = sum((i - xm) * (y - ym) for i, y in enumerate(self._values))
        den = sum((i - xm) ** 2 for i in range(n))
        return num / den


class Percentiles:
    """Exact percentiles of one reporting interval, with a bounded sample (reservoir of the newest)."""

    def __init__(self, max_samples: int = 4096) -> None:
        self._values: deque[float] = deque(maxlen=max_samples)

    def add(self, x: float) -> None:
        self._values.append(float(x))

    def __len__(self) -> int:
        return len(self._values)

    def take(self) -> dict[str, float]:
        """{'p50', 'p95', 'p99'} of the interval (nearest-rank), then start a new interval."""
        values = sorted(self._values)
        self._values.clear()
        if not values:
            return {}
        n = len(values)

        def rank(q: float) -> float:
            return values[min(n - 1, max(0, math.ceil(q * n) - 1))]

        return {"p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99)}
