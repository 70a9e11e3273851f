"""The ``ray`` launcher against a real multi-node Ray cluster faked on loopback (``ray.cluster_utils.Cluster``).

Three nodes with two fake GPUs each, labelled ``dsec/node=node-0..2`` like :func:`synthesize`'s inventory. The
cluster is shared by the module (starting one costs ~6-10 s on two cores); a test that removes a node adds it back.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from dsec.launch.base import Exit, WorkerLaunch  # noqa: E402
from dsec.launch.ray_backend import RayLauncher  # noqa: E402
from dsec.scheduler.inventory import Inventory, synthesize  # noqa: E402
from dsec.scheduler.placement import GroupSpec, JobSpec, Placement, WorkerSpec, place  # noqa: E402

# Ray's worker pool and the nodes a test adds live in the module's cluster, which stops them at its teardown.
pytestmark = pytest.mark.shared_processes

MB = 1024 * 1024
NODE_ARGS: dict[str, Any] = {"num_cpus": 4, "num_gpus": 2, "object_store_memory": 80 * MB}
# Settings that keep Ray on loopback and off the auth token it would otherwise write (shared/NOTES-machine.md).
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
# The GCS declares a silent node dead after failure_threshold x period (default 5 x 3 s): shorter here.
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_timeout_ms": 500}
SLEEP = "import time, os; print(os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True); time.sleep({s})"


@dataclass
class FakeCluster:
    cluster: Any
    nodes: dict[str, Any] = field(default_factory=dict)  # dsec/node label -> ray._private.node.Node

    def add(self, name: str) -> None:
        self.nodes[name] = self.cluster.add_node(labels={"dsec/node": name}, **NODE_ARGS)


@pytest.fixture(scope="module")
def cluster() -> Iterator[FakeCluster]:
    with pytest.MonkeyPatch.context() as mp:
        # Before any Ray process starts (raylets and workers inherit them). The driver read the first one when it
        # imported ray (ray_constants.ENABLE_RAY_CLUSTER): without the patch it advertises the host's address.
        for k, v in RAY_ENV.items():
            mp.setenv(k, v)
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        c = Cluster(
            initialize_head=True,
            head_node_args={
                "labels": {"dsec/node": "node-0"},
                "include_dashboard": False,
                "_system_config": FAST_NODE_DEATH,
                **NODE_ARGS,
            },
        )
        try:
            fc = FakeCluster(c, {"node-0": c.head_node})
            fc.add("node-1")
            fc.add("node-2")
            c.wait_for_nodes()
            ray.init(address=c.address, namespace="dsec-test", log_to_driver=False)
            assert c.address.startswith("127.0.0.1:"), c.address
            yield fc
        finally:
            ray.shutdown()
            c.shutdown()


@pytest.fixture
def launcher(cluster: FakeCluster) -> Iterator[RayLauncher]:
    lau = RayLauncher(pg_timeout_s=20.0)
    try:
        yield lau
    finally:
        lau.stop()
    assert ray.is_initialized(), "the launcher shut down a Ray it did not start"


def launches(placement: Placement, code: str | dict[str, str]) -> list[WorkerLaunch]:
    """One WorkerLaunch per assignment, running ``python -c code`` (or ``code[worker]``)."""
    sizes = {a.group: sum(1 for b in placement.assignments if b.group == a.group) for a in placement.assignments}
    out = []
    for a in placement.assignments:
        ranks = [b.worker for b in placement.assignments if b.group == a.group]
        src = code if isinstance(code, str) else code[a.worker]
        out.append(
            WorkerLaunch(
                worker=a.worker,
                group=a.group,
                role=a.role,
                rank=ranks.index(a.worker),
                world_size=sizes[a.group],
                command=(sys.executable, "-c", src),
                env={"DSEC_WORKER": a.worker},
                device=a.device,
                node=a.node,
                cpus=a.cpus,
                gpu_index=int(a.device.rsplit("gpu", 1)[1]),
            )
        )
    return out


def poll_until(lau: RayLauncher, want: set[str], timeout: float = 30.0) -> dict[str, Exit]:
    """Poll until every worker in ``want`` has exited; answers all exits seen."""
    seen: dict[str, Exit] = {}
    deadline = time.monotonic() + timeout
    while not want <= set(seen):
        if time.monotonic() > deadline:
            pytest.fail(f"no exit within {timeout:g} s for {sorted(want - set(seen))} (seen {sorted(seen)})")
        for e in lau.poll():
            assert e.worker not in seen, f"{e.worker} reported twice"
            seen[e.worker] = e
        time.sleep(0.05)
    return seen


def wait_running(pid: int, timeout: float = 10.0) -> None:
    """Until the worker's process has exec'd its command (it starts as the launcher's exec shim)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(psutil.Process(pid).cmdline()) == 3:  # python -c <code>
            return
        time.sleep(0.02)
    pytest.fail(f"pid {pid} did not exec its command within {timeout:g} s")


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not psutil.pid_exists(pid)


def group(name: str, *workers: tuple[str, str]) -> GroupSpec:
    return GroupSpec(name, tuple(WorkerSpec(w, role) for w, role in workers))


def inventory() -> Inventory:
    return synthesize(nodes=3, gpus_per_node=2, numa_per_node=1, cpus_per_numa=2)


def test_workers_run_on_the_nodes_and_gpus_placement_chose(launcher: RayLauncher) -> None:
    job = JobSpec(
        "j1",
        (
            group(
                "train", ("learner-0", "learner"), ("learner-1", "learner"), ("actor-0", "actor"), ("actor-1", "actor")
            ),
            group("eval", ("eval-0", "other"), ("eval-1", "other")),
        ),
    )
    placement = place(job, inventory())
    assert placement.complete and len(placement.assignments) == 6
    t0 = time.monotonic()
    launcher.start(launches(placement, SLEEP.format(s=30)))
    started = time.monotonic() - t0
    where = launcher.where()
    assert where == {a.worker: a.node for a in placement.assignments}
    details = launcher.details()
    gpus = {(where[w], d["cuda_visible_devices"]) for w, d in details.items()}
    assert all(d["cuda_visible_devices"] in ("0", "1") for d in details.values()), details
    assert len(gpus) == 6, f"two workers share a GPU: {details}"
    assert all(psutil.pid_exists(d["pid"]) for d in details.values())
    # the train group spans two nodes (PACK), eval sits on one (STRICT_PACK)
    assert len({a.node for a in placement.assignments if a.group == "train"}) == 2
    assert placement_group_table(launcher.placement_group("train"))["strategy"] == "PACK"
    assert placement_group_table(launcher.placement_group("eval"))["strategy"] == "STRICT_PACK"
    assert placement_group_table(launcher.placement_group("eval"))["state"] == "CREATED"
    assert launcher.poll() == []
    pids = [d["pid"] for d in details.values()]
    launcher.stop_group("eval")
    assert set(launcher.where()) == {a.worker for a in placement.assignments if a.group == "train"}
    launcher.stop()
    assert not any(psutil.pid_exists(p) for p in pids)
    assert started < 30, f"starting 6 workers took {started:.1f} s"


def test_exit_code_is_reported(launcher: RayLauncher) -> None:
    job = JobSpec("j2", (group("g", ("quits", "learner"), ("stays", "actor")),))
    placement = place(job, inventory())
    ws = launches(placement, {"quits": "import sys; sys.exit(3)", "stays": SLEEP.format(s=30)})
    # and one CPU-only worker pinned to node-2 that ends cleanly
    ws.append(WorkerLaunch("cpu-only", "h", "other", 0, 1, (sys.executable, "-c", "pass"), node="node-2"))
    launcher.start(ws)
    seen = poll_until(launcher, {"quits", "cpu-only"})
    assert seen["quits"].code == 3 and seen["quits"].group == "g"
    assert seen["cpu-only"].code == 0
    assert launcher.where()["cpu-only"] == "node-2"
    assert launcher.details()["cpu-only"]["cuda_visible_devices"] == ""
    assert "stays" not in seen
    assert launcher.poll() == []  # each exit is reported once


def test_stop_group_terms_then_kills_and_reports_nothing(launcher: RayLauncher, tmp_path: Path) -> None:
    job = JobSpec("j5", (group("g", ("polite", "learner"), ("stubborn", "actor")),))
    trap = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        f"    open({str(tmp_path / 'polite')!r}, 'w').write('TERM'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "time.sleep(60)\n"
    )
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    launcher.start(launches(place(job, inventory()), {"polite": trap, "stubborn": stubborn}))
    pids = {w: d["pid"] for w, d in launcher.details().items()}
    for pid in pids.values():
        wait_running(pid)
    time.sleep(0.3)  # let the commands install their handlers
    t0 = time.monotonic()
    launcher.stop_group("g", grace_s=1.0)
    took = time.monotonic() - t0
    assert (tmp_path / "polite").read_text() == "TERM"
    assert not any(psutil.pid_exists(p) for p in pids.values())
    assert 1.0 <= took < 10, took  # the stubborn one waited out the grace period, then SIGKILL
    assert launcher.poll() == [] and launcher.where() == {}


