"""The supervisor's limits, on a scripted launcher and a virtual clock: a group that keeps failing is given up after
``max_restarts`` with a reason that says so, and a restart whose restores are never reported is closed after
``resume_timeout_s``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dsec.job_history import history_path, peers_of
from dsec.launch import supervisor as supervisor_module
from dsec.launch.base import Exit, WorkerLaunch
from dsec.launch.jobfile import JobFile
from dsec.launch.supervisor import Supervisor


@pytest.fixture(autouse=True)
def _own_working_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor writes the job's history file into the job's snapshot directory (``.dsec/snapshots`` by
    default, relative to the working directory): each test runs in a directory of its own."""
    monkeypatch.chdir(tmp_path)


class Clock:
    """Stands in for the supervisor module's ``time``: every reading is the virtual now; sleeping advances it."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@dataclass
class Launcher:
    """Starts nothing: ``exit_code(launch, incarnation)`` says how each started worker ends (None: still running);
    the next poll reports those exits, all in one batch, as a real launcher's poll does."""

    exit_code: Callable[[WorkerLaunch, int], int | None]
    clock: Clock
    name: str = "scripted"
    starts_single_workers: bool = True
    starts: list[list[WorkerLaunch]] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    _due: list[Exit] = field(default_factory=list)

    def start(self, workers: list[WorkerLaunch]) -> None:
        incarnation = len(self.starts)
        self.starts.append(list(workers))
        for w in workers:
            code = self.exit_code(w, incarnation)
            if code is not None:
                self._due.append(Exit(w.worker, w.group, code, self.clock.now))

    def poll(self) -> list[Exit]:
        out, self._due = self._due, []
        return out

    def stop_group(self, group: str) -> None:
        self.stopped.append(group)
        self._due = [e for e in self._due if e.group != group]

    def stop(self) -> None:
        pass


class ControlPlane:
    """The admin client the supervisor asks for restore events; none are ever reported."""

    def __init__(self) -> None:
        self.recorded: list[tuple[str, dict[str, Any]]] = []

    def all_events(self, **_: Any) -> list[dict[str, Any]]:
        return []

    def workers(self, **_: Any) -> list[dict[str, Any]]:
        return []

    def devices(self) -> list[dict[str, Any]]:
        return []

    def place(self, job: dict[str, Any], complete_only: bool = False) -> dict[str, Any]:
        workers = [w for g in job["groups"] for w in g["workers"]]
        return {"complete": True, "unplaced": [], "assignments": [
            {"worker": w["name"], "device": f"gpu{i}", "node": "n0", "cpus": []} for i, w in enumerate(workers)
        ]}  # fmt: skip

    def record_event(self, etype: str, data: dict[str, Any], pool: str | None = None) -> None:
        self.recorded.append((etype, data))


def job(world_size: int = 2, **restart: Any) -> JobFile:
    return JobFile.model_validate(
        {
            "job": "j",
            "pool": "pool-a",
            "snapshots": {"enabled": False},
            "restart": restart,
            "groups": [{"name": "g", "world_size": world_size, "command": ["train"]}],
        }
    )


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(supervisor_module, "time", c)
    return c


def test_a_group_failing_every_time_is_given_up_after_max_restarts(clock: Clock) -> None:
    # Rank 0 of every incarnation crashes; rank 1 runs on.
    launcher = Launcher(lambda w, _: 1 if w.rank == 0 else None, clock)
    sup = Supervisor(job(max_restarts=2), launcher, poll_s=0.05)
    sup.start()
    assert sup.run(timeout_s=30) is False
    assert sup.failed == {"g": "g-0 exited with 1; 2 restarts already"}
    assert sup.restarts == {"g": 2}
    assert len(launcher.starts) == 3  # the first start and two restarts, then nothing more
    assert ["DSEC_RESTORE" in w.env for start in launcher.starts for w in start] == [False] * 2 + [True] * 4
    assert launcher.stopped == ["g"] * 3  # the last failure still stops the rest of the group
    assert [(r.reason, r.code) for r in sup.recoveries] == [("exit", 1)] * 2


