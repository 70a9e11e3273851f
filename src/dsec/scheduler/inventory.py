"""Device inventory: what GPUs exist, where they sit (node, NUMA node, CPUs, NVLink peers) and their health signals.

Three sources behind one result (:class:`Inventory`):

- NVML (``nvidia-ml-py``'s ``pynvml`` module) when a GPU is present: :func:`discover_nvml` takes the module as a
  parameter, so tests pass :class:`dsec.scheduler.fake_nvml.FakeNvml`, a faithful stand-in with the same calls;
- an inventory/cluster YAML (the ``devices:`` list of ``dsec serve --cluster``, plus optional ``nodes:`` with CPUs
  and labels): :func:`from_cluster`;
- a synthetic cluster (:func:`synthesize`) for tests, the simulator and machines without GPUs.

CPU topology comes from ``/sys/devices/system/node`` (:func:`cpu_topology`); a device whose NUMA node is reported as
-1 (single-node machines, many VMs) is treated as "unknown", not as a node of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dsec.model import Device, DeviceHealth


@dataclass(frozen=True)
class NodeInfo:
    name: str
    numa_cpus: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # NUMA node -> CPU ids
    labels: Mapping[str, str] = field(default_factory=dict)

    def cpus_for(self, numa_node: int) -> tuple[int, ...]:
        """CPUs close to ``numa_node``; all CPUs when the NUMA node is unknown (-1)."""
        if numa_node in self.numa_cpus:
            return self.numa_cpus[numa_node]
        return tuple(sorted(c for cpus in self.numa_cpus.values() for c in cpus))


@dataclass(frozen=True)
class DeviceSignals:
    """What the hardware says about a device's health (NVML); zero when unknown."""

    throttle_reasons: int = 0  # bitmask, NVML clocks-event reasons other than idle / applications setting
    ecc_uncorrected: int = 0
    xid_errors: int = 0

    @property
    def alarming(self) -> bool:
        return bool(self.throttle_reasons or self.ecc_uncorrected or self.xid_errors)


@dataclass(frozen=True)
class Inventory:
    nodes: Mapping[str, NodeInfo]
    devices: Mapping[str, Device]
    signals: Mapping[str, DeviceSignals] = field(default_factory=dict)

    def on_node(self, node: str) -> list[Device]:
        return sorted((d for d in self.devices.values() if d.node == node), key=lambda d: d.id)

    def nvlinked(self, a: str, b: str) -> bool:
        da, db = self.devices.get(a), self.devices.get(b)
        return bool(da and db and (b in da.nvlink_peers or a in db.nvlink_peers))

    def with_health(self, health: Mapping[str, DeviceHealth]) -> Inventory:
        devices = {i: replace(d, health=health.get(i, d.health)) for i, d in self.devices.items()}
        return replace(self, devices=devices)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [
                {
                    "name": n.name,
                    "numa_cpus": {str(k): list(v) for k, v in n.numa_cpus.items()},
                    "labels": dict(n.labels),
                }
                for n in sorted(self.nodes.values(), key=lambda n: n.name)
            ],
            "devices": [d.to_dict() for d in sorted(self.devices.values(), key=lambda d: d.id)],
        }


