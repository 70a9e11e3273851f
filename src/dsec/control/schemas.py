"""Wire schemas (pydantic v2) for the HTTP API. Validation happens here, at the edge; the core gets
frozen dataclasses from ``dsec.model``. Every model forbids unknown fields and non-finite floats.

Numbers and booleans are JSON-strict (``Int``, ``Float``, ``Bool``): the OpenAPI document says ``integer``,
``number``, ``boolean``, and pydantic's lax mode would take ``false`` for an integer or ``"1.5"`` for a number. An
integer is what JSON Schema calls one: ``3`` or ``3.0``, never ``true`` or ``3.5``. Every producer (client, probe, C
library, Hermes plugin) sends JSON numbers. Enums stay lax: FastAPI validates parsed JSON, where an enum arrives as its
string."""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.json_schema import WithJsonSchema

from dsec import telemetry
from dsec.model import (
    MAX_MEMORY_GB,
    WORKER_EVENT_TYPES,
    DeviceHealth,
    EventType,
    Role,
)


def json_integer(value: Any) -> Any:
    """JSON Schema's integer: a number with no fractional part (``3.0`` included), never a boolean. Integral floats
    become ints here; the strict int validation after it refuses everything else (strings, ``3.5``)."""
    if isinstance(value, bool):
        raise ValueError("Input should be a valid integer, not a boolean")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("Input should be a finite number")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, Field(strict=True), BeforeValidator(json_integer)]
# An optional integer's bounds go inside its Annotated (before the validator): Field(ge=...) on ``Int | None`` is
# enforced but reaches the JSON Schema as raw "ge"/"le" instead of minimum/maximum (pydantic cannot push bounds
# through a validator inside a union). tests/integration/test_api_contract.py checks the document has none.
SnapshotLevel = Annotated[int, Field(strict=True, ge=0, le=3), BeforeValidator(json_integer)]
Float = Annotated[float, Field(strict=True)]
Bool = Annotated[bool, Field(strict=True)]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="letters, digits, _ . : - (max 128)")]
MetricName = Annotated[str, Field(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]{0,99}$")]
MemoryGB = Annotated[float, Field(ge=0, le=MAX_MEMORY_GB, strict=True)]
MAX_METRICS = 512
MAX_EVENTS_PER_BEAT = 256
MAX_EVENT_DATA_BYTES = 16 * 1024
MAX_EVENT_DATA_DEPTH = 8
# A restore slower than an hour is not a snapshot restore; a larger figure is a bug or a lie, and the pool's
# recovery time (which policies act on) is made of these.
MAX_RESTORE_S = 3600.0
# Well-known worker metrics that feed pool gauges, with the range a real worker reports them in.
GAUGE_INPUTS = {
    telemetry.MEMORY_USED_GB.name: (0.0, MAX_MEMORY_GB),
    telemetry.SYNC_OPS_TOTAL.name: (0.0, 2.0**53),
    telemetry.SYNC_OK_TOTAL.name: (0.0, 2.0**53),
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, str_max_length=4096)


class Thresholds(Strict):
    bandwidth_cap_mbps: Float = Field(128.0, gt=0, le=1e6)
    latency_cap_ms: Float = Field(85.0, gt=0, le=1e6)


class PoolUpdate(Strict):
    """Body of PUT /v1/pools/{name}: a pool whose name comes from the path. ``memory_ceiling_gb`` must be >=
    ``memory_base_gb``, defaults included (422 naming ``memory_ceiling_gb``)."""

    devices: list[Name] = Field(default_factory=list, max_length=4096)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    memory_base_gb: MemoryGB = 7.0
    # validate_default: a base given alone above the default ceiling fails here, as a 422 naming the ceiling.
    memory_ceiling_gb: MemoryGB = Field(12.0, validate_default=True, description=">= memory_base_gb")
    snapshot_interval_s: Float = Field(90.0, gt=0, le=86400)
    snapshot_compression_level: SnapshotLevel = 2
    gpu_quota: Annotated[int, Field(strict=True, ge=0, le=4096), BeforeValidator(json_integer)] | None = None

    @field_validator("memory_ceiling_gb")
    @classmethod
    def _ceiling_above_base(cls, ceiling: float, info: ValidationInfo) -> float:
        base = info.data.get("memory_base_gb")  # validated first (declared first)
        if base is not None and ceiling < base:
            raise ValueError(f"memory_ceiling_gb ({ceiling:g}) must be >= memory_base_gb ({base:g})")
        return ceiling


class PoolSpec(PoolUpdate):
    """A pool in the cluster file: the same fields plus its name."""

    name: Name


class DeviceSpec(Strict):
    """A device (cluster file, PUT /v1/devices/{device_id}: there ``id`` must equal the path's ``device_id``)."""

    id: Name = Field(..., description="in PUT /v1/devices/{device_id}: equal to device_id (422 naming id)")
    node: Name
    model: str = Field("unknown", max_length=128)
    memory_gb: MemoryGB = 0.0
    numa_node: Int = Field(-1, ge=-1, le=1024)
    nvlink_peers: list[Name] = Field(default_factory=list, max_length=1024)
    health: DeviceHealth = DeviceHealth.HEALTHY
    pool: Name | None = None


class ClusterSpec(Strict):
    """The cluster YAML (`dsec serve --cluster FILE`)."""

    pools: list[PoolSpec] = Field(default_factory=list, max_length=10000)
    devices: list[DeviceSpec] = Field(default_factory=list, max_length=100000)

    @model_validator(mode="after")
    def _unique(self) -> ClusterSpec:
        for what, names in (("pools", [p.name for p in self.pools]), ("devices", [d.id for d in self.devices])):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"duplicate {what} {dup}")
        return self


