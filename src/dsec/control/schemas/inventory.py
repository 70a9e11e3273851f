"""Bodies of the inventory: pools (PUT /v1/pools/{name}), devices (PUT /v1/devices/{device_id}) and the cluster
file that holds both (``dsec serve --cluster``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from dsec.control.schemas.fields import Float, Int, MemoryGB, Name, SnapshotLevel, Strict, json_integer
from dsec.model import DeviceHealth


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
    compression_bits: Literal[8, 16, 32] | None = Field(
        None,
        description="the gradient compression of this pool's workers while the breaker asks nothing of them: 8 "
        "(8-bit with error feedback), 16 or 32 (uncompressed); null: each probe's own default "
        "(DSEC_COMPRESSION_BITS, uncompressed as shipped). The breaker's first rung is 4-bit whatever this is.",
    )
    memory_pressure: Annotated[Float, Field(gt=0, le=1)] | None = Field(
        None,
        description="the breaker's memory path for this pool: a worker's memory cap is memory_ceiling_gb times this "
        "fraction (accumulation, then paused sampling, above it); null: the control plane's default "
        "(DSEC_MEMORY_PRESSURE, off as shipped). For training code that shrinks its micro-batch under accumulation.",
    )

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
    card: Name | None = Field(
        None,
        description="the physical accelerator this device is a process slot of: devices naming the same card share "
        "its memory (give each the card's memory_gb), and memory quotas are planned per card; omitted: a card of "
        "its own",
    )


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
