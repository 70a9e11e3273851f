"""Kill and recover with real processes: a 2-rank DDP job under the supervisor and the local launcher, one rank
SIGKILLed -> detected -> the group restarted from its snapshots -> training resumed, each phase timed and recorded.
Also: a device the control plane marks degraded makes the supervisor move the group to other devices."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, wait_for
from dsec.launch.jobfile import JobFile
from dsec.launch.local import LocalLauncher
from dsec.launch.supervisor import Recovery, Supervisor

pytest.importorskip("torch")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ddp_rank.py"


def job_file(tmp_path: Path, pool: str = "pool-a") -> JobFile:
    return JobFile.model_validate(
        {
            "job": "toy",
            "pool": pool,
            "snapshots": {"dir": str(tmp_path / "snaps"), "interval_s": 1},
            "restart": {"max_restarts": 2, "resume_timeout_s": 60},
            "groups": [
                {
                    "name": "trainers",
                    "world_size": 2,
                    "memory_gb": 1,
                    "env": {"DSEC_HEARTBEAT_INTERVAL": "0.2", "OMP_NUM_THREADS": "1"},
                    "command": [sys.executable, str(FIXTURE), "--stop-file", str(tmp_path / "stop")],
                }
            ],
        }
    )


@pytest.fixture
def cp(server_factory: Callable[..., Harness]) -> Harness:
    h = server_factory(pools=True)
    for i in range(4):
        h.admin.request("PUT", f"/v1/devices/gpu-{i}", json={"id": f"gpu-{i}", "node": "node-0", "memory_gb": 16})
    h.admin.put_pool("pool-a", devices=[f"gpu-{i}" for i in range(4)])
    return h


def snapshotted(h: Harness, since: float, n: int) -> bool:
    evs = [e for e in h.admin.all_events(types=["snapshot"], since=since) if e["data"].get("status") == "ok"]
    return len({e["worker_id"] for e in evs}) >= n


def supervise_until(sup: Supervisor, cond: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        sup.step()
        time.sleep(0.02)


def test_kill_one_rank_restarts_the_group_from_snapshots(cp: Harness, tmp_path: Path) -> None:
    job = job_file(tmp_path)
    launcher = LocalLauncher(log_dir=tmp_path / "logs")
    recoveries: list[Recovery] = []
    sup = Supervisor(job, launcher, client=cp.admin, endpoint=cp.url, pool_token=cp.pool_tokens["pool-a"],
                     poll_s=0.02, on_recovery=recoveries.append)  # fmt: skip
    try:
        sup.start()
        placed = {a["worker"]: a["device"] for a in sup.placement["assignments"]}
        assert sorted(placed) == ["trainers-0", "trainers-1"] and len(set(placed.values())) == 2
        assert cp.admin.placement("toy")["complete"] is True
        t0 = time.time()
        supervise_until(sup, lambda: snapshotted(cp, t0, 2), 90, "a snapshot from both ranks")
        t_kill = time.time()
        os.kill(launcher.pids("trainers")["trainers-1"], signal.SIGKILL)
        supervise_until(sup, lambda: recoveries, 90, "the recovery")
        (rec,) = recoveries
        assert rec.group == "trainers" and rec.worker == "trainers-1" and rec.code == -signal.SIGKILL
        assert 0 <= rec.detected_at - t_kill < 1.0, "the supervisor notices a dead rank within a second"
        assert rec.resumed_at is not None and rec.resumed_at > rec.spawned_at > rec.stopped_at >= rec.detected_at
        assert len(rec.restored) == 2 and all("/" in r for r in rec.restored), rec.restored  # snapshot ids
        (ev,) = cp.admin.all_events(types=["recovery"])
        timings = ev["data"]
        assert timings["job"] == "toy" and timings["exit_code"] == -signal.SIGKILL
        assert {"detect_s", "stop_s", "restart_s", "restore_s", "total_s"} <= set(timings)
        assert timings["total_s"] >= timings["restart_s"] > 0

        def trained_after_restart() -> bool:
            new = [w for w in cp.admin.workers(pool="pool-a") if w["registered_at"] > rec.spawned_at]
            return len(new) == 2 and all(w["metrics"].get("updates_total", 0) > 0 for w in new)

        wait_for(trained_after_restart, timeout=60, what="training to resume after the restart")
        # Both ranks resumed from the same step (one agreed step, never each its own newest snapshot) ...
        restores = [e["data"] for e in cp.admin.all_events(types=["restore"]) if e["data"]["status"] == "ok"]
        assert len(restores) == 2 and len({d["agreed_step"] for d in restores}) == 1, restores
        # ... and launched workers report the device they were placed on (device health can judge them).
        names = {w["id"]: f"trainers-{w['rank']}" for w in cp.admin.workers(pool="pool-a")}
        assert {names[w["id"]]: w["device"] for w in cp.admin.workers(pool="pool-a")} == {
            n: placed[n] for n in names.values()
        }
        (tmp_path / "stop").touch()
        assert sup.run(timeout_s=60), sup.failed
        assert sup.restarts == {"trainers": 1}
    finally:
        sup.stop()


ACTOR = Path(__file__).resolve().parents[1] / "fixtures" / "env_actor.py"


def impala_job(tmp_path: Path, actors: int, max_restarts: int) -> JobFile:
    """One DDP learner and ``actors`` env runners (``role: actor``), until ``tmp_path / "stop"`` exists."""
    stop = tmp_path / "stop"
    env = {"DSEC_HEARTBEAT_INTERVAL": "0.2", "OMP_NUM_THREADS": "1"}
    return JobFile.model_validate(
        {
            "job": "impala",
            "pool": "pool-a",
            "snapshots": {"dir": str(tmp_path / "snaps"), "interval_s": 1},
            "restart": {"max_restarts": max_restarts, "resume_timeout_s": 60},
            "groups": [
                {"name": "learners", "world_size": 1, "memory_gb": 1, "env": env,
                 "command": [sys.executable, str(FIXTURE), "--stop-file", str(stop)]},
                {"name": "actors", "role": "actor", "world_size": actors, "memory_gb": 1, "env": env,
                 "command": [sys.executable, str(ACTOR), "--stop-file", str(stop)]},
            ],
        }
    )  # fmt: skip


def test_a_dead_actor_restarts_alone_and_the_learner_is_not_rolled_back(cp: Harness, tmp_path: Path) -> None:
    """``role: actor`` groups restart per worker (``restart_scope`` defaults to ``worker`` for actors): an env runner
    killed -9 is started again alone; its fellow actors and the learner keep their processes and their progress."""
    stop = tmp_path / "stop"
    job = impala_job(tmp_path, actors=3, max_restarts=2)
    assert [g.scope for g in job.groups] == ["group", "worker"]
    launcher = LocalLauncher(log_dir=tmp_path / "logs")
    recoveries: list[Recovery] = []
    sup = Supervisor(job, launcher, client=cp.admin, endpoint=cp.url, pool_token=cp.pool_tokens["pool-a"],
                     poll_s=0.02, on_recovery=recoveries.append)  # fmt: skip

    def learner_updates() -> float:
        ws = [w for w in cp.admin.workers(pool="pool-a") if w["group"] == "learners" and w["state"] == "active"]
        return max((float(w["metrics"].get("updates_total", 0)) for w in ws), default=0.0)

    try:
        sup.start()
        supervise_until(sup, lambda: learner_updates() > 5 and len(cp.admin.workers(pool="pool-a")) == 4, 90,
                        "the learner training and three actors registered")  # fmt: skip
        before = {**launcher.pids("actors"), **launcher.pids("learners")}
        t_kill = time.time()
        os.kill(before["actors-1"], signal.SIGKILL)
        supervise_until(sup, lambda: recoveries, 60, "the actor's recovery")
        (rec,) = recoveries
        assert rec.mode == "worker" and rec.worker == "actors-1" and rec.code == -signal.SIGKILL
        assert 0 <= rec.detected_at - t_kill < 1.0
        assert rec.resumed_at is not None and rec.resumed_at > rec.spawned_at  # the new process's registration
        after = {**launcher.pids("actors"), **launcher.pids("learners")}
        assert after["actors-1"] != before["actors-1"]
        assert {k: v for k, v in after.items() if k != "actors-1"} == {
            k: v for k, v in before.items() if k != "actors-1"
        }
        (ev,) = cp.admin.all_events(types=["recovery"])
        assert ev["data"]["mode"] == "worker" and ev["data"]["healthy_ranks_restarted"] == 0
        assert {"detect_s", "restart_s", "total_s"} <= set(ev["data"])
        # The learner was not restarted: one registration, no restore, its update count only grew.
        learners = [w for w in cp.admin.workers(pool="pool-a") if w["group"] == "learners"]
        assert len(learners) == 1 and not cp.admin.all_events(types=["restore"], worker_id=learners[0]["id"])
        assert sup.restarts == {"learners": 0, "actors": 1}
        stop.touch()
        assert sup.run(timeout_s=60), sup.failed
    finally:
        sup.stop()


def checking_devices(cp: Harness, job: JobFile, launcher: LocalLauncher, recoveries: list[Recovery]) -> Supervisor:
    """A supervisor of ``job`` that reads the devices' health every 0.2 s."""
    return Supervisor(job, launcher, client=cp.admin, endpoint=cp.url, pool_token=cp.pool_tokens["pool-a"],
                      poll_s=0.02, device_check_s=0.2, on_recovery=recoveries.append)  # fmt: skip