def test_max_restarts_zero_gives_up_on_the_first_failure(clock: Clock) -> None:
    launcher = Launcher(lambda w, _: 3 if w.rank == 1 else None, clock)
    sup = Supervisor(job(max_restarts=0), launcher)
    sup.start()
    assert sup.run(timeout_s=30) is False
    assert sup.failed == {"g": "g-1 exited with 3; 0 restarts already"}
    assert len(launcher.starts) == 1 and sup.recoveries == []


def test_ranks_crashing_together_cost_one_restart(clock: Clock) -> None:
    # Both ranks of the first incarnation die in the same poll (a group crashes as a whole, e.g. a collective
    # error); the restarted group finishes. One failure, one restart: the second exit is the same incarnation's.
    launcher = Launcher(lambda w, n: 1 if n == 0 else 0, clock)
    sup = Supervisor(job(max_restarts=1), launcher)
    sup.start()
    assert sup.run(timeout_s=30) is True
    assert sup.failed == {} and sup.restarts == {"g": 1}
    assert len(launcher.starts) == 2


def test_restores_never_reported_close_the_recovery_after_resume_timeout(clock: Clock) -> None:
    cp = ControlPlane()
    launcher = Launcher(lambda w, n: 1 if (n, w.rank) == (0, 0) else None, clock)
    sup = Supervisor(job(max_restarts=3, resume_timeout_s=30), launcher, client=cp, device_check_s=1e9)
    sup.start()
    sup.step()  # rank 0 exits: the group restarts and waits for its ranks' restore events
    assert len(launcher.starts) == 2 and sup.recoveries == []
    clock.now += 29.0
    sup.step()
    assert sup.recoveries == [] and not sup.finished()  # still waiting
    clock.now += 2.0
    sup.step()
    [rec] = sup.recoveries
    timings = rec.timings()
    assert rec.resumed_at is None and "total_s" not in timings  # closed unresumed, not timed as a recovery
    assert cp.recorded == [("recovery", {"job": "j", **timings})]
    assert sup.failed == {} and sup.restarts == {"g": 1}


def actor_job(**restart: Any) -> JobFile:
    return JobFile.model_validate(
        {
            "job": "j",
            "pool": "pool-a",
            "snapshots": {"enabled": False},
            "restart": restart,
            "groups": [{"name": "a", "role": "actor", "world_size": 3, "command": ["act"]}],
        }
    )


def test_an_actor_that_keeps_failing_restarts_alone_until_max_restarts(clock: Clock) -> None:
    # restart_scope defaults to worker for actors: actor 1 crashes in every incarnation, the others run on.
    launcher = Launcher(lambda w, _: 1 if w.rank == 1 else None, clock)
    sup = Supervisor(actor_job(max_restarts=2), launcher)
    sup.start()
    assert sup.run(timeout_s=30) is False
    assert sup.failed == {"a": "a-1 exited with 1; 2 restarts already"}
    assert [[w.worker for w in s] for s in launcher.starts] == [["a-0", "a-1", "a-2"], ["a-1"], ["a-1"]]
    assert all("DSEC_RESTORE" in w.env for s in launcher.starts[1:] for w in s)  # its own newest snapshot
    assert launcher.stopped == []  # nobody else was stopped
    assert [(r.mode, r.worker) for r in sup.recoveries] == [("worker", "a-1")] * 2


def test_a_restarted_worker_that_never_registers_is_closed_after_resume_timeout(clock: Clock) -> None:
    cp = ControlPlane()
    launcher = Launcher(lambda w, n: 1 if (n, w.rank) == (0, 2) else None, clock)
    sup = Supervisor(actor_job(resume_timeout_s=30), launcher, client=cp, device_check_s=1e9)
    sup.start()
    sup.step()
    assert [[w.worker for w in s] for s in launcher.starts][1:] == [["a-2"]] and not sup.finished()
    clock.now += 31.0
    sup.step()
    [rec] = sup.recoveries
    assert rec.resumed_at is None and cp.recorded == [("recovery", {"job": "j", **rec.timings()})]
    assert rec.timings()["mode"] == "worker"


