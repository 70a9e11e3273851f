"""Body of PATCH /v1/workers/{worker_id}/directive: the directive fields an admin changes."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, field_validator

from dsec.control.schemas.fields import Bool, Float, MemoryGB, Name, SnapshotLevel, Strict, json_integer


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
