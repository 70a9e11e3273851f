"""Whole jobs through the ``ray`` launcher, as a user runs them (issue: the Ray path end to end).

- The shipped ``examples/jobs/ppo-ray.yaml`` under ``dsec launch`` with no Ray cluster anywhere: the launcher starts a
  local Ray for the job (CPU-only bundles: this machine has no GPU), the PPO ranks train under the probe (they
  register, snapshot, deregister at their normal end) and Ray is stopped with the job.
- A two-node ``ray.cluster_utils.Cluster`` (nodes labelled ``dsec/node``, a fake GPU each): the supervisor places a
  two-rank DDP job across both nodes, one rank's command is SIGKILLed, and the group restarts from one agreed
  snapshot step and trains on.

Both start Ray (10-20 s on two cores) and train real ranks: slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from conftest import Harness, stop_process_group, wait_for

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from ray.cluster_utils import Cluster  # noqa: E402

from dsec.launch.jobfile import JobFile  # noqa: E402
from dsec.launch.ray_backend import RayLauncher  # noqa: E402
from dsec.launch.supervisor import Recovery, Supervisor  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = ROOT / "tests" / "fixtures" / "ddp_rank.py"
MB = 1024 * 1024
# Loopback only and no auth token under ~/.ray (shared/NOTES-machine.md); the launcher's own Ray inherits them.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def _devices(h: Harness, pool: str, nodes: dict[str, str]) -> None:
    """Devices ``{device: node}`` in ``pool`` on the control plane's inventory."""
    for dev, node in nodes.items():
        h.admin.request("PUT", f"/v1/devices/{dev}", json={"id": dev, "node": node, "memory_gb": 16})
    h.admin.put_pool(pool, devices=list(nodes))
    h.pool_tokens[pool] = h.admin.create_token(pool, label=f"test {pool}")


def _ray_processes() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in ("raylet", "gcs_server")}


