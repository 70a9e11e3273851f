"""The inventory as the API and the cluster file give it (``PoolUpdate``, ``DeviceSpec``, ``ClusterSpec``), turned
into the core's ``Pool`` and ``Device``."""

from __future__ import annotations

from typing import Any

from dsec.control.schemas import ClusterSpec, DeviceSpec
from dsec.model import Device, DeviceHealth, Pool, PoolThresholds
from dsec.yamlconf import load_file


def pool_from_spec(name: str, spec: Any) -> Pool:
    return Pool(
        name=name,
        devices=tuple(spec.devices),
        thresholds=PoolThresholds(spec.thresholds.bandwidth_cap_mbps, spec.thresholds.latency_cap_ms),
        memory_base_gb=spec.memory_base_gb,
        memory_ceiling_gb=spec.memory_ceiling_gb,
        snapshot_interval_s=spec.snapshot_interval_s,
        snapshot_compression_level=spec.snapshot_compression_level,
        gpu_quota=spec.gpu_quota,
        memory_pressure=spec.memory_pressure,
        compression_bits=spec.compression_bits,
    )


def device_from_spec(spec: DeviceSpec) -> Device:
    return Device(
        id=spec.id,
        node=spec.node,
        model=spec.model,
        memory_gb=spec.memory_gb,
        numa_node=spec.numa_node,
        nvlink_peers=tuple(spec.nvlink_peers),
        health=DeviceHealth(spec.health),
        pool=spec.pool,
        card=spec.card,
    )


def load_cluster(path: Any) -> tuple[list[Pool], list[Device]]:
    spec = load_file(ClusterSpec, path)
    return [pool_from_spec(p.name, p) for p in spec.pools], [device_from_spec(d) for d in spec.devices]
