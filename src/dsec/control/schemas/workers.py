"""Bodies and answers of the worker protocol: registration, a heartbeat (metrics, events, the inferred role) and a
node agent's batch of heartbeats."""

from __future__ import annotations

import functools
import math
import re
from typing import Annotated, Any, NamedTuple

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic.json_schema import WithJsonSchema

from dsec import telemetry
from dsec.control.schemas.fields import (
    EVENT_DATA_RULES,
    METRIC_NAME_PATTERN,
    Float,
    Int,
    MetricName,
    Name,
    Strict,
    _event_data,
)
from dsec.model import MAX_MEMORY_GB, WORKER_EVENT_TYPES, EventType, Role

MAX_METRICS = 512
MAX_EVENTS_PER_BEAT = 256
# A restore slower than an hour is not a snapshot restore; a larger figure is a bug or a lie, and the pool's
# recovery time (which policies act on) is made of these.
MAX_RESTORE_S = 3600.0
# Well-known worker metrics that feed pool gauges, with the range a real worker reports them in.
GAUGE_INPUTS = {
    telemetry.MEMORY_USED_GB.name: (0.0, MAX_MEMORY_GB),
    telemetry.SYNC_OPS_TOTAL.name: (0.0, 2.0**53),
    telemetry.SYNC_OK_TOTAL.name: (0.0, 2.0**53),
}


class RegisterRequest(Strict):
    pool: Name
    role: Role = Role.OTHER
    group: Name = "default"
    rank: Int = Field(0, ge=0, le=10_000_000)
    host: str = Field("", max_length=255)
    pid: Int = Field(0, ge=0, le=2**31)
    device: Name | None = None
    heartbeat_interval_s: Float = Field(5.0, ge=0.05, le=3600)


# The schema lists what a worker may send; the validator below names the rest (decided by the control plane) in its 422.
WorkerEventType = Annotated[
    EventType,
    WithJsonSchema(
        {"type": "string", "enum": sorted(t.value for t in WORKER_EVENT_TYPES), "description": "worker-sent types"}
    ),
]