class RegisterRequest(Strict):
    pool: Name
    role: Role = Role.OTHER
    group: Name = "default"
    rank: Int = Field(0, ge=0, le=10_000_000)
    host: str = Field("", max_length=255)
    pid: Int = Field(0, ge=0, le=2**31)
    device: Name | None = None
    heartbeat_interval_s: Float = Field(5.0, ge=0.05, le=3600)


def _check_json_value(value: Any, depth: int = 0) -> None:
    if depth > MAX_EVENT_DATA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_EVENT_DATA_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"non-finite number {value!r} is not allowed")
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        # The store writes event data as JSON with orjson, which holds 64-bit integers only.
        raise ValueError(f"integer {value} does not fit in 64 bits")
    if isinstance(value, dict):
        for v in value.values():
            _check_json_value(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_json_value(v, depth + 1)


# What _event_data checks that JSON Schema cannot say of free-form data (the 422 names the field).
EVENT_DATA_RULES = (
    f"any JSON object nested at most {MAX_EVENT_DATA_DEPTH} levels, at most {MAX_EVENT_DATA_BYTES // 1024} KiB, "
    "integers within 64 bits"
)


def _event_data(v: dict[str, Any]) -> dict[str, Any]:
    _check_json_value(v)
    if len(repr(v)) > MAX_EVENT_DATA_BYTES:
        raise ValueError(f"event data larger than {MAX_EVENT_DATA_BYTES} bytes")
    return v


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
        """The metrics pool-wide gauges (and so policies) are computed from must be plausible: one worker's absurd
        figure would otherwise move its whole pool's utilization or sync success rate."""
        for name, (lo, hi) in GAUGE_INPUTS.items():
            if name in v and not lo <= v[name] <= hi:
                raise ValueError(f"{name}={v[name]!r} is out of range: expected a number in [{lo:g}, {hi:g}]")
        ok, ops = v.get(telemetry.SYNC_OK_TOTAL.name), v.get(telemetry.SYNC_OPS_TOTAL.name)
        if ok is not None and ops is not None and ok > ops:
            raise ValueError(f"sync_ok_total={ok:g} exceeds sync_ops_total={ops:g} (successful syncs are a subset)")
        return v


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


def _not_nullable(schema: dict[str, Any]) -> None:
    """The schema of a field that may be omitted but not null: ``X | None`` in Python (None is "omitted"), ``X`` on
    the wire, without a default (a null sent is refused by ``_not_null``)."""
    schema.pop("default", None)
    branches = [b for b in schema.pop("anyOf", []) if b.get("type") != "null"]
    if branches:
        schema.update(branches[0])


class DirectivePatch(Strict):
    """Fields to change; omitted fields keep their value. Null clears an optional field (memory quota and
    ceiling, snapshot interval and request, target device, per-worker caps) and returns ``compression_bits`` to
    the probe's configured default (32 is uncompressed); the others cannot be null."""

    NOT_NULL: ClassVar[tuple[str, ...]] = (
        "grad_accum_steps",
        "async_sampling",
        "precision",
        "sync_priority",
    )

    compression_bits: Literal[32, 16, 8, 4] | None = None
    grad_accum_steps: Annotated[int, Field(strict=True, ge=1, le=1024), BeforeValidator(json_integer)] | None = Field(
        None, json_schema_extra=_not_nullable
    )
    async_sampling: Bool | None = Field(None, json_schema_extra=_not_nullable)
    memory_quota_gb: MemoryGB | None = None
    memory_ceiling_gb: MemoryGB | None = Field(None, description=">= memory_quota_gb once the patch is applied")
    memory_limit_gb: MemoryGB | None = Field(None, description="allocator limit; the probe caps at max(quota, limit)")
    precision: Literal["fp32", "bf16", "fp16"] | None = Field(None, json_schema_extra=_not_nullable)
    snapshot_interval_s: Float | None = Field(None, ge=1, le=86400)
    snapshot_now: str | None = Field(None, max_length=128)
    snapshot_compression_level: SnapshotLevel | None = None
    sync_priority: Annotated[int, Field(strict=True, ge=-10, le=10), BeforeValidator(json_integer)] | None = Field(
        None, json_schema_extra=_not_nullable
    )
    target_device: Name | None = None
    # Per-worker breaker caps; null returns the worker to its pool's thresholds.
    bandwidth_cap_mbps: Float | None = Field(None, gt=0, le=1e7)
    latency_cap_ms: Float | None = Field(None, gt=0, le=1e7)

    @field_validator(*NOT_NULL, mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        if value is None:
            raise ValueError("cannot be null (omit the field to keep its value)")
        return value


class TokenCreate(Strict):
    """A pool token names its pool (``kind`` defaults to pool); read and admin tokens have none."""

    # The cross-field rule in JSON Schema terms (OpenAPI 3.1), so generated clients and fuzzers see it too.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"kind": {"const": "pool"}}},
            "then": {"required": ["pool"], "properties": {"pool": {"type": "string"}}},
            "else": {"properties": {"pool": {"type": "null"}}},
        }
    )
    kind: Literal["pool", "read", "admin"] = "pool"
    pool: Name | None = None
    label: str = Field("", max_length=200)

    @model_validator(mode="after")
    def _pool_for_pool_tokens(self) -> TokenCreate:
        if self.kind == "pool" and not self.pool:
            raise ValueError("pool is required for a pool token")
        if self.kind != "pool" and self.pool:
            raise ValueError(f"a{'n' if self.kind == 'admin' else ''} {self.kind} token has no pool")
        return self


