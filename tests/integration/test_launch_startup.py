"""`dsec launch` start-up progress: ranks registered with a real control plane, out of the job's world sizes.

The supervisor is a stand-in whose ``step()`` registers one more rank (as a started worker's probe would), so the
count is read back through the real API: workers of an earlier run and ranks of other groups do not count."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from conftest import Harness
from dsec.cli import app
from dsec.launch.startup import known_workers, registered_ranks, wait_for_ranks


@dataclass
class Group:
    name: str
    world_size: int


@dataclass
class Job:
    pool: str
    groups: list[Group]


@dataclass
class FakeSupervisor:
    """Registers the next rank of ``plan`` at each step; finished once told so."""

    h: Harness
    job: Job
    plan: list[tuple[str, int]]
    poll_s: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    done: bool = False

    def step(self) -> None:
        if self.steps < len(self.plan):
            group, rank = self.plan[self.steps]
            self.h.register(self.job.pool, group=group, rank=rank)
        self.steps += 1

    def finished(self) -> bool:
        return self.done


JOB = Job("pool-a", [Group("learners", 2), Group("actors", 3)])


def test_start_up_counts_new_ranks_of_the_job_up_to_its_world_size(server: Harness) -> None:
    server.register("pool-a", group="learners", rank=0)  # an earlier run's worker: not this start-up's
    before = known_workers(server.admin, "pool-a")
    plan = [("learners", 0), ("other", 0), ("actors", 2), ("actors", 2), ("learners", 1), ("actors", 0)]
    plan += [("actors", 9), ("actors", 1)]  # rank 9 is outside the group's world size
    sup = FakeSupervisor(server, JOB, plan)
    calls: list[tuple[int, int]] = []
    assert wait_for_ranks(sup, server.admin, before, lambda d, t: calls.append((d, t)))
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and dones[0] == 0 and calls[-1] == (5, 5)
    assert {t for _, t in calls} == {5}
    assert registered_ranks(server.admin, JOB, before) == 5
    assert registered_ranks(server.admin, JOB, set()) == 5  # the earlier run's learner 0 is the same rank


def test_start_up_stops_waiting_when_the_job_finishes_or_the_deadline_passes(server: Harness) -> None:
    sup = FakeSupervisor(server, JOB, [("learners", 0)], done=False)
    calls: list[Any] = []
    assert not wait_for_ranks(sup, server.admin, set(), lambda d, t: calls.append((d, t)), deadline=0.0)
    sup.done = True
    assert not wait_for_ranks(sup, server.admin, set(), lambda d, t: calls.append((d, t)))
    assert calls[-1][1] == 5 and calls[-1][0] <= 1


# A rank that registers with the control plane as a probe would, then leaves.
RANK = """
import os
from dsec.client import Client
with Client(os.environ["DSEC_ENDPOINT"]) as c:
    a = c.register(os.environ["DSEC_SANDBOX_ID"], group=os.environ["DSEC_GROUP"], rank=int(os.environ["RANK"]),
                   token=os.environ["DSEC_TOKEN"])
    c.deregister(a["worker_id"], token=a["worker_token"])
"""


def test_dsec_launch_draws_ranks_registered_on_stderr_only(server: Harness, tmp_path: Path) -> None:
    for i in range(2):
        server.admin.request("PUT", f"/v1/devices/gpu-{i}", json={"id": f"gpu-{i}", "node": "node-0", "memory_gb": 16})
    server.admin.put_pool("pool-a", devices=["gpu-0", "gpu-1"])
    job = tmp_path / "job.yaml"
    group = {"name": "learners", "world_size": 2, "memory_gb": 1, "command": [sys.executable, "-c", RANK]}
    job.write_text(json.dumps({"job": "toy", "pool": "pool-a", "snapshots": {"enabled": False}, "groups": [group]}))
    args = ["launch", str(job), "--endpoint", server.url, "--admin-token", server.admin_token]
    args += ["--token", server.pool_tokens["pool-a"], "--log-dir", str(tmp_path / "logs"), "--timeout", "60"]
    r = CliRunner().invoke(app, [*args, "--progress"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    assert "toy: ranks registered" in r.stderr and "2/2 ranks" in r.stderr and "100%" in r.stderr
    assert r.stdout.startswith("started toy: learners-0@gpu-") and "job toy finished (0 restart(s))" in r.stdout
    assert "ranks registered" not in r.stdout
    quiet = CliRunner().invoke(app, [*args, "--no-progress"], env={"COLUMNS": "120"})
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == "" and quiet.stdout.splitlines()[1:] == r.stdout.splitlines()[1:]