def test_heal_and_worker_scope_cannot_be_combined() -> None:
    with pytest.raises(ValueError, match=r"restart_scope: 'worker'.*heal: true"):
        JobFile.model_validate(
            {"job": "j", "pool": "p", "groups": [
                {"name": "g", "heal": True, "restart_scope": "worker", "command": ["x"]}
            ]}
        )  # fmt: skip


def test_a_launcher_that_starts_groups_whole_restarts_the_actor_group(clock: Clock) -> None:
    launcher = Launcher(lambda w, n: 1 if (n, w.rank) == (0, 1) else None, clock, starts_single_workers=False)
    sup = Supervisor(actor_job(max_restarts=1), launcher)
    sup.start()
    sup.step()
    assert launcher.stopped == ["a"] and [len(s) for s in launcher.starts] == [3, 3]
    assert [r.mode for r in sup.recoveries] == ["restart"]


def test_a_worker_that_dies_again_before_it_registered_closes_its_last_restart(clock: Clock) -> None:
    cp = ControlPlane()
    launcher = Launcher(lambda w, n: 1 if w.rank == 0 and n < 2 else None, clock)
    sup = Supervisor(actor_job(max_restarts=3), launcher, client=cp, device_check_s=1e9)
    sup.start()
    sup.step()  # the first incarnation of a-0 dies: restarted alone, waiting for its registration
    assert sup.recoveries == []
    sup.step()  # the restarted a-0 dies before it registered: that restart is recorded unresumed, a new one waits
    assert [(r.mode, r.resumed_at) for r in sup.recoveries] == [("worker", None)]
    assert [[w.worker for w in s] for s in launcher.starts][1:] == [["a-0"], ["a-0"]]
    assert sup.restarts == {"a": 2} and not sup.finished()


def test_the_failure_history_reaches_the_restarted_ranks_with_cadence_failure_history(clock: Clock) -> None:
    """``snapshots.cadence: failure_history``: each start carries the group's seconds trained and the restarts that
    rolled it back; a restarted actor rolls nothing back; ``fixed`` (the default) passes nothing."""
    spec = {
        "job": "j",
        "pool": "pool-a",
        "snapshots": {"interval_s": 90, "cadence": "failure_history"},
        "groups": [
            {"name": "g", "world_size": 2, "command": ["train"]},
            {"name": "a", "role": "actor", "world_size": 2, "command": ["act"]},
        ],
    }

    def exits(w: WorkerLaunch, n: int) -> int | None:
        # The learners' rank 1 and actor 0 die in their first incarnation: one rollback (the learners').
        first = "DSEC_RESTORE" not in w.env
        return 1 if first and (w.group, w.rank) in (("g", 1), ("a", 0)) else None

    launcher = Launcher(exits, clock)
    sup = Supervisor(JobFile.model_validate(spec), launcher)
    sup.start()
    first = {w.worker: w.env for start in launcher.starts for w in start}
    assert first["g-0"]["DSEC_SNAPSHOT_CADENCE"] == "failure_history"
    assert first["g-0"]["DSEC_SNAPSHOT_HISTORY"] == "0.0:0"
    clock.now += 600.0
    sup.step()
    restarted = {w.worker: w.env for start in launcher.starts[2:] for w in start}  # after the two groups' starts
    assert restarted["g-0"]["DSEC_SNAPSHOT_HISTORY"] == restarted["g-1"]["DSEC_SNAPSHOT_HISTORY"] == "600.0:1"
    assert restarted["a-0"]["DSEC_SNAPSHOT_HISTORY"] == "600.0:0"  # alone: nothing rolled back
    assert sup.rollbacks == {"g": 1, "a": 0} and sup.history("g") == (600.0, 1)
    clock.now += 60.0
    assert sup.history("g") == (660.0, 1)  # the current incarnation's time counts too
    fixed = JobFile.model_validate({**spec, "snapshots": {"interval_s": 90, "cadence": "fixed"}})
    plain = Launcher(lambda w, n: None, clock)
    Supervisor(fixed, plain).start()
    assert not any(k.startswith("DSEC_SNAPSHOT_CADENCE") or k.startswith("DSEC_SNAPSHOT_HISTORY")
                   or k == "DSEC_SNAPSHOT_JOB_HISTORY" for w in plain.starts[0] for k in w.env)  # fmt: skip
    # Since 2026-12-04 the adaptive cadence is the default of a job file.
    assert JobFile.model_validate({**spec, "snapshots": {"interval_s": 90}}).snapshots.cadence == "failure_history"


