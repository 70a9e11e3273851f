"""What an alert is: a named, keyed observation the router deduplicates, groups and delivers.

An alert is an event, not a state: there is no "resolved". The same condition seen again is a new
``Alert`` with the same ``key`` (name, pool, worker), which the router folds into a count instead of
sending again (see ``dsec.alerts.router``).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from dsec.model import ModelError

AlertKey = tuple[str, str | None, str | None]


class Severity(str, enum.Enum):
    """How urgently a person should look. Ordered: ``rank`` compares them."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


def _check(cond: bool, name: str, value: object, accepted: str) -> None:
    if not cond:
        raise ModelError(f"{name}={value!r} is invalid: expected {accepted}")


@dataclass(frozen=True)
class Alert:
    """One occurrence of a condition, e.g. ``w-abc_episode_stuck_env_reset_3x`` on a worker of a pool.

    ``labels`` are short strings for routing and display; ``data`` is free-form JSON-able detail.
    Both are copied into read-only mappings so a frozen alert cannot change under the router.
    """

    name: str
    severity: Severity = Severity.WARNING
    ts: float = field(default_factory=time.time)
    pool: str | None = None
    worker_id: str | None = None
    summary: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and bool(self.name), "name", self.name, "a non-empty string")
        values = [s.value for s in Severity]
        _check(self.severity in values, "severity", self.severity, f"one of {values}")
        object.__setattr__(self, "severity", Severity(self.severity))
        _check(
            isinstance(self.ts, (int, float)) and not isinstance(self.ts, bool) and math.isfinite(self.ts),
            "ts",
            self.ts,
            "finite epoch seconds",
        )
        for name in ("pool", "worker_id"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and bool(value)), name, value, "None or a non-empty string")
        _check(isinstance(self.summary, str), "summary", self.summary, "a string")
        _check(isinstance(self.labels, Mapping), "labels", self.labels, "a mapping of str to str")
        for k, v in self.labels.items():
            _check(isinstance(k, str) and isinstance(v, str), f"labels[{k!r}]", v, "a str value under a str key")
        _check(isinstance(self.data, Mapping), "data", self.data, "a mapping")
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))
        object.__setattr__(self, "data", MappingProxyType(dict(self.data)))

    def __hash__(self) -> int:
        # The mappings are not hashable; equal alerts have equal keys and timestamps, so this is consistent.
        return hash((self.key, self.ts))

    @property
    def key(self) -> AlertKey:
        """Identity for deduplication: the same condition on the same worker of the same pool."""
        return (self.name, self.pool, self.worker_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "severity": self.severity.value,
            "ts": self.ts,
            "pool": self.pool,
            "worker_id": self.worker_id,
            "summary": self.summary,
            "labels": dict(self.labels),
            "data": dict(self.data),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Alert:
        return cls(
            name=data["name"],
            severity=data.get("severity", Severity.WARNING),
            ts=float(data["ts"]) if "ts" in data else time.time(),
            pool=data.get("pool"),
            worker_id=data.get("worker_id"),
            summary=data.get("summary", ""),
            labels=dict(data.get("labels") or {}),
            data=dict(data.get("data") or {}),
        )
