"""The pure part of ``dsec top``: API records -> rows sorted by trouble, and one frame (headline gauges, rows,
recent events) as plain data (what ``--json`` prints)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dsec import telemetry
from dsec.model import EventType

Record = Mapping[str, Any]

# Breaker phases, the most troubled first once levels are equal.
PHASE_RANK = {"open": 4, "escalating": 3, "half_open": 2, "recovering": 1, "closed": 0}
# Left out of the view: every ack of every directive, and worker log lines, would bury the rest.
QUIET_EVENTS = frozenset({EventType.DIRECTIVE_ACKED.value, EventType.LOG.value})
SHOWN_EVENTS = tuple(t.value for t in EventType if t.value not in QUIET_EVENTS)
# Sync figure shown against the latency cap: what the rank cost its group if it reports it, else its own latency.
SYNC_METRICS = (telemetry.SYNC_COST_MS_P99, telemetry.SYNC_LATENCY_MS_P99)
HEADLINE_GAUGES = {
    telemetry.SANDBOX_UTILIZATION_RATE.name: "utilization",
    telemetry.GRADIENT_SYNC_SUCCESS_RATE.name: "sync_success",
    telemetry.SNAPSHOT_RECOVERY_TIME.name: "recovery_s",
}
SYNC_SUCCESS_FLOOR = 0.9995  # the dashboard's red line
EVENT_WINDOW_S = 900.0  # how far back the first poll reads events
RECENT_EVENTS = 5  # events under the table
DETAIL_EVENTS = 10  # events in a worker's detail


# -- rows ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One worker as ``dsec top`` shows it."""

    id: str
    pool: str
    group: str
    rank: int
    role: str
    state: str
    level: int
    phase: str
    sync_ms: float | None  # the sync figure shown (see SYNC_METRICS), ms
    sync_metric: str | None  # which metric it is
    cap_ms: float | None  # the latency cap in force for the worker
    step_ms: float | None
    mem_used_gb: float | None
    mem_quota_gb: float | None  # the quota the desired directive grants
    last_event: str | None
    last_event_at: float | None

    @property
    def lost(self) -> bool:
        return self.state == "lost"

    @property
    def sync_over(self) -> float:
        """sync / cap when over the cap, else 0."""
        if self.sync_ms is None or not self.cap_ms or self.sync_ms <= self.cap_ms:
            return 0.0
        return self.sync_ms / self.cap_ms

    @property
    def mem_over(self) -> float:
        """used / quota when over the quota, else 0."""
        if self.mem_used_gb is None or not self.mem_quota_gb or self.mem_used_gb <= self.mem_quota_gb:
            return 0.0
        return self.mem_used_gb / self.mem_quota_gb

    @property
    def troubled(self) -> bool:
        return self.lost or self.level > 0 or self.phase != "closed" or bool(self.sync_over) or bool(self.mem_over)

    def trouble_key(self) -> tuple[int, int, int, float, float, str]:
        """Sort key, most troubled first: lost, then breaker level, then phase, then how far sync is over its cap,
        then how far memory is over its quota; the id breaks ties."""
        return (
            0 if self.lost else 1,
            -self.level,
            -PHASE_RANK.get(self.phase, 0),
            -self.sync_over,
            -self.mem_over,
            self.id,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "sync_over_cap": bool(self.sync_over),
            "memory_over_quota": bool(self.mem_over),
            "troubled": self.troubled,
        }