class EventIn(Strict):
    type: WorkerEventType
    ts: Float | None = Field(None, ge=0, description="worker clock (unix seconds); server time if absent")
    data: dict[str, Any] = Field(default_factory=dict, description=EVENT_DATA_RULES)

    @field_validator("type")
    @classmethod
    def _worker_type(cls, v: EventType) -> EventType:
        if v not in WORKER_EVENT_TYPES:
            allowed = sorted(t.value for t in WORKER_EVENT_TYPES)
            raise ValueError(f"event type {v.value!r} is decided by the control plane; workers may send {allowed}")
        return v

    @field_validator("data")
    @classmethod
    def _data_ok(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if info.data.get("type") is EventType.RESTORE and "restore_s" in v:  # type is validated first
            value = v["restore_s"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_RESTORE_S:
                raise ValueError(
                    f"restore_s={value!r} is invalid: expected seconds, a number in [0, {MAX_RESTORE_S:g}]"
                )
        return _event_data(v)


class InferredRole(Strict):
    """The role the probe inferred from what the process does (it registered without an explicit role)."""

    role: Role
    evidence: dict[str, Any] = Field(
        default_factory=dict, description=f"what the role was inferred from (counts); {EVENT_DATA_RULES}"
    )

    @field_validator("evidence")
    @classmethod
    def _evidence_ok(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _event_data(v)


class HeartbeatRequest(Strict):
    seq: Int = Field(..., ge=1, le=2**62, description="strictly increasing per worker; a retry repeats it")
    acked_directive_version: Int = Field(0, ge=0, le=2**31)
    metrics: dict[MetricName, Annotated[float, Field(allow_inf_nan=False, strict=True)]] = Field(
        default_factory=dict, max_length=MAX_METRICS
    )
    events: list[EventIn] = Field(default_factory=list, max_length=MAX_EVENTS_PER_BEAT)
    inferred_role: InferredRole | None = Field(
        None,
        description="sent once when the probe has inferred the worker's role; when it differs from the recorded role "
        "the record takes it and a role_inferred event (from, to, evidence) is committed with the beat",
    )

    @field_validator("metrics")
    @classmethod
    def _gauge_inputs(cls, v: dict[str, float]) -> dict[str, float]:
        return gauge_inputs(v)


def gauge_inputs(v: dict[str, float]) -> dict[str, float]:
    """The metrics pool-wide gauges (and so policies) are computed from must be plausible: one worker's absurd
    figure would otherwise move its whole pool's utilization or sync success rate."""
    for name, (lo, hi) in GAUGE_INPUTS.items():
        if name in v and not lo <= v[name] <= hi:
            raise ValueError(f"{name}={v[name]!r} is out of range: expected a number in [{lo:g}, {hi:g}]")
    ok, ops = v.get(telemetry.SYNC_OK_TOTAL.name), v.get(telemetry.SYNC_OPS_TOTAL.name)
    if ok is not None and ops is not None and ok > ops:
        raise ValueError(f"sync_ok_total={ok:g} exceeds sync_ops_total={ops:g} (successful syncs are a subset)")
    return v


class PlainBeat(NamedTuple):
    """A heartbeat that ``plain_beat`` found valid without pydantic: what ``HeartbeatRequest`` would hold for it (the
    fields the control plane reads; no events, no inferred role). A named tuple, not a frozen dataclass: made for
    every beat of a node agent's batch, it takes ~0.23 µs to construct instead of ~0.60 (a frozen dataclass sets each
    field through ``object.__setattr__``; timeit, best of 5, 2026-12-07)."""

    seq: int
    acked_directive_version: int
    metrics: dict[str, float]
    events: tuple[()] = ()
    inferred_role: None = None


#: What the control plane applies as a heartbeat: a validated one, or one ``plain_beat`` found valid.
Beat = HeartbeatRequest | PlainBeat

_PLAIN_KEYS = frozenset({"seq", "acked_directive_version", "metrics", "events"})
_METRIC_NAME = re.compile(METRIC_NAME_PATTERN[1:-1])  # fullmatch: the pattern without its anchors


@functools.lru_cache(maxsize=4096)  # bounded: a worker sending ever new names costs regex checks, not memory
def _metric_name_ok(name: str) -> bool:
    return _METRIC_NAME.fullmatch(name) is not None


def plain_beat(body: dict[str, Any]) -> PlainBeat | None:
    """``body`` (a parsed heartbeat, not modified) as a ``PlainBeat`` when it is the common beat — integers in range,
    finite float metrics with valid names, no events, nothing else — which ``HeartbeatRequest`` validates to the same
    values; None for anything else, which validation then decides (its 422 names the field). Pydantic building the
    model was ~4.5 µs per beat, most of a node agent's batch item (tests/unit/control/test_plain_beat.py proves the
    two agree)."""
    if not body.keys() <= _PLAIN_KEYS:
        return None
    seq = body.get("seq")
    acked = body.get("acked_directive_version", 0)
    metrics = body.get("metrics", _ABSENT)
    events = body.get("events", _NO_EVENTS)
    if type(seq) is not int or not 1 <= seq <= 2**62 or type(acked) is not int or not 0 <= acked <= 2**31:
        return None
    if type(events) is not list or events or type(metrics) is not dict or len(metrics) > MAX_METRICS:
        return None
    if metrics:
        # Every value a float (not an int, not a bool) and finite: a sum of floats is finite only if each is (a sum
        # of finite values that overflows says None too, and validation then accepts them: the same answer).
        values = metrics.values()
        if not _FLOAT.issuperset(map(type, values)) or not math.isfinite(sum(values)):
            return None
        if not _NAMES_OK.issuperset(metrics):
            for name in metrics:
                if type(name) is not str or not _metric_name_ok(name):
                    return None
            if len(_NAMES_OK) < _NAMES_KEPT:  # bounded, as _metric_name_ok's cache: new names cost checks, not memory
                _NAMES_OK.update(metrics)
        try:
            gauge_inputs(metrics)
        except ValueError:
            return None
    return PlainBeat(seq, acked, metrics if metrics is not _ABSENT else {})


_FLOAT = frozenset({float})
#: Metric names found valid (a set test per beat instead of a cached call per name); at most _NAMES_KEPT of them.
_NAMES_OK: set[str] = set()
_NAMES_KEPT = 4096
_ABSENT: dict[str, float] = {}  # absent (the model's default: a new empty dict), not null
_NO_EVENTS: list[Any] = []


# POST /v1/heartbeats: how many workers' beats one request may carry (each item about 0.5 KiB with ~8 metrics, so a
# full batch stays well inside max_body_bytes' default 1 MiB).
MAX_BATCH_ITEMS = 1000
WORKER_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"


class HeartbeatItem(HeartbeatRequest):
    """One worker's beat in ``POST /v1/heartbeats``: exactly the single-beat body plus whose beat it is and that
    worker's own token (each item is authenticated by its own token; docs/protocol.md says why)."""

    worker_id: str = Field(..., pattern=WORKER_ID_PATTERN)
    token: str = Field(..., min_length=1, max_length=256, description="the worker's own token (dsw_...)")


ITEM_RULES = (
    "a HeartbeatItem (#/components/schemas/HeartbeatItem); each item is checked on its own — its token first, then "
    "its fields — so an item that is not one gets its own error in the answer and the others are applied"
)


class HeartbeatBatch(Strict):
    """Body of ``POST /v1/heartbeats``: many workers' beats, answered item by item in the same order."""

    items: list[Annotated[Any, Field(description=ITEM_RULES)]] = Field(..., max_length=MAX_BATCH_ITEMS)


class BeatAnswer(BaseModel):
    """A heartbeat's answer (the single-beat route's 200 body; with ``status`` 200 as an item of a batch answer)."""

    status: int = Field(200, description="in a batch answer: 200 (applied, or a duplicate)")
    seq: int
    duplicate: bool
    server_time: float
    directive: dict[str, Any] | None = Field(..., description="the full desired directive when the acked differs")
    latency_cap_ms: float | None = None


class BeatItemError(BaseModel):
    """A batch item that was not applied: the single-beat route's error body for it, its HTTP status and its index;
    ``field`` is relative to the item, as the single-beat route names it."""

    status: int = Field(..., description="401, 403, 404, 409, 422, 429 or 503, as the single-beat route answers")
    index: int = Field(..., description="the item's position in the request, from 0")
    error: str
    message: str
    field: str | None
    details: list[dict[str, Any]]


class HeartbeatBatchAnswer(BaseModel):
    """One result per item, in the request's order."""

    items: list[BeatAnswer | BeatItemError]
