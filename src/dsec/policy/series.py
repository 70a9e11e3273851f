"""Metric history for policy expressions: bounded in-memory series keyed by (metric, pool, worker).

The control plane samples its gauges into it on a fixed interval; `dsec policy test` fills it from a file. Series
older than the longest window any rule reads (plus one sample interval) are dropped.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

Key = tuple[str, str, str | None]  # metric, pool, worker


class SeriesStore:
    def __init__(self, retention_s: float = 3600.0, max_points: int = 100_000) -> None:
        self.retention_s = retention_s
        self.max_points = max_points
        self._data: dict[Key, deque[tuple[float, float]]] = {}

    def add(self, t: float, samples: Mapping[Key, float]) -> None:
        cutoff = t - self.retention_s
        for key, value in samples.items():
            q = self._data.get(key)
            if q is None:
                q = self._data[key] = deque(maxlen=self.max_points)
            if q and q[-1][0] > t:
                continue  # out of order: ignore rather than corrupt the ordering
            q.append((t, float(value)))
            while q and q[0][0] < cutoff:
                q.popleft()

    def add_series(self, key: Key, points: Iterable[tuple[float, float]]) -> None:
        for t, v in sorted(points):
            self.add(t, {key: v})

    def instant(self, key: Key, now: float) -> float:
        q = self._data.get(key)
        if not q:
            return math.nan
        times = [t for t, _ in q]
        i = bisect.bisect_right(times, now)
        return q[i - 1][1] if i else math.nan

    def range(self, key: Key, now: float, window_s: float) -> list[tuple[float, float]]:
        """Samples with now - window_s <= t <= now, oldest first."""
        q = self._data.get(key)
        if not q:
            return []
        return [(t, v) for t, v in q if now - window_s <= t <= now]

    def series_keys(self) -> list[Key]:
        return sorted(self._data, key=lambda k: (k[0], k[1], k[2] or ""))

    def export(self) -> dict[str, Any]:
        """The JSON form `dsec metrics export` writes and `dsec policy test --series` reads."""
        return {
            "format": 1,
            "series": [
                {
                    "metric": m,
                    "labels": {"pool": p, **({"worker": w} if w else {})},
                    "samples": [[t, v if math.isfinite(v) else None] for t, v in self._data[(m, p, w)]],
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
        times = [t for q in self._data.values() for t, _ in q]
        return (min(times), max(times)) if times else None
