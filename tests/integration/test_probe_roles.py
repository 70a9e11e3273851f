"""Role inference on real processes under `dsec run` without --role, against a real control plane: an actor-like
script (CartPole env steps, no optimizer) is recorded as an actor while it runs, the PPO example's DDP ranks as
learners — each with a ``role_inferred`` event — and an explicit role is kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, stop_process_group, wait_for
from dsec.control.server import free_port

pytest.importorskip("gymnasium")

DSEC = Path(sys.executable).with_name("dsec")
REPO = Path(__file__).resolve().parents[2]

ACTOR = """
import sys, time
from pathlib import Path
import gymnasium as gym
stop = Path(sys.argv[1])
env = gym.make("CartPole-v1"); env.reset(seed=0)
while not stop.exists():
    _, _, t, tr, _ = env.step(env.action_space.sample())
    time.sleep(0.0005)
    if t or tr:
        env.reset()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update({"DSEC_HEARTBEAT_INTERVAL": "0.3", "GLOO_SOCKET_IFNAME": "lo", **extra})
    return env


def _dsec_run(server: Harness, pool: str, *role: str) -> list[str]:
    token = server.pool_tokens[pool]
    return [str(DSEC), "run", "--endpoint", server.url, "--sandbox-id", pool, "--token", token, *role]


def _inferred(server: Harness, worker_id: str) -> list[dict[str, Any]]:
    return server.admin.all_events(worker_id=worker_id, types=["role_inferred"])


@pytest.mark.parametrize("role", [(), ("--role", "other")])
def test_an_env_stepping_script_is_inferred_an_actor_while_it_runs(
    server: Harness, tmp_path: Path, role: tuple[str, ...]
) -> None:
    script, stop, log = tmp_path / "actor.py", tmp_path / "stop", tmp_path / "actor.log"
    script.write_text(ACTOR)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*_dsec_run(server, "pool-a", *role), "--", sys.executable, str(script), str(stop)],
            env=_env(),
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        [w] = wait_for(lambda: server.admin.workers(pool="pool-a"), timeout=60, what="registration")
        if role:  # an explicit role is kept, whatever the process does
            wait_for(
                lambda: server.admin.worker(w["id"])["metrics"].get("env_steps_total", 0) > 3000,
                timeout=60,
                what="3000 env steps",
            )
            assert server.admin.worker(w["id"])["role"] == "other"
        else:
            wait_for(lambda: server.admin.worker(w["id"])["role"] == "actor", timeout=60, what="the actor role")
            assert server.admin.worker(w["id"])["state"] == "active"
        stop.touch()
        assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]
    finally:
        stop_process_group(proc, timeout=0)
    [registered] = server.admin.all_events(worker_id=w["id"], types=["registered"])
    assert registered["data"]["role"] == "other"
    events = _inferred(server, w["id"])
    if role:
        assert events == []
        return
    [ev] = events
    assert (ev["data"]["from"], ev["data"]["to"]) == ("other", "actor")
    evidence = ev["data"]["evidence"]
    assert evidence["env_steps"] >= 1000 and evidence["optimizer_steps"] == 0
    assert evidence["rule"] == "1000 env steps without an optimizer step"
    done = server.admin.worker(w["id"])
    assert done["role"] == "actor" and done["state"] == "deregistered"


def test_the_ppo_examples_ddp_ranks_are_inferred_learners(server: Harness, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        *_dsec_run(server, "pool-b"),
        "--",
        str(torchrun),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(REPO / "src" / "dsec" / "data" / "ppo_cartpole_ddp.py"),
        "--total-steps",
        "4096",
        "--target-return",
        "1e9",
        "--log-every",
        "0",
    ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    workers = server.admin.workers(pool="pool-b")
    assert sorted(w["rank"] for w in workers) == [0, 1]
    for w in workers:
        assert w["role"] == "learner" and w["state"] == "deregistered", w
        [ev] = _inferred(server, w["id"])
        assert (ev["data"]["from"], ev["data"]["to"]) == ("other", "learner")
        evidence = ev["data"]["evidence"]
        assert evidence["rule"] == "synchronized optimizer step"
        assert evidence["optimizer_steps"] >= 1 and evidence["gradient_syncs"] >= 1 and evidence["env_steps"] > 0
        [dereg] = server.admin.all_events(worker_id=w["id"], types=["deregistered"])
        assert dereg["data"]["reason"] == "exit"