def test_a_degraded_device_moves_its_group(cp: Harness, tmp_path: Path) -> None:
    job = job_file(tmp_path)
    launcher = LocalLauncher(log_dir=tmp_path / "logs")
    recoveries: list[Recovery] = []
    sup = checking_devices(cp, job, launcher, recoveries)
    try:
        sup.start()
        before = {a["worker"]: a["device"] for a in sup.placement["assignments"]}
        t0 = time.time()
        supervise_until(sup, lambda: snapshotted(cp, t0, 2), 90, "a snapshot from both ranks")
        bad = before["trainers-0"]
        # What the device-health judge does (tested on its own): mark it degraded.
        cp.admin.request("PUT", f"/v1/devices/{bad}", json={"id": bad, "node": "node-0", "memory_gb": 16,
                                                            "health": "degraded"})  # fmt: skip
        supervise_until(sup, lambda: recoveries, 90, "the move")
        (rec,) = recoveries
        assert rec.reason == "degraded-device"
        assert bad not in rec.devices.values() and len(set(rec.devices.values())) == 2
        # The rank on a healthy device keeps it (pinned in the new placement request): only trainers-0 changes.
        assert rec.devices["trainers-1"] == before["trainers-1"]
        assert cp.admin.placement("toy")["excluded"][bad] == "device is degraded"
        assert rec.resumed_at is not None and len(rec.restored) == 2
    finally:
        (tmp_path / "stop").touch()
        sup.stop()