def test_a_killed_actor_is_a_lost_worker_and_takes_its_command_along(launcher: RayLauncher) -> None:
    job = JobSpec("j4", (group("g", ("w0", "learner"), ("w1", "actor")),))
    launcher.start(launches(place(job, inventory()), SLEEP.format(s=60)))
    info = launcher.details()["w0"]
    wait_running(info["pid"])
    os.kill(info["actor_pid"], signal.SIGKILL)  # as the OOM killer would: no chance to clean up
    seen = poll_until(launcher, {"w0"}, timeout=15)
    assert seen["w0"].code is None and "ActorDiedError" in launcher.details()["w0"]["error"]
    # the command got SIGKILL from the kernel when its actor died (PR_SET_PDEATHSIG)
    assert wait_gone(info["pid"], timeout=5), "the command outlived its actor"
    assert launcher.poll() == []  # its peer runs on


def test_a_command_killed_by_a_signal_is_reported_with_it_while_its_actor_lives(launcher: RayLauncher) -> None:
    job = JobSpec("j6", (group("g", ("w0", "learner"), ("w1", "actor")),))
    launcher.start(launches(place(job, inventory()), SLEEP.format(s=60)))
    info = launcher.details()["w0"]
    wait_running(info["pid"])
    os.kill(info["pid"], signal.SIGKILL)  # the command alone, as the kernel's OOM killer would
    seen = poll_until(launcher, {"w0"}, timeout=15)
    assert seen["w0"].code == -signal.SIGKILL and launcher.details()["w0"]["error"] == ""
    assert launcher.poll() == []


