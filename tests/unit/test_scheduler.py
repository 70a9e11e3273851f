"""Scheduler: inventory (synthetic, cluster file, /sys, NVML through FakeNvml), placement (hard constraints, scored
preferences, explanations), device profiles learned from history, and the job file's placement request."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dsec.control.app import load_cluster
from dsec.launch.jobfile import JobFile, load_job
from dsec.model import Device, DeviceHealth
from dsec.scheduler import (
    LOAD_CLASSES,
    DeviceSignals,
    GroupSpec,
    Inventory,
    JobSpec,
    NodeInfo,
    Placement,
    Profiles,
    RunRecord,
    Weights,
    WorkerSpec,
    classify_load,
    cpu_topology,
    discover_nvml,
    from_cluster,
    place,
    synthesize,
)
from dsec.scheduler.fake_nvml import FakeGpu, FakeNvml, NVMLError, NVMLError_Uninitialized
from dsec.scheduler.inventory import TROUBLE_REASONS, parse_cpulist
from dsec.scheduler.profiles import PRIOR_RISK, ProfileStats

ROOT = Path(__file__).resolve().parents[2]
TERMS = {"state", "numa", "nvlink", "node", "probation"}


# -- helpers -----------------------------------------------------------------------------------------------------
def group(
    name: str,
    learners: int = 0,
    actors: int = 0,
    others: int = 0,
    memory_gb: float = 8.0,
    load_class: str = "short-episode",
    replay_share: bool = False,
) -> GroupSpec:
    workers = [WorkerSpec(f"{name}-l{i}", "learner", memory_gb) for i in range(learners)]
    workers += [WorkerSpec(f"{name}-a{i}", "actor", memory_gb) for i in range(actors)]
    workers += [WorkerSpec(f"{name}-o{i}", "other", memory_gb) for i in range(others)]
    return GroupSpec(name, tuple(workers), load_class, replay_share)


def job(*groups: GroupSpec) -> JobSpec:
    return JobSpec("job", tuple(groups))


def one(p: Placement, worker: str) -> Any:
    return next(a for a in p.assignments if a.worker == worker)


def make_sys(tmp_path: Path, nodes: dict[str, str | None]) -> Path:
    """A fake /sys with devices/system/node/<name>/cpulist (None: the directory without a cpulist)."""
    base = tmp_path / "sys" / "devices" / "system" / "node"
    base.mkdir(parents=True)
    (base / "possible").write_text("0-1\n")  # not a node directory: must be ignored
    for name, cpulist in nodes.items():
        (base / name).mkdir()
        if cpulist is not None:
            (base / name / "cpulist").write_text(cpulist)
    return tmp_path / "sys"


# -- inventory: synthetic ----------------------------------------------------------------------------------------
def test_synthesize_64_gpus_ids_numa_and_nvlink_pairs() -> None:
    inv = synthesize(nodes=8, gpus_per_node=8, numa_per_node=2, nvlink="pairs")
    assert len(inv.devices) == 64
    assert sorted(inv.nodes) == [f"node-{n}" for n in range(8)]
    assert set(inv.devices) == {f"n{n}-gpu{i}" for n in range(8) for i in range(8)}
    for n in range(8):
        devs = inv.on_node(f"node-{n}")
        assert [d.id for d in devs] == [f"n{n}-gpu{i}" for i in range(8)]
        for i in range(8):
            d = inv.devices[f"n{n}-gpu{i}"]
            assert d.node == f"node-{n}"
            assert d.numa_node == (0 if i < 4 else 1)
            assert d.model == "A100-80GB"
            assert d.memory_gb == 80.0
            assert d.health is DeviceHealth.HEALTHY
            assert d.nvlink_peers == (f"n{n}-gpu{i ^ 1}",)
        node = inv.nodes[f"node-{n}"]
        assert node.numa_cpus == {0: tuple(range(16)), 1: tuple(range(16, 32))}
        assert node.labels == {"dsec/node": f"node-{n}"}
    # symmetric pairs, nothing across pairs or nodes
    for a in inv.devices.values():
        for p in a.nvlink_peers:
            assert a.id in inv.devices[p].nvlink_peers
    assert inv.nvlinked("n3-gpu2", "n3-gpu3") and inv.nvlinked("n3-gpu3", "n3-gpu2")
    assert not inv.nvlinked("n3-gpu1", "n3-gpu2")
    assert not inv.nvlinked("n0-gpu0", "n1-gpu1")
    assert inv.signals == {}


def test_synthesize_nvlink_all_and_none() -> None:
    inv_all = synthesize(nodes=2, gpus_per_node=4, nvlink="all")
    for d in inv_all.devices.values():
        same_node = {x.id for x in inv_all.on_node(d.node)} - {d.id}
        assert set(d.nvlink_peers) == same_node
        assert len(d.nvlink_peers) == 3
    assert inv_all.nvlinked("n0-gpu0", "n0-gpu3")
    assert not inv_all.nvlinked("n0-gpu0", "n1-gpu0")

    inv_none = synthesize(nodes=2, gpus_per_node=4, nvlink="none")
    assert all(d.nvlink_peers == () for d in inv_none.devices.values())
    assert not inv_none.nvlinked("n0-gpu0", "n0-gpu1")


def test_synthesize_odd_gpu_count_leaves_last_gpu_unpaired_and_options_apply() -> None:
    inv = synthesize(nodes=1, gpus_per_node=3, numa_per_node=1, cpus_per_numa=4, model="H100", memory_gb=94.0)
    assert inv.devices["n0-gpu0"].nvlink_peers == ("n0-gpu1",)
    assert inv.devices["n0-gpu2"].nvlink_peers == ()
    assert {d.numa_node for d in inv.devices.values()} == {0}
    assert {(d.model, d.memory_gb) for d in inv.devices.values()} == {("H100", 94.0)}
    assert inv.nodes["node-0"].numa_cpus == {0: (0, 1, 2, 3)}


@pytest.mark.parametrize("bad", ["pair", "ALL", "", "ring"])
def test_synthesize_rejects_unknown_nvlink_mode(bad: str) -> None:
    with pytest.raises(ValueError, match=r"nvlink=.*invalid: expected pairs, all or none"):
        synthesize(nvlink=bad)


def test_node_info_cpus_for_known_and_unknown_numa() -> None:
    node = NodeInfo("n", {1: (8, 9, 10), 0: (3, 1, 2)})
    assert node.cpus_for(0) == (3, 1, 2)
    assert node.cpus_for(1) == (8, 9, 10)
    assert node.cpus_for(-1) == (1, 2, 3, 8, 9, 10)  # unknown NUMA node: every CPU, sorted
    assert node.cpus_for(7) == (1, 2, 3, 8, 9, 10)
    assert NodeInfo("empty").cpus_for(-1) == ()


def test_inventory_nvlinked_one_sided_and_unknown_devices() -> None:
    a = Device("a", "n", nvlink_peers=("b",))
    b = Device("b", "n")  # does not list a: a link reported by one side still counts
    c = Device("c", "n")
    inv = from_cluster([a, b, c])
    assert inv.nvlinked("a", "b") and inv.nvlinked("b", "a")
    assert not inv.nvlinked("a", "c")
    assert not inv.nvlinked("a", "missing") and not inv.nvlinked("missing", "a")


def test_inventory_with_health_is_a_copy() -> None:
    inv = synthesize(nodes=1, gpus_per_node=4)
    sick = inv.with_health(
        {"n0-gpu1": DeviceHealth.DEGRADED, "n0-gpu2": DeviceHealth.PROBATION, "not-a-device": DeviceHealth.DRAINED}
    )
    assert sick.devices["n0-gpu1"].health is DeviceHealth.DEGRADED
    assert sick.devices["n0-gpu2"].health is DeviceHealth.PROBATION
    assert sick.devices["n0-gpu0"].health is DeviceHealth.HEALTHY
    assert "not-a-device" not in sick.devices
    assert set(sick.devices) == set(inv.devices)
    assert sick.nodes == inv.nodes
    # the original is untouched
    assert all(d.health is DeviceHealth.HEALTHY for d in inv.devices.values())


def test_inventory_to_dict_sorted_and_serialisable() -> None:
    inv = synthesize(nodes=2, gpus_per_node=2, numa_per_node=1, cpus_per_numa=2).with_health(
        {"n1-gpu0": DeviceHealth.DRAINED}
    )
    d = inv.to_dict()
    assert [n["name"] for n in d["nodes"]] == ["node-0", "node-1"]
    assert d["nodes"][0] == {"name": "node-0", "numa_cpus": {"0": [0, 1]}, "labels": {"dsec/node": "node-0"}}
    assert [x["id"] for x in d["devices"]] == ["n0-gpu0", "n0-gpu1", "n1-gpu0", "n1-gpu1"]
    dev = d["devices"][2]
    assert dev == {
        "id": "n1-gpu0",
        "node": "node-1",
        "model": "A100-80GB",
        "memory_gb": 80.0,
        "numa_node": 0,
        "nvlink_peers": ["n1-gpu1"],
        "health": "drained",
        "pool": None,
        "card": None,
    }
    assert Device.from_dict(dev) == inv.devices["n1-gpu0"]


# -- inventory: cluster file -------------------------------------------------------------------------------------
def test_from_cluster_example_file_devices() -> None:
    _, devices = load_cluster(ROOT / "examples" / "cluster.yaml")
    inv = from_cluster(devices)
    assert len(inv.devices) == 16
    assert sorted(inv.nodes) == ["node-0", "node-1"]
    for name, node in inv.nodes.items():
        assert node == NodeInfo(name, {}, {"dsec/node": name})
    assert [d.id for d in inv.on_node("node-0")] == [f"gpu-{i:02d}" for i in range(8)]
    assert inv.devices["gpu-04"].numa_node == 1 and inv.devices["gpu-03"].numa_node == 0
    assert inv.devices["gpu-00"].pool == "pool-0"
    assert inv.nvlinked("gpu-00", "gpu-01") and not inv.nvlinked("gpu-01", "gpu-02")
    assert inv.signals == {}


def test_from_cluster_with_nodes_entries() -> None:
    _, devices = load_cluster(ROOT / "examples" / "cluster.yaml")
    nodes: list[dict[str, Any]] = [
        {"name": "node-0", "numa_cpus": {"0": [0, 1, "2"], 1: [3]}, "labels": {"rack": "a"}},
        {"name": "spare"},  # a node with no devices is kept
    ]
    inv = from_cluster(devices, nodes)
    assert sorted(inv.nodes) == ["node-0", "node-1", "spare"]
    assert inv.nodes["node-0"] == NodeInfo("node-0", {0: (0, 1, 2), 1: (3,)}, {"rack": "a"})
    assert inv.nodes["node-1"] == NodeInfo("node-1", {}, {"dsec/node": "node-1"})
    assert inv.nodes["spare"] == NodeInfo("spare", {}, {})
    assert inv.on_node("spare") == []
    assert inv.nodes["node-0"].cpus_for(inv.devices["gpu-05"].numa_node) == (3,)


# -- /sys CPU topology -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
        ("", ()),
        ("\n", ()),
        ("5", (5,)),
        ("0-3\n", (0, 1, 2, 3)),
        ("4-4", (4,)),
    ],
)
def test_parse_cpulist(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpulist(text) == cpus


def test_cpu_topology_reads_node_cpulists(tmp_path: Path) -> None:
    root = make_sys(
        tmp_path,
        {
            "node0": "0-3,8-11\n",
            "node1": "4-7,12-15\n",
            "node2": None,  # no cpulist: skipped
            "node3": "\n",  # memory-only node (no CPUs): skipped
            "node10": "16\n",
        },
    )
    topo = cpu_topology(root)
    assert topo == {0: (0, 1, 2, 3, 8, 9, 10, 11), 1: (4, 5, 6, 7, 12, 13, 14, 15), 10: (16,)}


def test_cpu_topology_without_numa_info_is_all_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_topology(tmp_path) == {-1: tuple(range(os.cpu_count() or 1))}
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert cpu_topology(tmp_path / "nowhere") == {-1: (0, 1, 2, 3)}
    # a node directory whose nodes all lack cpulists: also no NUMA info
    assert cpu_topology(make_sys(tmp_path, {"node0": None})) == {-1: (0, 1, 2, 3)}
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert cpu_topology(tmp_path / "nowhere") == {-1: (0,)}


# -- NVML through FakeNvml ---------------------------------------------------------------------------------------
def four_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(numa_node=0, nvlink_to=[1]),
        FakeGpu(numa_node=0, nvlink_to=[0]),
        FakeGpu(numa_node=1, nvlink_to=[3]),
        FakeGpu(numa_node=1, nvlink_to=[2]),
    ]


def test_discover_nvml_four_gpus_nvlink_pairs(tmp_path: Path) -> None:
    nvml = FakeNvml(four_gpus())
    root = make_sys(tmp_path, {"node0": "0-7", "node1": "8-15"})
    inv = discover_nvml(nvml, node="box", sys_root=root)
    assert sorted(inv.devices) == ["box-gpu0", "box-gpu1", "box-gpu2", "box-gpu3"]
    assert inv.devices["box-gpu0"].nvlink_peers == ("box-gpu1",)
    assert inv.devices["box-gpu1"].nvlink_peers == ("box-gpu0",)
    assert inv.devices["box-gpu2"].nvlink_peers == ("box-gpu3",)
    assert inv.devices["box-gpu3"].nvlink_peers == ("box-gpu2",)
    for d in inv.devices.values():
        for p in d.nvlink_peers:
            assert d.id in inv.devices[p].nvlink_peers
    assert not inv.nvlinked("box-gpu1", "box-gpu2")
    assert [inv.devices[f"box-gpu{i}"].numa_node for i in range(4)] == [0, 0, 1, 1]
    for d in inv.devices.values():
        assert d.node == "box"
        assert isinstance(d.model, str) and d.model == "NVIDIA A100-SXM4-80GB"
        assert d.memory_gb == 80.0
        assert d.health is DeviceHealth.HEALTHY
    assert inv.nodes == {"box": NodeInfo("box", {0: tuple(range(8)), 1: tuple(range(8, 16))}, {"dsec/node": "box"})}
    assert all(s == DeviceSignals() and not s.alarming for s in inv.signals.values())
    assert set(inv.signals) == set(inv.devices)
    assert nvml._init == 0  # nvmlShutdown was called


def test_discover_nvml_multiple_links_to_one_peer_and_self_links_are_deduplicated(tmp_path: Path) -> None:
    nvml = FakeNvml([FakeGpu(nvlink_to=[1, 1, 1, 0]), FakeGpu(nvlink_to=[0, 0])])
    inv = discover_nvml(nvml, node="h", sys_root=tmp_path)
    assert inv.devices["h-gpu0"].nvlink_peers == ("h-gpu1",)
    assert inv.devices["h-gpu1"].nvlink_peers == ("h-gpu0",)


def test_discover_nvml_unsupported_numa_memory_and_names(tmp_path: Path) -> None:
    nvml = FakeNvml(
        [
            FakeGpu(name="NVIDIA A100-SXM4-40GB", memory_gb=40.0, numa_node=None),
            FakeGpu(name="NVIDIA H100 80GB HBM3", memory_gb=79.6468, numa_node=1),
        ]
    )
    inv = discover_nvml(nvml, node="h", sys_root=tmp_path)
    a, b = inv.devices["h-gpu0"], inv.devices["h-gpu1"]
    assert a.numa_node == -1  # NotSupported -> unknown
    assert b.numa_node == 1
    assert (a.model, a.memory_gb) == ("NVIDIA A100-SXM4-40GB", 40.0)
    assert (b.model, b.memory_gb) == ("NVIDIA H100 80GB HBM3", 79.65)  # bytes -> GiB, two decimals
    assert type(a.model) is str and type(b.model) is str
    # no NUMA info in this /sys: the node's CPUs are all of them, and a NUMA -1 device gets all of them
    assert list(inv.nodes["h"].numa_cpus) == [-1]
    assert inv.nodes["h"].cpus_for(a.numa_node) == tuple(range(os.cpu_count() or 1))


def test_discover_nvml_accepts_str_names_and_defaults_node_to_hostname(tmp_path: Path) -> None:
    class StrNames(FakeNvml):
        def nvmlDeviceGetName(self, handle: Any) -> str:  # type: ignore[override]
            return self._gpu(handle).name  # newer pynvml returns str

    import socket

    inv = discover_nvml(StrNames([FakeGpu(name="Tesla T4", memory_gb=15.0)]), sys_root=tmp_path)
    host = socket.gethostname()
    assert list(inv.devices) == [f"{host}-gpu0"]
    assert inv.devices[f"{host}-gpu0"].model == "Tesla T4"
    assert inv.devices[f"{host}-gpu0"].memory_gb == 15.0


@pytest.mark.parametrize(
    ("reasons", "masked", "alarming"),
    [
        (0x0, 0x0, False),
        (0x1, 0x0, False),  # GPU idle only
        (0x2, 0x0, False),  # applications clocks setting only
        (0x1 | 0x2, 0x0, False),
        (0x40, 0x40, True),  # HW thermal slowdown
        (0x4, 0x4, True),  # SW power cap
        (0x8, 0x8, True),  # HW slowdown
        (0x20, 0x20, True),  # SW thermal
        (0x80, 0x80, True),  # power brake
        (0x1 | 0x40, 0x40, True),
        (0x100 | 0x1, 0x0, False),  # display clocks setting etc.: not trouble
    ],
)
def test_discover_nvml_throttle_reasons_masked(tmp_path: Path, reasons: int, masked: int, alarming: bool) -> None:
    nvml = FakeNvml([FakeGpu(throttle_reasons=reasons)])
    sig = discover_nvml(nvml, node="h", sys_root=tmp_path).signals["h-gpu0"]
    assert sig.throttle_reasons == masked == reasons & TROUBLE_REASONS
    assert sig.alarming is alarming


def test_discover_nvml_ecc(tmp_path: Path) -> None:
    nvml = FakeNvml([FakeGpu(ecc_uncorrected=None), FakeGpu(ecc_uncorrected=3), FakeGpu(ecc_uncorrected=0)])
    sig = discover_nvml(nvml, node="h", sys_root=tmp_path).signals
    assert sig["h-gpu0"] == DeviceSignals(0, 0, 0) and not sig["h-gpu0"].alarming  # unsupported -> 0
    assert sig["h-gpu1"].ecc_uncorrected == 3 and sig["h-gpu1"].alarming
    assert not sig["h-gpu2"].alarming


def test_device_signals_alarming() -> None:
    assert not DeviceSignals().alarming
    assert DeviceSignals(throttle_reasons=0x40).alarming
    assert DeviceSignals(ecc_uncorrected=1).alarming
    assert DeviceSignals(xid_errors=79).alarming


def test_discover_nvml_shuts_down_even_when_a_query_fails(tmp_path: Path) -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise NVMLError("driver/library version mismatch")

    nvml = Broken(four_gpus())
    with pytest.raises(NVMLError, match="mismatch"):
        discover_nvml(nvml, node="h", sys_root=tmp_path)
    assert nvml._init == 0


def test_fake_nvml_calls_before_init_raise() -> None:
    nvml = FakeNvml(four_gpus())
    with pytest.raises(NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    with pytest.raises(NVMLError_Uninitialized):
        nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(NVMLError_Uninitialized):
        nvml.nvmlShutdown()
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml.nvmlDeviceGetCount() == 4
    assert nvml.nvmlDeviceGetName(h) == b"NVIDIA A100-SXM4-80GB"
    assert nvml.nvmlDeviceGetMemoryInfo(h).total == 80 * 2**30
    assert nvml.nvmlDeviceGetPciInfo(h).busId == b"00000000:12:00.0"
    with pytest.raises(NVMLError, match="invalid device index"):
        nvml.nvmlDeviceGetHandleByIndex(4)
    nvml.nvmlShutdown()
    with pytest.raises(NVMLError_Uninitialized):
        nvml.nvmlDeviceGetName(h)  # a handle outliving nvmlShutdown is not usable either


# -- placement: hard constraints ---------------------------------------------------------------------------------
def test_degraded_and_drained_devices_are_excluded_with_a_reason() -> None:
    inv = synthesize(nodes=1, gpus_per_node=4, numa_per_node=1).with_health(
        {"n0-gpu0": DeviceHealth.DEGRADED, "n0-gpu1": DeviceHealth.DRAINED}
    )
    p = place(job(group("g", learners=2)), inv)
    assert p.complete
    assert {a.device for a in p.assignments} == {"n0-gpu2", "n0-gpu3"}
    assert p.excluded == {"n0-gpu0": "device is degraded", "n0-gpu1": "device is drained"}
    # with only the sick ones left, nothing can be placed
    p = place(job(group("g", learners=3)), inv)
    assert not p.complete and set(p.unplaced) == {"g-l0", "g-l1", "g-l2"}


def test_probation_is_placeable_but_last_in_line() -> None:
    inv = synthesize(nodes=1, gpus_per_node=2, numa_per_node=1).with_health({"n0-gpu0": DeviceHealth.PROBATION})
    p = place(job(group("g", learners=1)), inv)
    assert "n0-gpu0" not in p.excluded
    a = one(p, "g-l0")
    assert a.device == "n0-gpu1"
    assert a.terms["probation"] == 0.0
    # nothing better left: the probation device takes the worker, with the penalty in the explanation
    p = place(job(group("g", learners=1)), inv, busy={"n0-gpu1"})
    a = one(p, "g-l0")
    assert p.complete and a.device == "n0-gpu0"
    assert a.terms["probation"] == -2.0 == -Weights().state
    assert p.excluded == {"n0-gpu1": "already runs a worker"}


def test_allowed_restricts_to_the_pool() -> None:
    inv = synthesize(nodes=1, gpus_per_node=8)
    p = place(job(group("g", learners=2)), inv, allowed={"n0-gpu5", "n0-gpu6"})
    assert p.complete
    assert {a.device for a in p.assignments} == {"n0-gpu5", "n0-gpu6"}
    assert p.excluded == {d: "not in the pool" for d in inv.devices if d not in {"n0-gpu5", "n0-gpu6"}}
    p = place(job(group("g", learners=3)), inv, allowed={"n0-gpu5", "n0-gpu6"})
    assert not p.complete


def test_busy_devices_are_excluded() -> None:
    inv = synthesize(nodes=1, gpus_per_node=4, numa_per_node=1)
    p = place(job(group("g", learners=2)), inv, busy={"n0-gpu0", "n0-gpu2"})
    assert {a.device for a in p.assignments} == {"n0-gpu1", "n0-gpu3"}
    assert p.excluded == {"n0-gpu0": "already runs a worker", "n0-gpu2": "already runs a worker"}


def test_nvml_alarming_devices_are_excluded() -> None:
    base = synthesize(nodes=1, gpus_per_node=4, numa_per_node=1)
    signals = {
        "n0-gpu0": DeviceSignals(throttle_reasons=0x40),
        "n0-gpu1": DeviceSignals(ecc_uncorrected=2),
        "n0-gpu2": DeviceSignals(),  # quiet: stays eligible
    }
    inv = Inventory(base.nodes, base.devices, signals)
    p = place(job(group("g", learners=2)), inv)
    assert p.complete
    assert {a.device for a in p.assignments} == {"n0-gpu2", "n0-gpu3"}
    assert set(p.excluded) == {"n0-gpu0", "n0-gpu1"}
    assert all("NVML reports" in why for why in p.excluded.values())


def test_gpu_quota_limits_devices_used() -> None:
    inv = synthesize(nodes=1, gpus_per_node=8)
    p = place(job(group("g", learners=2)), inv, gpu_quota=2)
    assert p.complete
    assert {a.device for a in p.assignments} == {"n0-gpu0", "n0-gpu1"}
    assert p.excluded == {f"n0-gpu{i}": "over the pool's gpu_quota (2)" for i in range(2, 8)}

    p = place(job(group("g", learners=3)), inv, gpu_quota=2)
    assert not p.complete and len(p.unplaced) == 3 and p.assignments == ()

    # busy devices of the pool count against the quota
    p = place(job(group("g", learners=2)), inv, gpu_quota=3, busy={"n0-gpu0"})
    assert p.complete and {a.device for a in p.assignments} == {"n0-gpu1", "n0-gpu2"}
    p = place(job(group("g", learners=3)), inv, gpu_quota=3, busy={"n0-gpu0"})
    assert not p.complete

    # busy devices outside the pool do not
    p = place(job(group("g", learners=2)), inv, gpu_quota=2, busy={"n0-gpu7"}, allowed={f"n0-gpu{i}" for i in range(4)})
    assert p.complete and {a.device for a in p.assignments} == {"n0-gpu0", "n0-gpu1"}

    p = place(job(group("g", learners=1)), inv, gpu_quota=0)
    assert not p.complete and len(p.excluded) == 8


def test_memory_need_above_a_device_is_a_hard_constraint() -> None:
    base = synthesize(nodes=1, gpus_per_node=4, numa_per_node=1)
    small = {i: replace(d, model="A100-40GB", memory_gb=40.0) for i, d in base.devices.items() if i < "n0-gpu2"}
    inv = Inventory(base.nodes, {**base.devices, **small})
    p = place(job(group("g", learners=2, memory_gb=60.0)), inv)
    assert p.complete
    assert {a.device for a in p.assignments} == {"n0-gpu2", "n0-gpu3"}

    p = place(job(group("g", learners=1, memory_gb=100.0)), inv)
    assert not p.complete
    assert "100 GB" in p.unplaced["g-l0"]
    assert p.excluded == {}  # memory is per worker: the devices are not excluded, just too small

    # memory already used on a device counts
    p = place(job(group("g", learners=1, memory_gb=30.0)), inv, used_memory_gb={"n0-gpu0": 20.0})
    assert one(p, "g-l0").device == "n0-gpu1"
    p = place(job(group("g", learners=1, memory_gb=20.0)), inv, used_memory_gb={"n0-gpu0": 20.0})
    assert one(p, "g-l0").device == "n0-gpu0"  # exactly fills it


def test_unknown_device_memory_does_not_block() -> None:
    inv = from_cluster([Device("x", "n")])  # memory_gb 0: unknown
    p = place(job(group("g", learners=1, memory_gb=500.0)), inv)
    assert p.complete and p.device_of("g-l0") == "x"


def test_job_bigger_than_free_devices_is_unplaced() -> None:
    inv = synthesize(nodes=1, gpus_per_node=8)
    p = place(job(group("big", learners=10)), inv)
    assert not p.complete
    assert p.assignments == ()
    assert set(p.unplaced) == {f"big-l{i}" for i in range(10)}
    assert all("group big needs 10" in why and "among 8 eligible" in why for why in p.unplaced.values())
    assert p.to_dict()["complete"] is False

    # largest group first; the one that no longer fits is unplaced, the rest stays placed
    p = place(job(group("a", learners=3), group("b", learners=6)), inv)
    assert not p.complete
    assert {a.group for a in p.assignments} == {"b"}
    assert set(p.unplaced) == {"a-l0", "a-l1", "a-l2"}
    assert all("among 2 eligible" in why for why in p.unplaced.values())


def test_one_worker_per_device_across_groups() -> None:
    inv = synthesize(nodes=2, gpus_per_node=4)
    p = place(job(group("a", learners=1, actors=3), group("b", learners=2), group("c", others=2)), inv)
    assert p.complete
    devices = [a.device for a in p.assignments]
    assert len(devices) == len(set(devices)) == 8


# -- placement: scored preferences -------------------------------------------------------------------------------
def test_numa_affinity_puts_actors_on_the_learners_numa_node() -> None:
    inv = synthesize(nodes=1, gpus_per_node=8, numa_per_node=2)
    p = place(job(group("g", learners=1, actors=3)), inv)
    learner = one(p, "g-l0")
    actors = [one(p, f"g-a{i}") for i in range(3)]
    assert all(a.numa_node == learner.numa_node for a in actors)
    assert all(a.terms["numa"] == 1.0 for a in actors)
    assert learner.terms["numa"] == 0.0
    assert learner.cpus == tuple(range(16)) == actors[0].cpus


def test_numa_affinity_beats_device_order() -> None:
    """The learner can only go to NUMA 1 (NUMA 0's devices are partly used); the actors follow it there rather
    than taking the first free devices in id order."""
    inv = synthesize(nodes=1, gpus_per_node=8, numa_per_node=2)
    used = {f"n0-gpu{i}": 30.0 for i in range(4)}
    g = GroupSpec(
        "g",
        (WorkerSpec("learner", "learner", 60.0), *(WorkerSpec(f"actor{i}", "actor", 8.0) for i in range(3))),
    )
    p = place(job(g), inv, used_memory_gb=used)
    assert p.device_of("learner") == "n0-gpu4"
    assert {p.device_of(f"actor{i}") for i in range(3)} == {"n0-gpu5", "n0-gpu6", "n0-gpu7"}
    assert all(one(p, f"actor{i}").numa_node == 1 and one(p, f"actor{i}").terms["numa"] == 1.0 for i in range(3))
    assert one(p, "actor0").cpus == tuple(range(16, 32))
    # without the NUMA weight the actors take the first devices that fit
    p = place(job(g), inv, used_memory_gb=used, weights=Weights(numa=0.0))
    assert {p.device_of(f"actor{i}") for i in range(3)} == {"n0-gpu0", "n0-gpu1", "n0-gpu2"}


def test_numa_term_needs_a_known_numa_node() -> None:
    inv = from_cluster([Device(f"d{i}", "n", memory_gb=80.0) for i in range(2)])  # numa_node -1
    p = place(job(group("g", learners=1, actors=1)), inv)
    assert p.complete
    assert all(a.terms["numa"] == 0.0 for a in p.assignments)


def test_nvlink_affinity_with_replay_share() -> None:
    """The first worker is forced onto gpu3 (memory); its partner then lands on gpu3's NVLink peer gpu2 when the
    group shares a replay buffer, and on the first free device (gpu0) when it does not."""
    inv = synthesize(nodes=1, gpus_per_node=4, numa_per_node=1, nvlink="pairs")
    used = {f"n0-gpu{i}": 30.0 for i in range(3)}
    workers = (WorkerSpec("big", "learner", 60.0), WorkerSpec("small", "other", 8.0))

    shared = place(job(GroupSpec("g", workers, replay_share=True)), inv, used_memory_gb=used)
    assert shared.device_of("big") == "n0-gpu3"
    assert shared.device_of("small") == "n0-gpu2"
    assert inv.nvlinked("n0-gpu2", "n0-gpu3")
    assert one(shared, "small").terms["nvlink"] == 1.0
    assert one(shared, "big").terms["nvlink"] == 0.0

    alone = place(job(GroupSpec("g", workers, replay_share=False)), inv, used_memory_gb=used)
    assert alone.device_of("big") == "n0-gpu3"
    assert alone.device_of("small") == "n0-gpu0"
    assert all(a.terms["nvlink"] == 0.0 for a in alone.assignments)


def test_nvlink_pair_for_two_worker_replay_group() -> None:
    inv = synthesize(nodes=2, gpus_per_node=8, nvlink="pairs")
    p = place(job(group("g", learners=2, replay_share=True)), inv)
    a, b = p.assignments
    assert inv.nvlinked(a.device, b.device)
    assert sum(x.terms["nvlink"] for x in p.assignments) == 1.0


def test_node_term_keeps_a_group_on_one_node() -> None:
    inv = synthesize(nodes=2, gpus_per_node=4)
    busy = {"n0-gpu0", "n0-gpu1", "n0-gpu2"}  # node-0 has one device left: the pair goes to node-1 together
    p = place(job(group("g", learners=2)), inv, busy=busy)
    assert p.complete
    assert {a.node for a in p.assignments} == {"node-1"}
    assert all(a.terms["node"] == 0.5 for a in p.assignments)

    p = place(job(group("g", learners=4)), inv)
    assert len({a.node for a in p.assignments}) == 1
    assert all(a.terms["node"] == 0.5 for a in p.assignments)


def test_group_larger_than_any_node_spreads() -> None:
    inv = synthesize(nodes=2, gpus_per_node=4)
    p = place(job(group("g", learners=6)), inv)
    assert p.complete
    assert {a.node for a in p.assignments} == {"node-0", "node-1"}
    assert all(a.terms["node"] == 0.0 for a in p.assignments)
    assert len({a.device for a in p.assignments}) == 6


def test_placement_is_deterministic() -> None:
    inv = synthesize(nodes=4, gpus_per_node=8)
    spec = job(group("a", learners=1, actors=5), group("b", learners=2, replay_share=True), group("c", others=9))
    first = place(spec, inv).to_dict()
    assert place(spec, inv).to_dict() == first
    # the order the inventory lists devices and nodes in does not matter
    ids = list(inv.devices)
    random.Random(7).shuffle(ids)
    names = list(inv.nodes)[::-1]
    shuffled = Inventory({n: inv.nodes[n] for n in names}, {i: inv.devices[i] for i in ids})
    assert place(spec, shuffled).to_dict() == first


def test_explanation_lists_every_term_and_scores_add_up() -> None:
    inv = synthesize(nodes=2, gpus_per_node=8).with_health({"n0-gpu1": DeviceHealth.PROBATION})
    profiles = Profiles.learn([RunRecord("n0-gpu2", "A100-80GB", "sync-heavy", "x/y", oom=True)])
    spec = job(group("a", learners=1, actors=3, load_class="sync-heavy", replay_share=True), group("b", others=2))
    p = place(spec, inv, profiles, busy={"n1-gpu0"})
    d = p.to_dict()
    assert set(d) == {"job", "complete", "score", "assignments", "unplaced", "excluded"}
    assert d["job"] == "job" and d["complete"] is True
    assert len(d["assignments"]) == 6
    for a in d["assignments"]:
        assert set(a) == {"worker", "group", "role", "device", "node", "numa_node", "cpus", "score", "terms"}
        assert set(a["terms"]) == TERMS
        assert a["score"] == pytest.approx(sum(a["terms"].values()), abs=1e-3)
    for a in p.assignments:
        assert a.score == round(sum(a.terms.values()), 4)
    assert d["score"] == pytest.approx(sum(a["score"] for a in d["assignments"]), abs=1e-3)
    assert p.score == d["score"]
    assert d["excluded"] == {"n1-gpu0": "already runs a worker"}
    assert p.device_of("nobody") is None


def test_weights_scale_terms() -> None:
    inv = synthesize(nodes=1, gpus_per_node=4)
    w = Weights(numa=3.0, nvlink=5.0, state=1.0, node=2.0)
    p = place(job(group("g", learners=1, actors=1, replay_share=True)), inv, weights=w)
    actor = one(p, "g-a0")
    assert actor.terms == {"state": -0.1, "numa": 3.0, "nvlink": 5.0, "node": 2.0, "probation": 0.0}


# -- profiles: state affinity from history -----------------------------------------------------------------------
def rec(
    device: str, load: str = "sync-heavy", worker: str = "hist/w", model: str = "A100-80GB", **kw: Any
) -> RunRecord:
    return RunRecord(device, model, load, worker, **kw)


def test_device_risk_from_history() -> None:
    history = [rec("bad", oom=True) for _ in range(3)]
    history += [rec("hot", throttled=True) for _ in range(3)]
    history += [rec("flaky", failed=True) for _ in range(3)]
    history += [rec("good") for _ in range(3)]
    p = Profiles.learn(history)
    fresh = p.device_risk("never-used", "sync-heavy")
    assert fresh == PRIOR_RISK == 0.1
    assert p.device_risk("bad", "sync-heavy") == pytest.approx((3 + 0.3) / 6)  # 0.55
    assert p.device_risk("flaky", "sync-heavy") == pytest.approx((2.1 + 0.3) / 6)  # 0.4
    assert p.device_risk("hot", "sync-heavy") == pytest.approx((0.9 + 0.3) / 6)  # 0.2
    assert p.device_risk("good", "sync-heavy") == pytest.approx(0.3 / 6)  # stable runs earn trust
    assert (
        p.device_risk("bad", "sync-heavy")
        > p.device_risk("flaky", "sync-heavy")
        > p.device_risk("hot", "sync-heavy")
        > fresh
        > p.device_risk("good", "sync-heavy")
    )
    # per load class: the OOMs under sync-heavy load say nothing about short episodes
    assert p.device_risk("bad", "short-episode") == fresh


def test_one_bad_run_moves_risk_without_deciding_it() -> None:
    p = Profiles.learn([rec("d", oom=True)])
    assert p.device_risk("d", "sync-heavy") == pytest.approx((1 + 0.3) / 4)
    assert 0.1 < p.device_risk("d", "sync-heavy") < 0.5


def test_a_failed_oom_counts_once_as_an_oom() -> None:
    p = Profiles.learn([rec("d", oom=True, failed=True) for _ in range(3)])
    s = p.devices[("d", "sync-heavy")]
    assert (s.runs, s.ooms, s.failures) == (3, 3, 0)
    assert p.device_risk("d", "sync-heavy") == pytest.approx(0.55)


def test_leak_and_jitter_add_bounded_terms() -> None:
    base = Profiles.learn([rec("d") for _ in range(3)]).device_risk("d", "sync-heavy")
    leak = Profiles.learn([rec("d", leak_gb_per_h=2.0) for _ in range(3)]).device_risk("d", "sync-heavy")
    big_leak = Profiles.learn([rec("d", leak_gb_per_h=1000.0) for _ in range(3)]).device_risk("d", "sync-heavy")
    neg_leak = Profiles.learn([rec("d", leak_gb_per_h=-5.0) for _ in range(3)]).device_risk("d", "sync-heavy")
    jitter = Profiles.learn([rec("d", sync_jitter_ms=50.0) for _ in range(3)]).device_risk("d", "sync-heavy")
    big_jitter = Profiles.learn([rec("d", sync_jitter_ms=1e6) for _ in range(3)]).device_risk("d", "sync-heavy")
    assert leak == pytest.approx(base + 0.1)
    assert big_leak == pytest.approx(base + 0.2)
    assert neg_leak == pytest.approx(base)
    assert jitter == pytest.approx(base + 0.1)
    assert big_jitter == pytest.approx(base + 0.2)
    # leak and jitter are means over runs
    mixed = Profiles.learn([rec("d", leak_gb_per_h=4.0), rec("d", leak_gb_per_h=0.0)])
    assert mixed.devices[("d", "sync-heavy")].leak_gb_per_h == pytest.approx(2.0)
    # and the whole risk never exceeds 1
    worst = Profiles.learn([rec("d", oom=True, leak_gb_per_h=99, sync_jitter_ms=1e4) for _ in range(20)])
    assert worst.device_risk("d", "sync-heavy") == 1.0


def test_risk_stays_in_unit_interval_for_negative_jitter() -> None:
    s = ProfileStats()
    s.add(RunRecord.from_dict({"device": "d", "sync_jitter_ms": -1000.0}))
    assert 0.0 <= s.risk() <= 1.0


def test_risky_device_is_avoided_for_its_load_class_only() -> None:
    inv = synthesize(nodes=1, gpus_per_node=3, numa_per_node=1)
    profiles = Profiles.learn([rec("n0-gpu0", "sync-heavy", oom=True) for _ in range(3)])
    heavy = place(job(group("s", learners=1, load_class="sync-heavy")), inv, profiles)
    a = one(heavy, "s-l0")
    assert a.device != "n0-gpu0"
    assert a.terms["state"] == pytest.approx(-2 * PRIOR_RISK)

    light = place(job(group("s", learners=1, load_class="short-episode")), inv, profiles)
    a = one(light, "s-l0")
    assert a.device == "n0-gpu0"  # not penalized: same score as any fresh device, first in order
    assert a.terms["state"] == pytest.approx(-2 * PRIOR_RISK)

    heavy2 = place(job(group("s", learners=2, load_class="sync-heavy")), inv, profiles)
    assert {x.device for x in heavy2.assignments} == {"n0-gpu1", "n0-gpu2"}
    # the risky device is still used when it is the only one left
    last = place(job(group("s", learners=1, load_class="sync-heavy")), inv, profiles, busy={"n0-gpu1", "n0-gpu2"})
    assert last.device_of("s-l0") == "n0-gpu0"
    assert one(last, "s-l0").terms["state"] == pytest.approx(-2 * 0.55)


def test_risk_steers_the_group_to_the_better_node() -> None:
    inv = synthesize(nodes=2, gpus_per_node=2, numa_per_node=1)
    profiles = Profiles.learn([rec(d, "long-episode", throttled=True) for d in ("n0-gpu0", "n0-gpu1")])
    p = place(job(group("g", learners=2, load_class="long-episode")), inv, profiles)
    assert {a.node for a in p.assignments} == {"node-1"}


def test_worker_model_affinity_values() -> None:
    history = [rec(f"old{i}", worker="job/w-0", model="A100-40GB", oom=True) for i in range(2)]
    history += [rec(f"big{i}", worker="job/w-0", model="A100-80GB") for i in range(2)]
    history += [rec("x", worker="job/calm", model="A100-40GB") for _ in range(3)]
    p = Profiles.learn(history)
    assert p.worker_model_affinity("job/w-0", "A100-40GB") == pytest.approx(-2 / 3)
    assert p.worker_model_affinity("job/w-0", "A100-80GB") == pytest.approx(2 / 3)
    assert p.worker_model_affinity("job/w-0", "H100") == 0.0  # no evidence for this model
    assert p.worker_model_affinity("job/calm", "A100-40GB") == 0.0  # never ran out of memory
    assert p.worker_model_affinity("job/calm", "A100-80GB") == 0.0
    assert p.worker_model_affinity("nobody", "A100-80GB") == 0.0
    half = Profiles.learn(
        [rec("a", worker="k", model="M", oom=True), rec("b", worker="k", model="M")]
        + [rec("c", worker="k", model="N")] * 3
    )
    assert half.worker_model_affinity("k", "M") == pytest.approx(0.0)  # as many OOMs as stable runs
    assert half.worker_model_affinity("k", "N") == pytest.approx(0.75)


def mixed_inventory() -> Inventory:
    """One node: gpu0-1 are A100-40GB, gpu2-3 A100-80GB (the 40GB ones first in id order)."""
    base = synthesize(nodes=1, gpus_per_node=4, numa_per_node=1)
    devices = {
        i: replace(d, model="A100-40GB", memory_gb=40.0) if i in ("n0-gpu0", "n0-gpu1") else d
        for i, d in base.devices.items()
    }
    return Inventory(base.nodes, devices)


def test_worker_with_oom_history_is_steered_to_the_bigger_model() -> None:
    inv = mixed_inventory()
    history = [rec(f"old{i}", worker="job/w-0", model="A100-40GB", oom=True) for i in range(3)]
    history += [rec(f"old{i}", worker="job/w-0", model="A100-80GB") for i in range(3)]
    profiles = Profiles.learn(history)
    g = GroupSpec("g", (WorkerSpec("w-0", "learner", 8.0, key="job/w-0"), WorkerSpec("w-1", "learner", 8.0)))
    p = place(job(g), inv, profiles)
    assert inv.devices[p.device_of("w-0") or ""].model == "A100-80GB"
    assert one(p, "w-0").terms["state"] == pytest.approx(2 * (-PRIOR_RISK + 0.75))
    # the worker without an OOM history is not steered: first device in order
    assert p.device_of("w-1") == "n0-gpu0"
    assert one(p, "w-1").terms["state"] == pytest.approx(-2 * PRIOR_RISK)


def test_worker_key_defaults_to_group_and_name() -> None:
    inv = mixed_inventory()
    profiles = Profiles.learn(
        [rec("z", worker="g/w", model="A100-40GB", oom=True), rec("z", worker="g/w", model="A100-80GB")]
    )
    p = place(job(GroupSpec("g", (WorkerSpec("w", "learner", 8.0),))), inv, profiles)
    assert inv.devices[p.device_of("w") or ""].model == "A100-80GB"


def test_worker_steered_across_nodes_of_different_models() -> None:
    base = synthesize(nodes=2, gpus_per_node=2, numa_per_node=1)
    devices = {
        i: replace(d, model="A100-40GB", memory_gb=40.0) if d.node == "node-0" else d for i, d in base.devices.items()
    }
    inv = Inventory(base.nodes, devices)
    profiles = Profiles.learn(
        [rec("o", worker="j/g-0", model="A100-40GB", oom=True)] * 2 + [rec("p", worker="j/g-0", model="A100-80GB")] * 2
    )
    g = GroupSpec("g", (WorkerSpec("g-0", "learner", 8.0, "j/g-0"), WorkerSpec("g-1", "learner", 8.0, "j/g-1")))
    p = place(job(g), inv, profiles)
    assert {a.node for a in p.assignments} == {"node-1"}
    # without history the group takes the first node
    p = place(job(g), inv)
    assert {a.node for a in p.assignments} == {"node-0"}


def test_profiles_to_dict() -> None:
    p = Profiles.learn(
        [
            rec("d1", "sync-heavy", worker="w", model="M", oom=True, leak_gb_per_h=1.0),
            rec("d0", "short-episode", worker="w", model="M", throttled=True),
            rec("d0", "short-episode", worker="v", model="N"),
        ]
    )
    d = p.to_dict()
    assert [(x["device"], x["load_class"]) for x in d["devices"]] == [("d0", "short-episode"), ("d1", "sync-heavy")]
    d0 = d["devices"][0]
    assert d0["runs"] == 2 and d0["throttles"] == 1 and d0["ooms"] == 0
    assert d0["risk"] == round(p.device_risk("d0", "short-episode"), 4)
    d1 = d["devices"][1]
    assert d1["ooms"] == 1 and d1["leak_gb_per_h"] == 1.0
    assert d1["risk"] == round(p.device_risk("d1", "sync-heavy"), 4)
    assert [(x["worker"], x["model"], x["runs"]) for x in d["worker_models"]] == [("v", "N", 1), ("w", "M", 2)]
    assert set(d["worker_models"][1]) == {
        "worker",
        "model",
        "runs",
        "ooms",
        "failures",
        "throttles",
        "leak_gb_per_h",
        "sync_jitter_ms",
    }
    assert Profiles().to_dict() == {"devices": [], "worker_models": []}


@pytest.mark.parametrize(
    ("metrics", "load"),
    [
        ({"sync_latency_ms_p50": 40.0, "step_ms_mean": 100.0}, "sync-heavy"),
        ({"sync_latency_ms_p50": 30.0, "step_ms_mean": 100.0}, "sync-heavy"),  # 30 % is enough
        ({"sync_latency_ms_p50": 29.0, "step_ms_mean": 100.0}, "short-episode"),
        ({"sync_latency_ms_p50": 5.0}, "sync-heavy"),  # syncs, step time unknown
        ({"sync_latency_ms_p50": 5.0, "step_ms_mean": 1000.0}, "short-episode"),  # the probe's step time key
        ({"sync_latency_ms_p50": 10.0, "step_ms_mean": 100.0, "episode_length_mean": 1000.0}, "long-episode"),
        ({"sync_latency_ms_p50": 50.0, "step_ms_mean": 100.0, "episode_length_mean": 1000.0}, "sync-heavy"),
        ({"episode_length_mean": 500.0}, "long-episode"),
        ({"episode_length_mean": 499.0}, "short-episode"),
        ({"sync_latency_ms_p50": 10.0, "step_ms_mean": 100.0, "episode_length_mean": 200.0}, "short-episode"),
        ({}, "short-episode"),
        ({"sync_latency_ms_p50": 0.0, "step_ms_mean": 0.0}, "short-episode"),
    ],
)
def test_classify_load(metrics: dict[str, float], load: str) -> None:
    assert classify_load(metrics) == load
    assert load in LOAD_CLASSES


def test_run_record_round_trip_and_defaults() -> None:
    r = RunRecord(
        "d",
        "A100-40GB",
        "long-episode",
        "job/g-0",
        oom=True,
        failed=True,
        throttled=True,
        leak_gb_per_h=1.5,
        sync_jitter_ms=3.25,
        hours=2.0,
    )
    assert RunRecord.from_dict(r.to_dict()) == r
    assert r.to_dict()["worker_key"] == "job/g-0"
    assert RunRecord.from_dict({"device": "x"}) == RunRecord("x", "unknown", "short-episode", "")
    coerced = RunRecord.from_dict({"device": 7, "oom": 1, "hours": "1.5"})
    assert coerced.device == "7" and coerced.oom is True and coerced.hours == 1.5


# -- the job file's placement request ----------------------------------------------------------------------------
JOB = {
    "job": "ppo",
    "pool": "pool-0",
    "groups": [
        {
            "name": "learners",
            "role": "learner",
            "world_size": 2,
            "memory_gb": 6,
            "load_class": "sync-heavy",
            "replay_share": True,
            "command": ["python", "train.py"],
        },
        {"name": "actors", "role": "actor", "world_size": 3, "command": ["python", "act.py"]},
    ],
}


def test_jobfile_spec_names_and_keys() -> None:
    spec = JobFile.model_validate(JOB).spec()
    assert spec.name == "ppo" and spec.pool == "pool-0"
    learners, actors = spec.groups
    assert learners.name == "learners" and learners.load_class == "sync-heavy" and learners.replay_share
    assert [w.name for w in learners.workers] == ["learners-0", "learners-1"]
    assert [w.key for w in learners.workers] == ["ppo/learners-0", "ppo/learners-1"]
    assert {(w.role, w.memory_gb) for w in learners.workers} == {("learner", 6.0)}
    assert actors.load_class == "short-episode" and not actors.replay_share
    assert [w.name for w in actors.workers] == ["actors-0", "actors-1", "actors-2"]
    assert [w.key for w in actors.workers] == ["ppo/actors-0", "ppo/actors-1", "ppo/actors-2"]
    assert {(w.role, w.memory_gb) for w in actors.workers} == {("actor", 4.0)}


def test_jobfile_spec_keys_carry_oom_history() -> None:
    spec = JobFile.model_validate(JOB).spec()
    base = synthesize(nodes=1, gpus_per_node=7, numa_per_node=1)
    inv = Inventory(
        base.nodes,
        {i: d if i == "n0-gpu6" else replace(d, model="A100-40GB", memory_gb=40.0) for i, d in base.devices.items()},
    )
    # without history actors-2 gets a 40GB device (the only 80GB one is last in order)
    assert inv.devices[place(spec, inv).device_of("actors-2") or ""].model == "A100-40GB"
    profiles = Profiles.learn(
        [rec("z", worker="ppo/actors-2", model="A100-40GB", oom=True), rec("y", worker="ppo/actors-2")]
    )
    p = place(spec, inv, profiles)
    assert p.complete
    assert p.device_of("actors-2") == "n0-gpu6"


def test_invalid_load_class() -> None:
    with pytest.raises(ValueError, match="load_class='medium' is invalid: expected one of"):
        GroupSpec("g", (WorkerSpec("w"),), "medium")
    bad = {**JOB, "groups": [{**JOB["groups"][0], "load_class": "medium"}]}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="load_class"):
        JobFile.model_validate(bad)


def test_example_job_on_example_cluster_pool() -> None:
    pools, devices = load_cluster(ROOT / "examples" / "cluster.yaml")
    pool = next(p for p in pools if p.name == "pool-0")
    jf = load_job(ROOT / "examples" / "jobs" / "ppo.yaml")
    spec = jf.spec()
    assert spec.pool == "pool-0"
    p = place(spec, from_cluster(devices), allowed=set(pool.devices), gpu_quota=pool.gpu_quota)
    assert p.complete
    assert {a.device for a in p.assignments} == {"gpu-00", "gpu-01"}
    assert {a.worker for a in p.assignments} == {"learners-0", "learners-1"}
    assert len(p.excluded) == 14 and set(p.excluded.values()) == {"not in the pool"}


# -- placement: pins ---------------------------------------------------------------------------------------------
def pin(spec: GroupSpec, **devices: str) -> GroupSpec:
    """``spec`` with some workers pinned (worker name with ``-`` written ``_`` -> device)."""
    by = {k.replace("_", "-"): v for k, v in devices.items()}
    return replace(spec, workers=tuple(replace(w, device=by.get(w.name)) for w in spec.workers))


def test_pinned_workers_keep_their_devices_and_only_the_others_move() -> None:
    # What the launcher asks when one worker must leave a degraded device: the others stay where they run.
    inv = synthesize(nodes=1, gpus_per_node=6, numa_per_node=1).with_health({"n0-gpu1": DeviceHealth.DEGRADED})
    spec = job(pin(group("g", learners=1, actors=3), g_l0="n0-gpu0", g_a1="n0-gpu2", g_a2="n0-gpu3"))
    p = place(spec, inv)
    assert p.complete
    assert {a.worker: a.device for a in p.assignments if a.worker != "g-a0"} == {
        "g-l0": "n0-gpu0", "g-a1": "n0-gpu2", "g-a2": "n0-gpu3"
    }  # fmt: skip
    assert p.device_of("g-a0") in {"n0-gpu4", "n0-gpu5"}
    assert set(p.assignments[0].terms) == TERMS
    # Unpinned, the same job is placed anew: the learner's first choice differs from where it ran.
    free = place(job(group("g", learners=1, actors=3)), inv, busy={"n0-gpu0"})
    assert free.device_of("g-l0") != "n0-gpu0"


def test_a_pin_is_honoured_on_a_degraded_device_and_takes_it_from_the_others() -> None:
    inv = synthesize(nodes=1, gpus_per_node=3, numa_per_node=1).with_health({"n0-gpu0": DeviceHealth.DEGRADED})
    p = place(job(pin(group("g", actors=1), g_a0="n0-gpu0"), group("h", learners=2)), inv)
    assert p.complete and p.device_of("g-a0") == "n0-gpu0"
    assert {p.device_of("h-l0"), p.device_of("h-l1")} == {"n0-gpu1", "n0-gpu2"}
    # a healthy pinned device is no one else's either
    p = place(job(pin(group("g", actors=1), g_a0="n0-gpu1"), group("h", learners=2)), inv)
    assert p.device_of("g-a0") == "n0-gpu1" and not p.complete and set(p.unplaced) == {"h-l0", "h-l1"}


@pytest.mark.parametrize(
    ("device", "kwargs", "why"),
    [
        ("n9-gpu0", {}, "pinned to n9-gpu0: no such device"),
        ("n0-gpu3", {"allowed": {"n0-gpu0", "n0-gpu1", "n0-gpu2"}}, "pinned to n0-gpu3: not in the pool"),
        ("n0-gpu2", {"busy": {"n0-gpu2"}}, "pinned to n0-gpu2: a worker of another job runs there"),
    ],
)
def test_a_refused_pin_leaves_its_worker_unplaced_with_why(device: str, kwargs: dict[str, Any], why: str) -> None:
    inv = synthesize(nodes=1, gpus_per_node=4, numa_per_node=1)
    p = place(job(pin(group("g", learners=1, actors=1), g_a0=device)), inv, **kwargs)
    assert p.unplaced == {"g-a0": why}
    assert p.device_of("g-l0") is not None  # the group's other worker is still placed


def test_two_pins_on_one_device_refuse_the_second() -> None:
    inv = synthesize(nodes=1, gpus_per_node=4, numa_per_node=1)
    p = place(job(pin(group("g", actors=2), g_a0="n0-gpu1", g_a1="n0-gpu1")), inv)
    assert p.device_of("g-a0") == "n0-gpu1" and p.unplaced == {"g-a1": "pinned to n0-gpu1, which g-a0 is pinned to"}


def test_pins_count_against_the_gpu_quota_and_keep_a_group_on_their_node() -> None:
    inv = synthesize(nodes=2, gpus_per_node=4)
    p = place(job(pin(group("g", learners=2), g_l0="n0-gpu3")), inv, gpu_quota=2)
    assert p.complete and p.device_of("g-l0") == "n0-gpu3" and p.device_of("g-l1") == "n0-gpu0"
    p = place(job(pin(group("g", learners=2), g_l0="n0-gpu3")), inv, gpu_quota=1)
    assert set(p.unplaced) == {"g-l1"} and p.device_of("g-l0") == "n0-gpu3"  # the pinned one keeps its device
    # the unpinned worker joins its pinned peer's node, though the other node is emptier
    p = place(job(pin(group("g", learners=2), g_l0="n1-gpu2")), inv, busy={"n1-gpu0"})
    assert p.complete and inv.devices[p.device_of("g-l1") or ""].node == "node-1"
    assert all(a.terms["node"] == 0.5 for a in p.assignments)
