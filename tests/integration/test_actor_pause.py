"""Pausing an actor's sampling in a real actor-learner job (examples/actor_learner_cartpole.py under `dsec run`, roles
inferred, a real control plane): the paused actor's ``env.step`` is held and it delivers no more rollouts, the learner
trains on the other actor's rollouts to its target, and the launcher ends the held actor at the end. The other actor,
the same code unpaused, delivers every rollout the learner used (so the check on the paused one can fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Harness, stop_process_group

pytest.importorskip("gymnasium")

DSEC = Path(sys.executable).with_name("dsec")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "actor_learner_cartpole.py"


def _run(server: Harness, pool: str, tmp_path: Path, pause_rank: int) -> tuple[dict, dict[int, dict]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update(DSEC_HEARTBEAT_INTERVAL="0.2", DSEC_ROLE_ACTOR_STEPS="256", PYTHONUNBUFFERED="1")
    cmd = [
        str(DSEC), "run", "--endpoint", server.url, "--sandbox-id", pool, "--token", server.pool_tokens[pool], "--",
        sys.executable, str(EXAMPLE), "--actors", "2", "--seed", "3", "--target-return", "80",
        "--actor-steps-per-s", "2000", "--max-seconds", "90", "--stop-grace-s", "2", "--log-every", "0",
    ]  # fmt: skip
    log = tmp_path / f"{pool}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=out, text=True, start_new_session=True)
    try:
        paused_id = None
        deadline = time.monotonic() + 60
        while paused_id is None and proc.poll() is None and time.monotonic() < deadline:
            for w in server.admin.workers(pool=pool):
                if w["rank"] == pause_rank:
                    server.admin.set_directive(w["id"], async_sampling=False)
                    paused_id = w["id"]
            time.sleep(0.02)
        assert paused_id is not None, log.read_text()[-3000:]
        stdout, _ = proc.communicate(timeout=150)
    finally:
        stop_process_group(proc, timeout=0)
    assert proc.returncode == 0, stdout[-2000:] + log.read_text()[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    return result, {w["rank"]: w for w in server.admin.workers(pool=pool)}


def test_a_paused_actor_stops_delivering_and_the_learner_trains_on_the_others(server: Harness, tmp_path: Path) -> None:
    result, workers = _run(server, "pool-a", tmp_path, pause_rank=1)
    assert result["reached"], result
    assert sorted(workers) == [0, 1, 2]
    assert workers[0]["role"] == "learner" and workers[1]["role"] == "actor" and workers[2]["role"] == "actor"
    # Held from its first step as an actor (256 env steps) once the directive reached it (a beat, 0.2 s, is ~400 env
    # steps at this pace): at most the one 512-step rollout it had under way; the other actor delivered the rest.
    by_actor = result["env_steps_by_actor"]
    assert by_actor.get("1", 0) <= 512 and by_actor["2"] == result["env_steps"] - by_actor.get("1", 0), result
    assert by_actor["2"] >= 8 * 512, result
    assert workers[1]["metrics"].get("async_sampling") == 0 and workers[2]["metrics"].get("async_sampling") == 1
    assert workers[1]["metrics"].get("env_steps_total", 0) < 2 * 512
    # The held actor could not see the learner's stop: the launching process ended it.
    assert result["actors_ended_by_launcher"] == [1]