class PolicyUpload(Strict):
    """Body of PUT /v1/policies: the YAML text of a policy file and a name for its error messages."""

    model_config = ConfigDict(extra="forbid", str_max_length=1 << 20)
    text: str = Field(..., max_length=1 << 20)
    source: str = Field("policies.yaml", max_length=256)


class PlacementWorker(Strict):
    name: Name
    role: Literal["learner", "actor", "other"] = "learner"
    memory_gb: Float = Field(8.0, gt=0, le=4096)
    key: str | None = Field(None, max_length=256)


class PlacementGroup(Strict):
    name: Name
    workers: list[PlacementWorker] = Field(..., min_length=1, max_length=4096)
    load_class: Literal["long-episode", "short-episode", "sync-heavy"] = "short-episode"
    replay_share: Bool = False


class PlacementRequest(Strict):
    """Body of POST /v1/placements: a job's worker groups to place."""

    name: Name
    pool: Name | None = None
    groups: list[PlacementGroup] = Field(..., min_length=1, max_length=1024)

    @field_validator("groups")
    @classmethod
    def _unique_names(cls, groups: list[PlacementGroup]) -> list[PlacementGroup]:
        # An assignment is found by worker name, and a group restarts by name: both must be unique in the job.
        for what, names in (
            ("group", [g.name for g in groups]),
            ("worker", [w.name for g in groups for w in g.workers]),
        ):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{what} names must be unique in a job: {', '.join(dup)} repeated")
        return groups