def test_a_signal_status_from_an_actor_that_dies_right_after_is_a_lost_worker(launcher: RayLauncher) -> None:
    # What a node crash can look like: its command is killed a moment before its actor, and the actor hands back the
    # signal status before it dies itself. The launcher must not report that as the command's own crash.
    job = JobSpec("j7", (group("g", ("w0", "learner"), ("w1", "actor")),))
    launcher.start(launches(place(job, inventory()), SLEEP.format(s=60)))
    info = launcher.details()["w0"]
    wait_running(info["pid"])
    (running,) = [r for g in launcher._groups.values() for r in g.workers if r.launch.worker == "w0"]
    os.kill(info["pid"], signal.SIGKILL)
    ready, _ = ray.wait([running.run_ref], timeout=15)  # the actor answered -9 ...
    assert ready and ray.get(running.run_ref) == -signal.SIGKILL
    os.kill(info["actor_pid"], signal.SIGKILL)  # ... and then died, before the launcher polled
    assert wait_gone(info["actor_pid"], timeout=10)
    seen = poll_until(launcher, {"w0"}, timeout=30)
    assert seen["w0"].code is None and "ActorDiedError" in launcher.details()["w0"]["error"]
    assert launcher.poll() == []


def test_a_group_that_cannot_be_placed_raises_naming_it(cluster: FakeCluster) -> None:
    # Placement gives up after 1 s; the placeable group's actors may take longer to start on a busy machine (they
    # once took more than 1 s in a full run, and the test failed on the wrong group).
    lau = RayLauncher(pg_timeout_s=1.0, start_timeout_s=60.0)
    try:
        ok = WorkerLaunch("ok", "fine", "learner", 0, 1, (sys.executable, "-c", SLEEP.format(s=30)), node="node-0")
        lost = WorkerLaunch(
            "w", "ghost", "learner", 0, 1, (sys.executable, "-c", "pass"), device="n9-gpu0", node="node-9"
        )
        with pytest.raises(RuntimeError, match=r"group 'ghost' could not be placed.*node-0, node-1, node-2"):
            lau.start([ok, lost])
        assert lau.where() == {}  # all or nothing: the group that was placed is stopped again
    finally:
        lau.stop()
    assert not [t for t in placement_group_table().values() if t["state"] != "REMOVED"]


