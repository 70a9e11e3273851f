"""Framework coverage (issue 18 item 3): RLlib PPO (new API stack, CartPole-v1, ``num_learners=2``, two env runners,
CPU) under `dsec run` with no --role, against a real control plane. Ray starts its actors from its own raylet, not
from the script: the probe reaches them through the inherited PYTHONPATH. The learner actors are inferred learners
and their DDP syncs judged, the env runners inferred actors, a 4-bit directive to a learner is acked (or answered
``directive_unappliable`` with a reason), and at the script's normal end (``algo.stop()``, ``ray.shutdown()``) no
worker is ``lost``: each is deregistered with the reason it ended for.

Slow (Ray start, four actors importing torch and RLlib on two cores: ~1.5-3 min), so in `make test-slow`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, stop_process_group, wait_for

if importlib.util.find_spec("ray") is None or importlib.util.find_spec("tree") is None:
    pytest.skip("ray[rllib] is not installed (the rllib extra)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "rllib_ppo.py"
DSEC = Path(sys.executable).with_name("dsec")
BEAT_S = 1.0  # 3 s of silence makes a worker lost: a 2-core machine running Ray, four actors and more stalls for 1.5 s
# Loopback only, no auth token under ~/.ray, no usage report (shared/NOTES-machine.md).
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
}


def _workers(server: Harness) -> list[dict[str, Any]]:
    return server.admin.workers(pool="pool-a")


def _by_role(server: Harness, role: str) -> list[dict[str, Any]]:
    return [w for w in _workers(server) if w["role"] == role]


def _running(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        pytest.fail(f"the job ended early (exit status {proc.returncode})")


def _learners_syncing(server: Harness, proc: subprocess.Popen[bytes]) -> list[dict[str, Any]] | None:
    _running(proc)
    learners = _by_role(server, "learner")
    if len(learners) == 2 and all(w["metrics"].get("sync_ops_total", 0) > 0 for w in learners):
        return learners
    return None


def _answered(server: Harness, worker_id: str, version: int) -> dict[str, Any] | None:
    """The 4-bit directive acked, or answered unappliable with a reason."""
    if server.admin.directive(worker_id)["acked_version"] >= version:
        return {"acked": True}
    for ev in server.admin.all_events(worker_id=worker_id, types=["directive_unappliable"]):
        if ev["data"].get("version") == version and ev["data"].get("field") == "compression_bits":
            return {"acked": False, **ev["data"]}
    return None


def _diagnose(server: Harness, log: Path) -> str:
    rows = [
        f"{w['id']} role={w['role']} state={w['state']} rank={w['rank']} "
        f"syncs={w['metrics'].get('sync_ops_total')} env_steps={w['metrics'].get('env_steps_total')}"
        for w in _workers(server)
    ]
    kinds = ["registered", "role_inferred", "deregistered", "lost", "directive_unappliable"]
    events = [
        (round(e["ts"] - time.time(), 2), e["type"], e.get("worker_id"), e["data"])
        for e in server.admin.all_events(types=kinds)
    ]
    return "\n".join([*rows, *map(str, events), log.read_text()[-4000:] if log.exists() else "(no log)"])


def _all_seen(server: Harness, seen: dict[str, set[str]], ids: list[str], metric: str) -> bool:
    """Adds, per worker, the metric names its latest beat reported (a beat carries percentiles only when it synced);
    True once every worker in ``ids`` has reported ``metric``."""
    for w in _workers(server):
        seen.setdefault(w["id"], set()).update(w["metrics"])
    return all(metric in seen.get(i, ()) for i in ids)


def test_rllib_ppo_learners_and_env_runners_inferred_judged_compressed_and_deregistered(
    server: Harness, tmp_path: Path
) -> None:
    stop, out, log = tmp_path / "stop", tmp_path / "out.json", tmp_path / "job.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update({"DSEC_HEARTBEAT_INTERVAL": str(BEAT_S), **RAY_ENV})
    cmd = [
        str(DSEC), "run", "--endpoint", server.url, "--sandbox-id", "pool-a", "--token", server.pool_tokens["pool-a"],
        "--", sys.executable, str(FIXTURE), "--stop-file", str(stop), "--out", str(out),
    ]  # fmt: skip
    seen: dict[str, set[str]] = {}
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            learners = wait_for(
                lambda: _learners_syncing(server, proc), timeout=300, interval=0.5, what="two learners reporting syncs"
            )
            wait_for(lambda: len(_by_role(server, "actor")) == 2, timeout=120, interval=0.5, what="two actors")
            target = learners[0]
            d = server.admin.set_directive(target["id"], compression_bits=4)
            answer = wait_for(
                lambda: _answered(server, target["id"], d["desired_version"]),
                timeout=120,
                interval=0.5,
                what="the 4-bit directive acked or answered unappliable",
            )
            if answer["acked"]:
                wait_for(
                    lambda: server.admin.worker(target["id"])["metrics"].get("compression_bits") == 4,
                    timeout=120,
                    interval=0.5,
                    what="the learner reporting 4-bit syncs",
                )
            wait_for(
                lambda: _all_seen(server, seen, [w["id"] for w in learners], "sync_lag_ms_p50"),
                timeout=60,
                interval=0.2,
                what="both learners reporting the sync header's straggler measures",
            )
        except BaseException:
            print(_diagnose(server, log))
            raise
        stop.touch()
        print(f"stop at {time.time()}")
        assert proc.wait(timeout=180) == 0, _diagnose(server, log)
    finally:
        stop.touch()
        stop_process_group(proc)
    time.sleep(4 * BEAT_S)  # past the detection time (3 beats): a worker killed without deregistering is lost by now
    print(f"4-bit directive: {answer}")
    print(_diagnose(server, log))
    assert json.loads(out.read_text())["iterations"] >= 2

    workers = _workers(server)
    assert sorted(w["role"] for w in workers) == ["actor", "actor", "learner", "learner"]  # the driver never registers
    for w in workers:
        [inferred] = server.admin.all_events(worker_id=w["id"], types=["role_inferred"])
        rule = inferred["data"]["evidence"]["rule"]
        [dereg] = server.admin.all_events(worker_id=w["id"], types=["deregistered"])
        reason = dereg["data"]["reason"]
        assert w["state"] == "deregistered", w
        if w["role"] == "learner":
            # DDP over gloo inside the Ray actor: the probe's comm hook measured and judged every sync.
            assert rule == "synchronized optimizer step"
            assert w["metrics"].get("sync_errors_total", 0) == 0
            assert {"sync_latency_ms_p99", "bytes_per_sync"} <= seen[w["id"]]
            # Ray Train's graceful termination (atexit runs), or its kill after the first learner is gone.
            assert reason in ("exit", "ray_kill"), reason
        else:
            assert rule == "1000 env steps without an optimizer step"
            assert reason == "ray_kill"  # EnvRunnerGroup.stop: ray.kill of each env runner
    if not answer["acked"]:
        assert answer.get("reason"), answer
    assert server.admin.all_events(types=["lost"]) == []