@pytest.mark.slow  # ~17 s; a move on a degraded device stays in the default run
def test_a_group_with_nowhere_to_go_stays_then_moves_when_a_device_frees(cp: Harness, tmp_path: Path) -> None:
    """No spare device (another job holds the other two): the group stays on its degraded device, running, and the
    placement on record is left as it was (a failed re-placement records nothing); once the other job releases its
    devices, the next try moves the group."""
    job = job_file(tmp_path)
    launcher = LocalLauncher(log_dir=tmp_path / "logs")
    recoveries: list[Recovery] = []
    sup = Supervisor(job, launcher, client=cp.admin, endpoint=cp.url, pool_token=cp.pool_tokens["pool-a"],
                     poll_s=0.02, device_check_s=0.2, unmovable_retry_s=0.5,
                     on_recovery=recoveries.append)  # fmt: skip
    try:
        sup.start()
        placed = cp.admin.placement("toy")
        before = {a["worker"]: a["device"] for a in placed["assignments"]}
        others = [w for w in ("gpu-0", "gpu-1", "gpu-2", "gpu-3") if w not in before.values()]
        cp.admin.place({"name": "blocker", "pool": "pool-a", "groups": [{"name": "b", "workers": [
            {"name": f"b-{i}", "device": d} for i, d in enumerate(others)]}]})  # fmt: skip
        pids = launcher.pids("trainers")
        bad = before["trainers-0"]
        cp.admin.request("PUT", f"/v1/devices/{bad}", json={"id": bad, "node": "node-0", "memory_gb": 16,
                                                            "health": "degraded"})  # fmt: skip
        deadline = time.monotonic() + 3.0  # several device checks and retries
        while time.monotonic() < deadline:
            sup.step()
            time.sleep(0.02)
        assert recoveries == [] and launcher.pids("trainers") == pids  # stayed, running
        assert cp.admin.placement("toy") == placed  # the failed tries recorded nothing
        cp.admin.release_placement("blocker")
        supervise_until(sup, lambda: recoveries, 60, "the move once devices are free")
        (rec,) = recoveries
        assert rec.reason == "degraded-device" and rec.devices["trainers-0"] in others
        assert rec.devices["trainers-1"] == before["trainers-1"]
    finally:
        (tmp_path / "stop").touch()
        sup.stop()