# -- synthetic -----------------------------------------------------------------------------------------------
def synthesize(
    nodes: int = 2,
    gpus_per_node: int = 8,
    numa_per_node: int = 2,
    cpus_per_numa: int = 16,
    nvlink: str = "pairs",
    model: str = "A100-80GB",
    memory_gb: float = 80.0,
) -> Inventory:
    """``nodes`` x ``gpus_per_node`` GPUs spread evenly over NUMA nodes; NVLink ``pairs`` (0-1, 2-3, ...), ``all``
    (one island per node) or ``none``. Device ids ``n{node}-gpu{index}``."""
    if nvlink not in ("pairs", "all", "none"):
        raise ValueError(f"nvlink={nvlink!r} is invalid: expected pairs, all or none")
    out_nodes: dict[str, NodeInfo] = {}
    devices: dict[str, Device] = {}
    for n in range(nodes):
        name = f"node-{n}"
        numa = {k: tuple(range(k * cpus_per_numa, (k + 1) * cpus_per_numa)) for k in range(numa_per_node)}
        out_nodes[name] = NodeInfo(name, numa, {"dsec/node": name})
        ids = [f"n{n}-gpu{i}" for i in range(gpus_per_node)]
        for i, dev in enumerate(ids):
            if nvlink == "pairs":
                peers: tuple[str, ...] = (ids[i ^ 1],) if (i ^ 1) < len(ids) else ()
            elif nvlink == "all":
                peers = tuple(x for x in ids if x != dev)
            else:
                peers = ()
            per_numa = max(1, gpus_per_node // max(1, numa_per_node))
            devices[dev] = Device(dev, name, model, memory_gb, min(i // per_numa, numa_per_node - 1), peers)
    return Inventory(out_nodes, devices)


# -- cluster / inventory YAML -------------------------------------------------------------------------------------
def from_cluster(devices: Iterable[Device], nodes: Iterable[Mapping[str, Any]] = ()) -> Inventory:
    """An inventory from the cluster file's devices (and optional ``nodes:`` entries: name, numa_cpus, labels)."""
    devs = {d.id: d for d in devices}
    out: dict[str, NodeInfo] = {}
    for spec in nodes:
        numa = {int(k): tuple(int(c) for c in v) for k, v in (spec.get("numa_cpus") or {}).items()}
        out[spec["name"]] = NodeInfo(spec["name"], numa, dict(spec.get("labels") or {}))
    for d in devs.values():
        out.setdefault(d.node, NodeInfo(d.node, {}, {"dsec/node": d.node}))
    return Inventory(out, devs)


# -- /sys CPU topology --------------------------------------------------------------------------------------------
def parse_cpulist(text: str) -> tuple[int, ...]:
    """``0-3,8,10-11`` -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return tuple(cpus)


def cpu_topology(sys_root: str | os.PathLike[str] = "/sys") -> dict[int, tuple[int, ...]]:
    """NUMA node -> CPUs, from ``/sys/devices/system/node/node*/cpulist``; ``{-1: all CPUs}`` without NUMA info."""
    base = Path(sys_root) / "devices" / "system" / "node"
    out: dict[int, tuple[int, ...]] = {}
    if base.is_dir():
        for d in sorted(base.glob("node[0-9]*")):
            try:
                cpus = parse_cpulist((d / "cpulist").read_text())
            except OSError:
                continue
            if cpus:
                out[int(d.name[4:])] = cpus
    if not out:
        out[-1] = tuple(range(os.cpu_count() or 1))
    return out


# -- NVML -----------------------------------------------------------------------------------------------------------
# Throttle ("clocks event") reasons that mean trouble: not GPU idle (0x1) nor an applications-clocks setting (0x2).
TROUBLE_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80  # SW power cap, HW slowdown, SW/HW thermal, power brake


def discover_nvml(nvml: Any, node: str | None = None, sys_root: str | os.PathLike[str] = "/sys") -> Inventory:
    """The local GPUs through an NVML module (``pynvml`` or a stand-in with the same calls)."""
    import socket

    node = node or socket.gethostname()
    nvml.nvmlInit()
    try:
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        ids = [f"{node}-gpu{i}" for i in range(count)]
        bus = {_bus_id(nvml.nvmlDeviceGetPciInfo(h)): ids[i] for i, h in enumerate(handles)}
        devices: dict[str, Device] = {}
        signals: dict[str, DeviceSignals] = {}
        for i, h in enumerate(handles):
            name = nvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = nvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
            numa = _optional(lambda h=h: int(nvml.nvmlDeviceGetNumaNodeId(h)), -1)
            peers: list[str] = []
            for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
                if _optional(lambda h=h, link=link: nvml.nvmlDeviceGetNvLinkState(h, link), 0) != 1:
                    continue  # NVML_FEATURE_ENABLED
                remote = _optional(lambda h=h, link=link: _bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link)), "")
                if remote in bus and bus[remote] != ids[i] and bus[remote] not in peers:
                    peers.append(bus[remote])
            get_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
                nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
            )
            reasons = _optional(lambda h=h, fn=get_reasons: int(fn(h)), 0) if get_reasons else 0
            ecc = _optional(
                lambda h=h: int(
                    nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
                ),
                0,
            )
            devices[ids[i]] = Device(ids[i], node, name, round(mem, 2), numa, tuple(sorted(peers)))
            signals[ids[i]] = DeviceSignals(reasons & TROUBLE_REASONS, ecc, 0)
    finally:
        nvml.nvmlShutdown()
    return Inventory({node: NodeInfo(node, cpu_topology(sys_root), {"dsec/node": node})}, devices, signals)


def _bus_id(pci: Any) -> str:
    raw = getattr(pci, "busId", b"")
    return (raw.decode() if isinstance(raw, bytes) else str(raw)).lower()


def _optional(fn: Any, default: Any) -> Any:
    """An NVML query that a device or driver may not support (NVMLError_NotSupported and friends)."""
    try:
        return fn()
    except Exception:
        return default