def test_the_shipped_ppo_ray_job_runs_on_a_local_ray_started_for_it(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = server_factory()
    _devices(h, "pool-0", {"gpu-00": "node-0", "gpu-01": "node-0"})
    spec = yaml.safe_load((ROOT / "examples" / "jobs" / "ppo-ray.yaml").read_text())
    assert spec["launcher"] == "ray" and "address" not in spec.get("ray", {})
    (group,) = spec["groups"]
    command = group["command"]
    command[command.index("--max-seconds") + 1] = "12"  # the shipped job trains 60 s
    spec["snapshots"]["dir"] = str(tmp_path / "snaps")
    job = tmp_path / "ppo-ray.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENV, PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", COLUMNS="200")
    ray_before = _ray_processes()
    args = [sys.executable, "-m", "dsec.cli", "launch", str(job), "--endpoint", h.url, "--admin-token", h.admin_token]
    args += ["--token", h.pool_tokens["pool-0"], "--timeout", "240", "--no-progress"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        stop_process_group(proc)
    assert proc.returncode == 0, out
    assert "Started a local Ray instance" in out and "job ppo-ray finished (0 restart(s))" in out, out
    workers = h.admin.workers(pool="pool-0")
    assert len(workers) == 2, workers
    # both ranks trained under the probe (gradient syncs measured), and ended normally: not lost
    assert all(w["metrics"].get("updates_total", 0) > 0 for w in workers), [w["metrics"] for w in workers]
    assert {w["state"] for w in workers} == {"deregistered"}, [(w["id"], w["state"]) for w in workers]
    assert {w["device"] for w in workers} == {"gpu-00", "gpu-01"}
    snaps = [e for e in h.admin.all_events(types=["snapshot"]) if e["data"].get("status") == "ok"]
    assert {e["worker_id"] for e in snaps} == {w["id"] for w in workers}
    # the local Ray the launcher started is gone with the job
    wait_for(lambda: not (_ray_processes() - ray_before), timeout=30, what="the job's Ray processes to exit")


# -- two nodes ---------------------------------------------------------------------------------------------------
NODE_ARGS: dict[str, Any] = {"num_cpus": 2, "num_gpus": 1, "object_store_memory": 80 * MB}


@pytest.fixture
def two_nodes() -> Iterator[Cluster]:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in RAY_ENV.items():
            mp.setenv(k, v)
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        c = Cluster(
            initialize_head=True,
            head_node_args={"labels": {"dsec/node": "node-0"}, "include_dashboard": False, **NODE_ARGS},
        )
        try:
            c.add_node(labels={"dsec/node": "node-1"}, **NODE_ARGS)
            c.wait_for_nodes()
            ray.init(address=c.address, namespace="dsec-job-test", log_to_driver=False)
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


def _supervise_until(sup: Supervisor, cond: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        sup.step()
        time.sleep(0.05)


def _snapshotted(h: Harness, since: float, n: int) -> bool:
    evs = [e for e in h.admin.all_events(types=["snapshot"], since=since) if e["data"].get("status") == "ok"]
    return len({e["worker_id"] for e in evs}) >= n


@pytest.mark.shared_processes  # Ray's worker pool lives in the fixture's cluster, which stops it
def test_a_job_across_two_ray_nodes_recovers_a_killed_rank(
    two_nodes: Cluster, server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = server_factory()
    _devices(h, "pool-a", {"gpu-0": "node-0", "gpu-1": "node-1"})
    job = JobFile.model_validate(
        {
            "job": "toy-ray",
            "pool": "pool-a",
            "launcher": "ray",
            "snapshots": {"dir": str(tmp_path / "snaps"), "interval_s": 1},
            "restart": {"max_restarts": 2, "resume_timeout_s": 90},
            "groups": [
                {
                    "name": "trainers",
                    "world_size": 2,
                    "memory_gb": 1,
                    "env": {"DSEC_HEARTBEAT_INTERVAL": "0.2", "OMP_NUM_THREADS": "1"},
                    "command": [sys.executable, str(RANK_SCRIPT), "--stop-file", str(tmp_path / "stop")],
                }
            ],
        }
    )
    launcher = RayLauncher(pg_timeout_s=60.0)
    recoveries: list[Recovery] = []
    sup = Supervisor(job, launcher, client=h.admin, endpoint=h.url, pool_token=h.pool_tokens["pool-a"],
                     poll_s=0.05, on_recovery=recoveries.append)  # fmt: skip
    try:
        sup.start()
        placed = {a["worker"]: a["node"] for a in sup.placement["assignments"]}
        assert placed == {"trainers-0": "node-0", "trainers-1": "node-1"}, placed
        assert launcher.where() == placed, "each rank runs on the Ray node its placement named"
        assert all(d["probe"] == "" for d in launcher.details().values()), launcher.details()
        t0 = time.time()
        _supervise_until(sup, lambda: _snapshotted(h, t0, 2), 120, "a snapshot from both ranks")
        victim = launcher.details()["trainers-1"]["pid"]
        os.kill(victim, signal.SIGKILL)
        _supervise_until(sup, lambda: recoveries, 120, "the recovery")
        (rec,) = recoveries
        assert rec.worker == "trainers-1" and rec.code == -signal.SIGKILL, rec
        assert len(rec.restored) == 2, rec.restored

        def trained_after_restart() -> bool:
            new = [w for w in h.admin.workers(pool="pool-a") if w["registered_at"] > rec.spawned_at]
            return len(new) == 2 and all(w["metrics"].get("updates_total", 0) > 0 for w in new)

        _supervise_until(sup, trained_after_restart, 120, "training to resume after the restart")
        restores = [e["data"] for e in h.admin.all_events(types=["restore"]) if e["data"]["status"] == "ok"]
        assert len(restores) == 2 and len({d["agreed_step"] for d in restores}) == 1, restores
        assert launcher.where() == placed, "the restarted ranks are back on their nodes"
        (tmp_path / "stop").touch()
        assert sup.run(timeout_s=90), sup.failed
        assert sup.restarts == {"trainers": 1}
    finally:
        sup.stop()
        launcher.stop()
    assert ray.is_initialized(), "the launcher shut down a Ray it did not start"