def test_a_degraded_device_moves_only_the_actor_on_it(cp: Harness, tmp_path: Path) -> None:
    """``restart_scope: worker``: when an actor's device is degraded, that actor alone moves (stopped, started
    again from its own snapshot on a spare device); its fellow actor and the learner keep their processes, and the
    placement on record keeps their devices (the job is placed again with them pinned). A move is no failure: with
    no restart allowed, the group is not given up for it."""
    stop = tmp_path / "stop"
    job = impala_job(tmp_path, actors=2, max_restarts=0)
    launcher = LocalLauncher(log_dir=tmp_path / "logs")
    recoveries: list[Recovery] = []
    sup = checking_devices(cp, job, launcher, recoveries)
    try:
        sup.start()
        supervise_until(sup, lambda: len(cp.admin.workers(pool="pool-a")) == 3, 90, "three workers registered")
        placed = {a["worker"]: a["device"] for a in sup.placement["assignments"]}
        pids = {**launcher.pids("actors"), **launcher.pids("learners")}
        bad = placed["actors-1"]
        cp.admin.request("PUT", f"/v1/devices/{bad}", json={"id": bad, "node": "node-0", "memory_gb": 16,
                                                            "health": "degraded"})  # fmt: skip
        supervise_until(sup, lambda: recoveries, 60, "the actor's move")
        (rec,) = recoveries
        assert (rec.mode, rec.worker, rec.reason) == ("worker", "actors-1", "degraded-device")
        (spare,) = {f"gpu-{i}" for i in range(4)} - set(placed.values())
        assert rec.devices == {"actors-1": spare}
        after = {**launcher.pids("actors"), **launcher.pids("learners")}
        assert after["actors-1"] != pids["actors-1"]
        assert {k: v for k, v in after.items() if k != "actors-1"} == {k: v for k, v in pids.items() if k != "actors-1"}
        record = {a["worker"]: a["device"] for a in cp.admin.placement("impala")["assignments"]}
        assert record == {**placed, "actors-1": spare}
        assert record == {a["worker"]: a["device"] for a in sup.placement["assignments"]}
        supervise_until(sup, lambda: rec.resumed_at is not None, 60, "the moved actor's registration")

        def active_devices() -> set[str]:
            moved = [w for w in cp.admin.workers(pool="pool-a") if w["group"] == "actors" and w["rank"] == 1]
            return {w["device"] for w in moved if w["state"] == "active"}

        # The stopped actor's own registration leaves "active" when the control plane learns it stopped; on a
        # loaded machine its replacement registered first (seen once: {gpu-1, gpu-3}), so wait, bounded, for it.
        supervise_until(sup, lambda: active_devices() == {spare}, 30, f"only actors-1 on {spare} active")
        assert sup.restarts == {"learners": 0, "actors": 0}  # a move is not a failure: no restart used up
        stop.touch()
        assert sup.run(timeout_s=60), sup.failed
    finally:
        sup.stop()


