"""Wire schemas (pydantic v2) for the HTTP API. Validation happens here, at the edge; the core gets
frozen dataclasses from ``dsec.model``. Every model forbids unknown fields and non-finite floats.

Numbers and booleans are JSON-strict (``Int``, ``Float``, ``Bool``): the OpenAPI document says ``integer``,
``number``, ``boolean``, and pydantic's lax mode would take ``false`` for an integer or ``"1.5"`` for a number. An
integer is what JSON Schema calls one: ``3`` or ``3.0``, never ``true`` or ``3.5``. Every producer (client, probe, C
library, Hermes plugin) sends JSON numbers. Enums stay lax: FastAPI validates parsed JSON, where an enum arrives as its
string.

One module per resource: fields.py (the field types and ``Strict``), inventory.py (pools, devices, the cluster
file), workers.py (registration, heartbeats), directives.py, admin.py (tokens, policies, placements, events) and
runtimes.py. Every name is importable from ``dsec.control.schemas``."""

from dsec.control.schemas.admin import (
    EventRecord,
    PlacementGroup,
    PlacementRequest,
    PlacementWorker,
    PolicyUpload,
    TokenCreate,
)
from dsec.control.schemas.directives import DirectivePatch
from dsec.control.schemas.fields import (
    EVENT_DATA_RULES,
    MAX_EVENT_DATA_BYTES,
    MAX_EVENT_DATA_DEPTH,
    NAME_PATTERN,
    Bool,
    Float,
    Int,
    MemoryGB,
    MetricName,
    Name,
    SnapshotLevel,
    Strict,
    json_integer,
)
from dsec.control.schemas.inventory import (
    ClusterSpec,
    DeviceSpec,
    PoolSpec,
    PoolUpdate,
    Thresholds,
)
from dsec.control.schemas.runtimes import (
    CALLBACK_URL_PATTERN,
    PolicyPush,
    RuntimeRegister,
    RuntimeReport,
)
from dsec.control.schemas.workers import (
    GAUGE_INPUTS,
    ITEM_RULES,
    MAX_BATCH_ITEMS,
    MAX_EVENTS_PER_BEAT,
    MAX_METRICS,
    MAX_RESTORE_S,
    WORKER_ID_PATTERN,
    Beat,
    BeatAnswer,
    BeatItemError,
    EventIn,
    HeartbeatBatch,
    HeartbeatBatchAnswer,
    HeartbeatItem,
    HeartbeatRequest,
    InferredRole,
    PlainBeat,
    RegisterRequest,
    WorkerEventType,
    plain_beat,
)

__all__ = [
    "CALLBACK_URL_PATTERN",
    "EVENT_DATA_RULES",
    "GAUGE_INPUTS",
    "ITEM_RULES",
    "MAX_BATCH_ITEMS",
    "MAX_EVENTS_PER_BEAT",
    "MAX_EVENT_DATA_BYTES",
    "MAX_EVENT_DATA_DEPTH",
    "MAX_METRICS",
    "MAX_RESTORE_S",
    "NAME_PATTERN",
    "WORKER_ID_PATTERN",
    "Beat",
    "BeatAnswer",
    "BeatItemError",
    "Bool",
    "ClusterSpec",
    "DeviceSpec",
    "DirectivePatch",
    "EventIn",
    "EventRecord",
    "Float",
    "HeartbeatBatch",
    "HeartbeatBatchAnswer",
    "HeartbeatItem",
    "HeartbeatRequest",
    "InferredRole",
    "Int",
    "MemoryGB",
    "MetricName",
    "Name",
    "PlacementGroup",
    "PlacementRequest",
    "PlacementWorker",
    "PlainBeat",
    "PolicyPush",
    "PolicyUpload",
    "PoolSpec",
    "PoolUpdate",
    "RegisterRequest",
    "RuntimeRegister",
    "RuntimeReport",
    "SnapshotLevel",
    "Strict",
    "Thresholds",
    "TokenCreate",
    "WorkerEventType",
    "json_integer",
    "plain_beat",
]
