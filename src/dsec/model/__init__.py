"""Domain types shared by every layer: pools, devices, workers, directives, events.

Frozen dataclasses with validation on construction; the enumerations they use (roles, worker states, device health,
event types) are in :mod:`dsec.model.kinds` and importable from here. Nothing here imports a web framework, a
database driver or torch; the control plane translates these to and from its wire schemas and
its tables, the probe to and from its transport.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from dsec.errors import InvalidInput
from dsec.model.kinds import WORKER_EVENT_TYPES as WORKER_EVENT_TYPES
from dsec.model.kinds import DeviceHealth as DeviceHealth
from dsec.model.kinds import EventType as EventType
from dsec.model.kinds import Role as Role
from dsec.model.kinds import WorkerState as WorkerState


class ModelError(InvalidInput, ValueError):
    """A domain value is out of range; the message names the field and the accepted values."""


COMPRESSION_BITS = (32, 16, 8, 4)
POOL_COMPRESSION_BITS = (32, 16, 8)  # a pool's default (Pool.compression_bits): 4 is the breaker's first rung
PRECISIONS = ("fp32", "bf16", "fp16")
# Sizes beyond this are typos (a TB instead of a GB), not hardware.
MAX_MEMORY_GB = 4096.0


def _check(cond: bool, name: str, value: object, accepted: str) -> None:
    if not cond:
        raise ModelError(f"{name}={value!r} is invalid: expected {accepted}")


def _finite_nonneg(name: str, value: float, upper: float) -> None:
    _check(
        isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= upper,
        name,
        value,
        f"a finite number in [0, {upper:g}]",
    )


@dataclass(frozen=True)
class PoolThresholds:
    """The breaker's two caps for a pool (per-worker overrides come later)."""

    bandwidth_cap_mbps: float = 128.0
    latency_cap_ms: float = 85.0

    def __post_init__(self) -> None:
        _check(self.bandwidth_cap_mbps > 0, "bandwidth_cap_mbps", self.bandwidth_cap_mbps, "> 0")
        _check(self.latency_cap_ms > 0, "latency_cap_ms", self.latency_cap_ms, "> 0")


SNAPSHOT_LEVELS = (0, 1, 2, 3)


def _check_level(level: Any) -> None:
    _check(
        isinstance(level, int) and not isinstance(level, bool) and level in SNAPSHOT_LEVELS,
        "snapshot_compression_level",
        level,
        f"one of {list(SNAPSHOT_LEVELS)}",
    )