class EventRecord(Strict):
    """Body of POST /v1/events: an event a tool records (a launcher's recovery timeline, a note)."""

    type: Literal["recovery", "log"]
    pool: Name | None = None
    worker_id: str | None = Field(None, max_length=64)
    data: dict[str, Any] = Field(default_factory=dict, description=EVENT_DATA_RULES)

    @field_validator("data")
    @classmethod
    def _data_ok(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _event_data(v)


_H16 = "[0-9A-Fa-f]{1,4}"
# IPv6 in brackets, without an embedded IPv4 (the forms RFC 4291 section 2.2 lists as 1 and 2).
_IPV6 = "|".join(
    [
        f"(?:{_H16}:){{7}}{_H16}",
        f"(?:{_H16}:){{1,7}}:",
        *(f"(?:{_H16}:){{1,{6 - k}}}(?::{_H16}){{1,{k + 1}}}" for k in range(6)),
        f":(?::{_H16}){{1,7}}",
        "::",
    ]
)
_PORT = "(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
# What egress.check_callback_url parses (urlsplit): a host name or IPv4, or a bracketed IPv6; no user-info; no
# fragment. Whether a literal address is private depends on the settings: the field's description says so.
# Path and query: visible ASCII but '#' (a URL is ASCII, RFC 3986; non-ASCII is percent-encoded). Not \S: what counts
# as whitespace differs between ECMA regexes (the schema's readers) and pydantic's (U+0085, for one).
_PATH = '(?:[/?][!-"$-~]*)?'
CALLBACK_URL_PATTERN = rf"^https?://(?:[A-Za-z0-9._~-]+|\[(?:{_IPV6})\])(?::{_PORT})?{_PATH}$"


class RuntimeRegister(Strict):
    """Body of POST /v1/runtimes: an agent runtime that wants DSec's policies at its callback URL."""

    name: Name
    type: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    callback_url: str = Field(
        ...,
        max_length=2048,
        pattern=CALLBACK_URL_PATTERN,
        description="http(s), no user-info, no fragment, port 1-65535; a literal loopback, private or link-local "
        "address is refused (422) unless webhook_allow_private",
    )
    secret: str = Field(..., min_length=16, max_length=512)
    pool: Name | None = None


class RuntimeReport(Strict):
    """Body of POST /v1/runtimes/{id}/report."""

    concurrent_agents: Int = Field(..., ge=0, le=10_000_000)
    avg_llm_latency_ms: Float = Field(..., ge=0, le=3_600_000)
    function_calling: Bool


_SCALAR: dict[str, Any] = {"type": ["string", "number", "boolean", "null"]}


class PolicyPush(BaseModel):
    """Body of POST /v1/runtimes/{id}/policies: ``policy`` plus its parameters (JSON scalars or lists of them)."""

    # What _params checks, in the schema: at most 32 parameters named by at most 64 characters, each a scalar or a
    # list of at most 256 scalars.
    model_config = ConfigDict(
        extra="allow",
        allow_inf_nan=False,
        json_schema_extra={
            "additionalProperties": {"anyOf": [_SCALAR, {"type": "array", "items": _SCALAR, "maxItems": 256}]},
            "maxProperties": 33,
            "propertyNames": {"maxLength": 64},
        },
    )
    policy: str = Field(
        ...,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="the policy's name; every other field is a parameter (integers within 64 bits)",
    )

    @model_validator(mode="after")
    def _params(self) -> PolicyPush:
        extra = self.model_extra or {}
        if len(extra) > 32:
            raise ValueError("at most 32 policy parameters")
        for key, value in extra.items():
            if len(key) > 64:
                raise ValueError(f"parameter name {key[:20]!r}... is longer than 64 characters")
            items = value if isinstance(value, list) else [value]
            if len(items) > 256 or not all(v is None or isinstance(v, (bool, int, float, str)) for v in items):
                raise ValueError(f"parameter {key!r}: expected a JSON scalar or a list of at most 256 scalars")
            _check_json_value(items)  # 64-bit integers: the push is stored and sent as JSON
        return self