def test_the_job_history_file_follows_every_start_and_rollback_of_the_learner_groups(clock: Clock) -> None:
    """The learners' cadence takes the job's other groups' history as its prior (dsec.job_history): the supervisor
    rewrites the file at the start and at every group restart; actor groups (no snapshot, nothing rolled back) are
    not in it; each learner is told where it is and which group it is."""
    spec = {
        "job": "j",
        "pool": "pool-a",
        "snapshots": {"dir": "snaps", "interval_s": 90},
        "groups": [
            {"name": "g", "world_size": 1, "command": ["train"]},
            {"name": "h", "world_size": 1, "command": ["train"]},
            {"name": "a", "role": "actor", "world_size": 1, "command": ["act"]},
        ],
    }

    def exits(w: WorkerLaunch, n: int) -> int | None:
        return 1 if "DSEC_RESTORE" not in w.env and w.group == "g" else None  # g's first incarnation dies

    launcher = Launcher(exits, clock)
    sup = Supervisor(JobFile.model_validate(spec), launcher)
    sup.start()
    path = history_path(Path("snaps"), "j")
    env = {w.worker: w.env for start in launcher.starts for w in start}
    assert env["h-0"]["DSEC_SNAPSHOT_JOB_HISTORY"] == str(path) and env["h-0"]["DSEC_GROUP"] == "h"
    doc = json.loads(path.read_text())
    assert doc["written_at"] == clock.now and set(doc["groups"]) == {"g", "h"}
    assert doc["groups"]["g"] == {"exposure_s": 0.0, "rollbacks": 0, "running": True}
    clock.now += 600.0
    sup.step()  # g restarts from its snapshots: one rollback
    doc = json.loads(path.read_text())
    assert doc["written_at"] == clock.now
    assert doc["groups"] == {"g": {"exposure_s": 600.0, "rollbacks": 1, "running": True},
                             "h": {"exposure_s": 600.0, "rollbacks": 0, "running": True}}  # fmt: skip
    # What h's learner reads 60 s later: g's history, still training.
    assert peers_of(path, "h", clock.now + 60.0) == (660.0, 1)