def _number(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def worker_row(w: Record, last_event: Record | None = None) -> Row:
    """A worker record of the API (``GET /v1/status`` ``workers[]``) and its latest event as a :class:`Row`."""
    metrics: Mapping[str, Any] = w.get("metrics") or {}
    sync_metric = next((m.name for m in SYNC_METRICS if _number(metrics.get(m.name)) is not None), None)
    breaker = w.get("breaker") or {}
    desired = (w.get("directive") or {}).get("desired") or {}
    return Row(
        id=w["id"],
        pool=w["pool"],
        group=w.get("group", "default"),
        rank=int(w.get("rank", 0)),
        role=w.get("role", "other"),
        state=w["state"],
        level=int(breaker.get("level", 0)),
        phase=str(breaker.get("phase", "closed")),
        sync_ms=_number(metrics.get(sync_metric)) if sync_metric else None,
        sync_metric=sync_metric,
        cap_ms=_number((w.get("caps") or {}).get("latency_ms")),
        step_ms=_number(metrics.get(telemetry.STEP_MS_MEAN.name)),
        mem_used_gb=_number(metrics.get(telemetry.MEMORY_USED_GB.name)),
        mem_quota_gb=_number(desired.get("memory_quota_gb")),
        last_event=last_event["type"] if last_event else None,
        last_event_at=_number(last_event["ts"]) if last_event else None,
    )


def _matches(row: Row, needle: str) -> bool:
    hay = (row.id, row.pool, row.group, row.role, row.state, row.phase, row.last_event or "")
    return any(needle in h.lower() for h in hay)


def build_rows(
    workers: Sequence[Record],
    last_events: Mapping[str, Record] | None = None,
    *,
    pool: str | None = None,
    group: str | None = None,
    match: str = "",
) -> list[Row]:
    """The rows of the view, most troubled first: workers of ``pool`` and ``group`` (all when None) that are active
    or lost (deregistered ones are history: ``dsec workers --state deregistered``), whose id, pool, group, role,
    state, breaker phase or last event contains ``match`` (case-insensitive)."""
    last = last_events or {}
    needle = match.strip().lower()
    rows = [
        worker_row(w, last.get(w["id"]))
        for w in workers
        if w["state"] != "deregistered"
        and (pool is None or w["pool"] == pool)
        and (group is None or w.get("group") == group)
    ]
    return sorted((r for r in rows if not needle or _matches(r, needle)), key=Row.trouble_key)


def parse_gauges(text: str) -> dict[str, dict[str, float | None]]:
    """The headline gauges per pool from ``GET /metrics`` text: ``{pool: {"utilization": .., "sync_success": ..,
    "recovery_s": ..}}``; NaN (nothing measured yet) is None."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float | None]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return out
    for family in families:
        for sample in family.samples:
            key = HEADLINE_GAUGES.get(sample.name)
            if key and "pool" in sample.labels:
                out.setdefault(sample.labels["pool"], {})[key] = _number(sample.value)
    return out


def latest_by_worker(events: Sequence[Record]) -> dict[str, Record]:
    last: dict[str, Record] = {}
    for e in events:
        if e.get("worker_id") and e["type"] not in QUIET_EVENTS:
            last[e["worker_id"]] = e
    return last


def build_frame(
    status: Record,
    gauges: Mapping[str, Mapping[str, float | None]],
    events: Sequence[Record],
    *,
    pool: str | None = None,
    group: str | None = None,
    match: str = "",
    last_events: Mapping[str, Record] | None = None,
    recent: int = RECENT_EVENTS,
) -> dict[str, Any]:
    """One frame of the view as plain data (what ``--json`` prints and the table is drawn from): the scope, the
    headline of each pool in it, the rows, and the last ``recent`` events of the scope."""
    last = latest_by_worker(events) if last_events is None else last_events
    rows = build_rows(status.get("workers", []), last, pool=pool, group=group, match=match)
    in_scope = build_rows(status.get("workers", []), pool=pool, group=group)  # the filter narrows rows only
    pools_by_name = {p["name"]: p for p in status.get("pools", [])}
    names = [pool] if pool is not None else sorted({r.pool for r in in_scope})
    headlines = []
    for name in names:
        p = pools_by_name.get(name, {})
        g = gauges.get(name, {})
        counts = p.get("workers", {})
        headlines.append(
            {
                "pool": name,
                "known": bool(p),
                "utilization": g.get("utilization"),
                "sync_success": g.get("sync_success"),
                "recovery_s": g.get("recovery_s"),
                "meltdowns": p.get("meltdowns", 0),
                "active": counts.get("active", 0),
                "lost": counts.get("lost", 0),
                "directives_pending": p.get("directives_pending", 0),
                "sync_slowdown": bool(p.get("sync_slowdown")),
            }
        )
    scope_ids = {r.id for r in in_scope}
    scoped = [
        e
        for e in events
        if e["type"] not in QUIET_EVENTS
        and (e.get("worker_id") in scope_ids or (group is None and e.get("pool") is not None and e["pool"] in names))
    ]
    return {
        "server_time": status.get("server_time"),
        "scope": {"pool": pool, "group": group, "filter": match or None},
        "pools": headlines,
        "workers": [r.to_dict() for r in rows],
        "events": list(scoped[-recent:]) if recent > 0 else [],
    }