def test_losing_a_node_reports_its_workers_and_the_group_relaunches_elsewhere(
    cluster: FakeCluster, launcher: RayLauncher
) -> None:
    inv = inventory()
    job = JobSpec(
        "j3", (group("ga", ("a0", "learner"), ("a1", "actor")), group("gb", ("b0", "learner"), ("b1", "actor")))
    )
    placement = place(job, inv)
    nodes = {g: {a.node for a in placement.assignments if a.group == g} for g in ("ga", "gb")}
    assert all(len(n) == 1 for n in nodes.values()), nodes
    victim = next(g for g in ("ga", "gb") if nodes[g] != {"node-0"})  # the head node cannot be removed
    survivor = "gb" if victim == "ga" else "ga"
    (lost_node,) = nodes[victim]
    launcher.start(launches(placement, SLEEP.format(s=60)))
    pids = {w: d["pid"] for w, d in launcher.details().items()}
    victims = {a.worker for a in placement.assignments if a.group == victim}
    pg = launcher.placement_group(victim)
    for w in victims:
        wait_running(pids[w])
    try:
        t0 = time.monotonic()
        cluster.cluster.remove_node(cluster.nodes.pop(lost_node), allow_graceful=False)  # as in a crash
        seen = poll_until(launcher, victims, timeout=30)
        noticed = time.monotonic() - t0
        assert set(seen) == victims, f"the other group was reported too: {seen}"
        assert all(e.code is None and e.group == victim for e in seen.values())
        # first ActorUnavailableError (raylet gone, node not yet declared dead): poll() re-attaches until Ray says
        assert "node has died" in launcher.details()[next(iter(victims))]["error"]
        # the label selectors pin the lost bundles to the lost node: Ray keeps trying to reschedule them
        assert placement_group_table(pg)["state"] == "RESCHEDULING"
        # the actors died with the node, and their commands with them (PR_SET_PDEATHSIG)
        assert all(wait_gone(pids[w], timeout=5) for w in victims), "a lost worker's command outlived its actor"

        launcher.stop_group(victim)
        assert placement_group_table(pg)["state"] == "REMOVED"
        again = place(
            JobSpec("j3", tuple(g for g in job.groups if g.name == victim)),
            inv,
            allowed={d.id for d in inv.devices.values() if d.node != lost_node},
            busy={a.device for a in placement.assignments if a.group == survivor},
        )
        assert again.complete
        (new_node,) = {a.node for a in again.assignments}
        assert new_node not in (lost_node, *nodes[survivor])
        launcher.start(launches(again, SLEEP.format(s=60)))
        assert {w: n for w, n in launcher.where().items() if w in victims} == dict.fromkeys(victims, new_node)
        assert launcher.poll() == []
        assert noticed < 10, f"the lost node's workers were reported after {noticed:.1f} s"
    finally:
        launcher.stop()
        if lost_node not in cluster.nodes:
            cluster.add(lost_node)  # give the module its three nodes back
            cluster.cluster.wait_for_nodes()


def test_a_launcher_that_connected_to_ray_disconnects_on_stop(cluster: FakeCluster) -> None:
    ray.shutdown()
    try:
        lau = RayLauncher(address=cluster.cluster.address, namespace="dsec-own")
        try:
            assert ray.is_initialized() and ray.get_runtime_context().namespace == "dsec-own"
            lau.start([WorkerLaunch("w", "g", "other", 0, 1, (sys.executable, "-c", "pass"), node="node-1")])
            assert poll_until(lau, {"w"})["w"].code == 0
        finally:
            lau.stop()
        assert not ray.is_initialized()
    finally:
        if not ray.is_initialized():
            ray.init(address=cluster.cluster.address, namespace="dsec-test", log_to_driver=False)