@dataclass(frozen=True)
class Pool:
    """A sandbox pool: a set of devices and the limits its workers run under."""

    name: str
    devices: tuple[str, ...] = ()
    thresholds: PoolThresholds = field(default_factory=PoolThresholds)
    memory_base_gb: float = 7.0
    memory_ceiling_gb: float = 12.0
    snapshot_interval_s: float = 90.0
    snapshot_compression_level: int = 2  # dsec.snapshot modes: 0 lossless .. 3 q4-lite
    gpu_quota: int | None = None  # devices the pool may use at most (None: all of them); policies shrink/grow it
    # The breaker's memory path for this pool's workers: their memory cap is the ceiling times this fraction (None:
    # the control plane's default, DSEC_MEMORY_PRESSURE, off as shipped). For training code that shrinks its
    # micro-batch when grad_accum_steps rises; zero-touch accumulation frees no memory (docs/health.md).
    memory_pressure: float | None = None
    # The gradient compression of this pool's workers while the breaker asks nothing of them (its level 0): 8 (8-bit
    # with error feedback), 16 or 32 (uncompressed); None: each probe's own default (DSEC_COMPRESSION_BITS,
    # uncompressed as shipped). The breaker's first rung is 4-bit whatever this is, so 4 is not a default.
    compression_bits: int | None = None

    def __post_init__(self) -> None:
        _check(bool(self.name), "name", self.name, "a non-empty pool name")
        _finite_nonneg("memory_base_gb", self.memory_base_gb, MAX_MEMORY_GB)
        _finite_nonneg("memory_ceiling_gb", self.memory_ceiling_gb, MAX_MEMORY_GB)
        _check(
            self.memory_ceiling_gb >= self.memory_base_gb,
            "memory_ceiling_gb",
            self.memory_ceiling_gb,
            f">= memory_base_gb ({self.memory_base_gb:g})",
        )
        _check(self.snapshot_interval_s > 0, "snapshot_interval_s", self.snapshot_interval_s, "> 0")
        _check_level(self.snapshot_compression_level)
        if self.memory_pressure is not None:
            _check(
                isinstance(self.memory_pressure, (int, float))
                and not isinstance(self.memory_pressure, bool)
                and 0 < self.memory_pressure <= 1,
                "memory_pressure",
                self.memory_pressure,
                "a fraction of the memory ceiling in (0, 1], or null for the control plane's default",
            )
        if self.compression_bits is not None:
            _check(
                type(self.compression_bits) is int and self.compression_bits in POOL_COMPRESSION_BITS,
                "compression_bits",
                self.compression_bits,
                f"one of {list(POOL_COMPRESSION_BITS)} (4 is the breaker's first rung), or null: the probe's default",
            )
        if self.gpu_quota is not None:
            _check(
                isinstance(self.gpu_quota, int)
                and not isinstance(self.gpu_quota, bool)
                and 0 <= self.gpu_quota <= 4096,
                "gpu_quota",
                self.gpu_quota,
                "0..4096 devices, or null for all",
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "devices": list(self.devices),
            "thresholds": {
                "bandwidth_cap_mbps": self.thresholds.bandwidth_cap_mbps,
                "latency_cap_ms": self.thresholds.latency_cap_ms,
            },
            "memory_base_gb": self.memory_base_gb,
            "memory_ceiling_gb": self.memory_ceiling_gb,
            "snapshot_interval_s": self.snapshot_interval_s,
            "snapshot_compression_level": self.snapshot_compression_level,
            "gpu_quota": self.gpu_quota,
            "memory_pressure": self.memory_pressure,
            "compression_bits": self.compression_bits,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Pool:
        thresholds = data.get("thresholds") or {}
        return cls(
            name=data["name"],
            devices=tuple(data.get("devices") or ()),
            thresholds=PoolThresholds(**thresholds),
            memory_base_gb=float(data.get("memory_base_gb", 7.0)),
            memory_ceiling_gb=float(data.get("memory_ceiling_gb", 12.0)),
            snapshot_interval_s=float(data.get("snapshot_interval_s", 90.0)),
            snapshot_compression_level=int(data.get("snapshot_compression_level", 2)),
            gpu_quota=None if data.get("gpu_quota") is None else int(data["gpu_quota"]),
            memory_pressure=None if data.get("memory_pressure") is None else float(data["memory_pressure"]),
            compression_bits=None if data.get("compression_bits") is None else int(data["compression_bits"]),
        )


@dataclass(frozen=True)
class Device:
    """One accelerator (or a simulated one) and where it sits in the machine."""

    id: str
    node: str
    model: str = "unknown"
    memory_gb: float = 0.0
    numa_node: int = -1  # -1: unknown, as /sys reports for single-node machines
    nvlink_peers: tuple[str, ...] = ()
    health: DeviceHealth = DeviceHealth.HEALTHY
    pool: str | None = None
    # The physical accelerator this device is a process slot of, where several processes share one GPU (RL actors):
    # the devices of one card share its memory, and elastic quotas are planned per card. None: a card of its own.
    card: str | None = None

    def __post_init__(self) -> None:
        _check(bool(self.id), "id", self.id, "a non-empty device id")
        _finite_nonneg("memory_gb", self.memory_gb, MAX_MEMORY_GB)
        _check(self.card is None or bool(self.card), "card", self.card, "a non-empty card id or null")

    @property
    def card_id(self) -> str:
        """The card whose memory this device's processes share: ``card``, or the device itself."""
        return self.card or self.id

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node": self.node,
            "model": self.model,
            "memory_gb": self.memory_gb,
            "numa_node": self.numa_node,
            "nvlink_peers": list(self.nvlink_peers),
            "health": self.health.value,
            "pool": self.pool,
            "card": self.card,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Device:
        return cls(
            id=data["id"],
            node=data["node"],
            model=data.get("model", "unknown"),
            memory_gb=float(data.get("memory_gb", 0.0)),
            numa_node=int(data.get("numa_node", -1)),
            nvlink_peers=tuple(data.get("nvlink_peers") or ()),
            health=DeviceHealth(data.get("health", "healthy")),
            pool=data.get("pool"),
            card=data.get("card"),
        )


@dataclass(frozen=True)
class DirectiveFields:
    """What the control plane wants a worker to do. Every field is applied by the probe at a safe point."""

    # Gradient compression: None is the probe's configured default (DSEC_COMPRESSION_BITS, 32 unless set);
    # 32 is uncompressed float32 whatever that default is; 16, 8, 4 are those levels.
    compression_bits: int | None = None
    grad_accum_steps: int = 1
    async_sampling: bool = True
    memory_quota_gb: float | None = None  # the grant: memory reserved for this worker (dsec.quota.elastic)
    memory_ceiling_gb: float | None = None
    # The allocator limit the probe enforces: the grant, or more where the card has memory nobody holds. The probe
    # caps at max(memory_quota_gb, memory_limit_gb) (a grant raised since the limit was issued still holds);
    # None: at memory_quota_gb (directives from before limits existed).
    memory_limit_gb: float | None = None
    precision: str = "fp32"
    snapshot_interval_s: float | None = None
    snapshot_now: str | None = None  # request id; a new id asks for one more snapshot
    snapshot_compression_level: int | None = None  # None: the pool's level
    sync_priority: int = 0
    target_device: str | None = None
    # Per-worker breaker caps; None: the pool's thresholds apply.
    bandwidth_cap_mbps: float | None = None
    latency_cap_ms: float | None = None

    def __post_init__(self) -> None:
        for name, kind in (
            ("grad_accum_steps", int),
            ("sync_priority", int),
            ("async_sampling", bool),
            ("precision", str),
        ):
            value = getattr(self, name)
            # bool is an int subclass: True is not a valid step count, nor 1 a valid switch.
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            _check(ok, name, value, f"a {kind.__name__}")
        _check(
            self.compression_bits is None
            or (type(self.compression_bits) is int and self.compression_bits in COMPRESSION_BITS),
            "compression_bits",
            self.compression_bits,
            f"one of {list(COMPRESSION_BITS)}, or null for the probe's default",
        )
        _check(1 <= self.grad_accum_steps <= 1024, "grad_accum_steps", self.grad_accum_steps, "1..1024")
        _check(self.precision in PRECISIONS, "precision", self.precision, f"one of {list(PRECISIONS)}")
        _check(-10 <= self.sync_priority <= 10, "sync_priority", self.sync_priority, "-10..10")
        for name in ("memory_quota_gb", "memory_ceiling_gb", "memory_limit_gb"):
            value = getattr(self, name)
            if value is not None:
                _finite_nonneg(name, value, MAX_MEMORY_GB)
        for name in ("bandwidth_cap_mbps", "latency_cap_ms"):
            value = getattr(self, name)
            if value is not None:
                _check(
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and math.isfinite(value)
                    and 0 < value <= 1e7,
                    name,
                    value,
                    "a finite number in (0, 1e7], or null for the pool's threshold",
                )
        if self.snapshot_interval_s is not None:
            _check(
                math.isfinite(self.snapshot_interval_s) and 1 <= self.snapshot_interval_s <= 86400,
                "snapshot_interval_s",
                self.snapshot_interval_s,
                "1..86400 seconds",
            )
        if self.snapshot_compression_level is not None:
            _check_level(self.snapshot_compression_level)
        if self.memory_quota_gb is not None and self.memory_ceiling_gb is not None:
            _check(
                self.memory_ceiling_gb >= self.memory_quota_gb,
                "memory_ceiling_gb",
                self.memory_ceiling_gb,
                f">= memory_quota_gb ({self.memory_quota_gb:g})",
            )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DirectiveFields:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelError(f"unknown directive field(s) {unknown}: expected some of {sorted(known)}")
        return cls(**dict(data))

    def merged(self, patch: Mapping[str, Any]) -> DirectiveFields:
        """A copy with ``patch`` applied, validated as a whole."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(patch) - known)
        if unknown:
            raise ModelError(f"unknown directive field(s) {unknown}: expected some of {sorted(known)}")
        return replace(self, **dict(patch))

    @classmethod
    def for_pool(cls, pool: Pool) -> DirectiveFields:
        """A new worker's directive. Its allocator limit starts at the pool's ceiling, where the quota plan puts a
        worker that is not bursting on a card with room (dsec.quota.elastic, "Grant and limit"): a process filling
        its working set before the first plan (up to one reconcile pass away, or longer while it has not reported
        its memory) would otherwise meet its base grant as a cap and fail there. The first plan sizes the limit to
        what its card has free."""
        return cls(
            memory_quota_gb=pool.memory_base_gb,
            memory_ceiling_gb=pool.memory_ceiling_gb,
            memory_limit_gb=pool.memory_ceiling_gb,
            snapshot_interval_s=pool.snapshot_interval_s,
            snapshot_compression_level=pool.snapshot_compression_level,
            compression_bits=pool.compression_bits,
        )


@dataclass(frozen=True)
class Directive:
    """A versioned directive. The worker acks the version it applied; until then it is only desired."""

    worker_id: str
    version: int
    fields: DirectiveFields
    updated_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "updated_at": self.updated_at, **self.fields.to_dict()}


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker says about itself when it registers."""

    pool: str
    role: Role = Role.OTHER
    group: str = "default"
    rank: int = 0
    host: str = ""
    pid: int = 0
    device: str | None = None
    heartbeat_interval_s: float = 5.0

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "rank", self.rank, ">= 0")
        _check(self.pid >= 0, "pid", self.pid, ">= 0")
        _check(
            0.05 <= self.heartbeat_interval_s <= 3600,
            "heartbeat_interval_s",
            self.heartbeat_interval_s,
            "0.05..3600 seconds",
        )


@dataclass(frozen=True)
class Event:
    """Something that happened, recorded durably. ``id`` is assigned by the store (monotonic)."""

    ts: float
    type: EventType
    worker_id: str | None = None
    pool: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)
    id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "ts": self.ts,
            "type": self.type.value,
            "worker_id": self.worker_id,
            "pool": self.pool,
            "data": dict(self.data),
        }
