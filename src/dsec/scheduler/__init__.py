"""Scheduling: device inventory (NVML / file / synthetic), affinity- and history-aware placement with
explanations, device personality profiles learned from history, and degraded-device detection."""

from dsec.scheduler.device_health import DeviceHealthConfig, DeviceHealthTracker, HealthChange, Occupancy
from dsec.scheduler.inventory import (
    DeviceSignals,
    Inventory,
    NodeInfo,
    cpu_topology,
    discover_nvml,
    from_cluster,
    synthesize,
)
from dsec.scheduler.placement import Assignment, GroupSpec, JobSpec, Placement, Weights, WorkerSpec, place
from dsec.scheduler.profiles import LOAD_CLASSES, Profiles, RunRecord, classify_load

__all__ = [
    "LOAD_CLASSES",
    "Assignment",
    "DeviceHealthConfig",
    "DeviceHealthTracker",
    "DeviceSignals",
    "GroupSpec",
    "HealthChange",
    "Inventory",
    "JobSpec",
    "NodeInfo",
    "Occupancy",
    "Placement",
    "Profiles",
    "RunRecord",
    "Weights",
    "WorkerSpec",
    "classify_load",
    "cpu_topology",
    "discover_nvml",
    "from_cluster",
    "place",
    "synthesize",
]