def test_warm_standbys_take_over_a_restarted_group(cp: Harness, tmp_path: Path) -> None:
    job = job_file(tmp_path)
    launcher = LocalLauncher(log_dir=tmp_path / "logs", warm=True, refill_after_s=0.0)
    recoveries: list[Recovery] = []
    sup = Supervisor(job, launcher, client=cp.admin, endpoint=cp.url, pool_token=cp.pool_tokens["pool-a"],
                     poll_s=0.02, on_recovery=recoveries.append)  # fmt: skip
    try:
        sup.start()
        t0 = time.time()
        supervise_until(sup, lambda: snapshotted(cp, t0, 2) and launcher.standbys_ready("trainers") == 2, 120,
                        "snapshots and two warm standbys")  # fmt: skip
        standby_pids = {s.popen.pid for s in launcher._spares["trainers"]}
        os.kill(launcher.pids("trainers")["trainers-0"], signal.SIGKILL)
        supervise_until(sup, lambda: recoveries, 90, "the recovery")
        (rec,) = recoveries
        assert launcher.warm_starts == 2 and set(launcher.pids("trainers").values()) == standby_pids
        # The standbys started the probe when they got their job: they registered, restored and report.
        assert rec.resumed_at is not None and len(rec.restored) == 2 and all("/" in r for r in rec.restored)
        (tmp_path / "stop").touch()
        assert sup.run(timeout_s=60), sup.failed
    finally:
        (tmp_path / "stop").touch()
        sup.stop()


def test_an_actor_moves_off_a_card_that_its_learners_burst_is_about_to_fill(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    """Room for a burst (dsec.quota.room), end to end: the learner and two actors share one 2 GB card (three process
    slots on node-0; node-1 has two cards of its own); the learner's memory grows at 100 MB/s (``DSEC_CHAOS``, real
    pages: no GPU here, the probe reports the RSS). The control plane sees the card about to fill and asks for an
    actor to move (a ``room`` event); the supervisor moves that actor alone to node-1. The
    learner and the other actor keep their processes, and a move uses up no restart."""
    h = server_factory(pools=True)
    devices = {"card0-a": ("node-0", "card0"), "card0-b": ("node-0", "card0"), "card0-c": ("node-0", "card0"),
               "gpu-1": ("node-1", None), "gpu-2": ("node-1", None)}  # fmt: skip
    for dev, (node, card) in devices.items():
        h.admin.request("PUT", f"/v1/devices/{dev}", json={"id": dev, "node": node, "memory_gb": 2, "card": card})
    h.admin.put_pool("pool-a", devices=list(devices), memory_base_gb=0.5, memory_ceiling_gb=1.5)
    job = impala_job(tmp_path, actors=2, max_restarts=0)
    # A learner that beats every 0.2 s and stalls for ~1 s while it touches new pages on a loaded machine was
    # counted lost mid-burst, and is left out of the quota pass while lost: 0.5 s beats leave it 1.5 s.
    job.groups[0].env.update(
        DSEC_CHAOS="memory_growth_mb_per_s=100,max_mb=2048,after_s=6", DSEC_HEARTBEAT_INTERVAL="0.5"
    )
    launcher = LocalLauncher(log_dir=tmp_path / "logs")
    recoveries: list[Recovery] = []
    sup = checking_devices(h, job, launcher, recoveries)

    def rooms() -> list[dict[str, Any]]:
        return h.admin.all_events(types=["room"])

    try:
        sup.start()
        placed = {a["worker"]: a["device"] for a in sup.placement["assignments"]}
        assert all(devices[d][1] == "card0" for d in placed.values()), placed  # next to their learner
        supervise_until(sup, lambda: len(h.admin.workers(pool="pool-a")) == 3, 90, "three workers registered")
        pids = {**launcher.pids("actors"), **launcher.pids("learners")}
        supervise_until(sup, lambda: recoveries, 90, "the actor's move")
        (rec,) = recoveries
        (room,) = rooms()
        moved = next(w for w, d in placed.items() if d == room["data"]["device"])
        assert moved.startswith("actors-") and room["data"]["card"] == "card0"
        assert (rec.mode, rec.worker, rec.reason) == ("worker", moved, "make-room")
        assert devices[rec.devices[moved]][0] == "node-1"  # off the card (its other slots are kept free)
        after = {**launcher.pids("actors"), **launcher.pids("learners")}
        assert after[moved] != pids[moved]
        assert {k: v for k, v in after.items() if k != moved} == {k: v for k, v in pids.items() if k != moved}
        supervise_until(sup, lambda: rec.resumed_at is not None, 60, "the moved actor's registration")
        assert sup.restarts == {"learners": 0, "actors": 0}  # a move is not a failure: no restart used up
        (tmp_path / "stop").touch()
        assert sup.run(timeout_s=60), sup.failed
    finally:
        (tmp_path / "stop").touch()
        sup.stop()
