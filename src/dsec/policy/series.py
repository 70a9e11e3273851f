"""Metric history for policy expressions: bounded in-memory series keyed by (metric, pool, worker).

The control plane samples its gauges into it on a fixed interval; `dsec policy test` fills it from a file. Series
older than the longest window any rule reads (plus one sample interval) are dropped.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from typing import Any

Key = tuple[str, str, str | None]  # metric, pool, worker


class _Series:
    """One series: times and values in parallel lists (times ascending), oldest live sample at ``start``. Lookups
    bisect instead of scanning — a rule over ``[2h]`` at a 15 s interval reads 480 samples, every evaluation."""

    __slots__ = ("start", "times", "values")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.values: list[float] = []
        self.start = 0

    def drop_before(self, cutoff: float, max_points: int) -> None:
        self.start = max(bisect.bisect_left(self.times, cutoff, self.start), len(self.times) - max_points)
        if self.start > 1024 and self.start * 2 > len(self.times):  # compact now and then, not on every add
            del self.times[: self.start], self.values[: self.start]
            self.start = 0

    def points(self, lo: int | None = None, hi: int | None = None) -> list[tuple[float, float]]:
        lo = self.start if lo is None else lo
        hi = len(self.times) if hi is None else hi
        return list(zip(self.times[lo:hi], self.values[lo:hi], strict=True))


class SeriesStore:
    def __init__(self, retention_s: float = 3600.0, max_points: int = 100_000) -> None:
        self.retention_s = retention_s
        self.max_points = max_points
        self._data: dict[Key, _Series] = {}

    def add(self, t: float, samples: Mapping[Key, float]) -> None:
        cutoff = t - self.retention_s
        for key, value in samples.items():
            q = self._data.get(key)
            if q is None:
                q = self._data[key] = _Series()
            if len(q.times) > q.start and q.times[-1] > t:
                continue  # out of order: ignore rather than corrupt the ordering
            q.times.append(t)
            q.values.append(float(value))
            q.drop_before(cutoff, self.max_points)

    def add_series(self, key: Key, points: Iterable[tuple[float, float]]) -> None:
        for t, v in sorted(points):
            self.add(t, {key: v})

    def instant(self, key: Key, now: float) -> float:
        q = self._data.get(key)
        if q is None:
            return math.nan
        i = bisect.bisect_right(q.times, now, q.start)
        return q.values[i - 1] if i > q.start else math.nan

    def range(self, key: Key, now: float, window_s: float) -> list[tuple[float, float]]:
        """Samples with now - window_s <= t <= now, oldest first."""
        q = self._data.get(key)
        if q is None:
            return []
        lo = bisect.bisect_left(q.times, now - window_s, q.start)
        hi = bisect.bisect_right(q.times, now, lo)
        return q.points(lo, hi)

    def series_keys(self) -> list[Key]:
        return sorted(
            (k for k, q in self._data.items() if len(q.times) > q.start), key=lambda k: (k[0], k[1], k[2] or "")
        )

    def export(self) -> dict[str, Any]:
        """The JSON form `dsec metrics export` writes and `dsec policy test --series` reads."""
        return {
            "format": 1,
            "series": [
                {
                    "metric": m,
                    "labels": {"pool": p, **({"worker": w} if w else {})},
                    "samples": [[t, v if math.isfinite(v) else None] for t, v in self._data[(m, p, w)].points()],
                }
                for m, p, w in self.series_keys()
            ],
        }

    @classmethod
    def from_export(cls, data: Mapping[str, Any], retention_s: float = 1e12) -> SeriesStore:
        if not isinstance(data, Mapping) or not isinstance(data.get("series"), list):
            raise ValueError('a series file is a JSON object {"series": [{"metric", "labels", "samples"}, ...]}')
        store = cls(retention_s=retention_s)
        for i, s in enumerate(data["series"]):
            try:
                if not isinstance(s, Mapping):
                    raise TypeError(f"an object, not {type(s).__name__}")
                labels = s.get("labels") or {}
                key: Key = (str(s["metric"]), str(labels["pool"]), labels.get("worker"))
                points = [(float(t), math.nan if v is None else float(v)) for t, v in s["samples"]]
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(
                    f"series[{i}]: expected metric, labels.pool and samples [[t, v], ...] ({exc})"
                ) from None
            store.add_series(key, points)
        return store

    def span(self) -> tuple[float, float] | None:
        live = [q for q in self._data.values() if len(q.times) > q.start]
        if not live:
            return None
        return (min(q.times[q.start] for q in live), max(q.times[-1] for q in live))