def test_an_unknown_snapshot_cadence_names_file_line_and_field(tmp_path: Any) -> None:
    from dsec.launch.jobfile import load_job
    from dsec.yamlconf import ConfigError

    path = tmp_path / "job.yaml"
    path.write_text(
        "job: j\npool: pool-a\nsnapshots:\n  interval_s: 90\n  cadence: sometimes\n"
        "groups:\n  - {name: g, world_size: 1, command: [train]}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert f"{path}:5:" in str(err.value) and "snapshots.cadence" in str(err.value)


def _snapshot(root: Path, worker: str, requests: tuple[str, ...]) -> None:
    """One real snapshot of a tiny model under ``root``, taken for ``requests`` (none: the periodic one)."""
    import torch

    from dsec.snapshot import LocalDirStore, Snapshotter

    snap = Snapshotter(LocalDirStore(root), worker)
    try:
        snap.register("model0", torch.nn.Linear(4, 2))
        ticket = snap.take(step=10, requests=requests, wait=True)
        assert ticket.error is None
    finally:
        snap.close()


@pytest.mark.parametrize(
    ("newest", "age_s", "rollbacks"),
    [
        (("memory_burst",), 2.0, 0),  # the burst it failed in was snapshotted ahead: foreseen
        (("memory_recycle",), 2.0, 0),  # a drain: the process stopped right after its snapshot
        ((), 2.0, 1),  # the newest is a periodic snapshot: a failure nobody saw coming
        (("memory_burst",), 300.0, 1),  # a burst long over: this failure is another one
    ],
)
def test_a_failure_in_a_burst_snapshotted_ahead_is_not_counted_as_a_rollback(
    clock: Clock, newest: tuple[str, ...], age_s: float, rollbacks: int
) -> None:
    """The cadence's rollbacks are the failures nobody foresaw (launch/foreseen.py): a group that fails in a memory
    burst its probe snapshotted ahead of restarts from that snapshot and loses next to nothing, so its learners are
    not told to snapshot more often; the restart itself happens all the same."""
    spec = {
        "job": "j",
        "pool": "pool-a",
        "snapshots": {"dir": "snaps", "interval_s": 90},
        "groups": [{"name": "g", "world_size": 2, "command": ["train"]}],
    }
    _snapshot(Path("snaps"), "g-learner-0", ())
    _snapshot(Path("snaps"), "g-learner-0", newest)
    _snapshot(Path("snaps"), "g-learner-1", ())  # the other rank's newest is periodic: one rank's burst suffices
    _snapshot(Path("snaps"), "gx-learner-0", ("memory_burst",))  # another group's burst says nothing about g
    clock.now = time.time() + age_s  # the failure, age_s after the snapshots

    def exits(w: WorkerLaunch, n: int) -> int | None:
        return 1 if "DSEC_RESTORE" not in w.env and w.rank == 0 else None

    launcher = Launcher(exits, clock)
    sup = Supervisor(JobFile.model_validate(spec), launcher)
    sup.start()
    sup.step()
    assert launcher.stopped == ["g"] and sup.restarts == {"g": 1}  # restarted from its snapshots either way
    assert sup.rollbacks == {"g": rollbacks}
    restarted = {w.worker: w.env for w in launcher.starts[-1]}
    assert restarted["g-0"]["DSEC_SNAPSHOT_HISTORY"].endswith(f":{rollbacks}")


def test_foreseen_reads_the_groups_own_snapshots_only(clock: Clock) -> None:
    from dsec.launch.foreseen import foreseen_failure

    _snapshot(Path("snaps"), "gx-learner-0", ("memory_burst",))
    assert foreseen_failure(Path("snaps"), "gx", time.time())
    assert not foreseen_failure(Path("snaps"), "g", time.time())
    assert not foreseen_failure(Path("absent"), "gx", time.time())


def test_a_learner_restarted_alone_is_a_rollback_of_its_group_unless_its_own_burst_snapshot_foresaw_it(
    clock: Clock,
) -> None:
    """``restart_scope: worker`` on learners: the process resumes from its own newest snapshot, a rollback its group's
    cadence counts (it was never counted before 2026-12-06), unless that process's own newest snapshot was taken
    ahead of the stop; a peer's burst snapshot says nothing about it. Actors keep no snapshot: nothing rolls back."""
    spec = {
        "job": "j",
        "pool": "pool-a",
        "snapshots": {"dir": "snaps", "interval_s": 90},
        "groups": [
            {"name": "g", "world_size": 2, "restart_scope": "worker", "command": ["train"]},
            {"name": "a", "role": "actor", "world_size": 1, "command": ["act"]},
        ],
    }
    _snapshot(Path("snaps"), "g-learner-0", ())
    _snapshot(Path("snaps"), "g-learner-1", ("memory_burst",))  # rank 1's burst, not rank 0's
    clock.now = time.time() + 2.0

    def exits(w: WorkerLaunch, n: int) -> int | None:
        return 1 if "DSEC_RESTORE" not in w.env and w.rank == 0 else None  # g-0 and a-0 die once

    launcher = Launcher(exits, clock)
    sup = Supervisor(JobFile.model_validate(spec), launcher)
    sup.start()
    sup.step()
    assert sup.restarts == {"g": 1, "a": 1} and launcher.stopped == []  # each alone, peers untouched
    assert sup.rollbacks == {"g": 1, "a": 0}
    restarted = {w.worker: w.env for w in launcher.starts[-2] + launcher.starts[-1]}
    assert restarted["g-0"]["DSEC_SNAPSHOT_HISTORY"].endswith(":1")
    # The same stop of rank 1, whose own newest snapshot was its burst's: foreseen, not counted.
    assert sup._foreseen("g", clock.now, rank=1) and not sup._foreseen("g", clock.now, rank=0)
