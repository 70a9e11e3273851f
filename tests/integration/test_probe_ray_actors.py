"""How a probed Ray actor ends (dsec/probe/lifecycle_ray.py), with plain Ray actors under `dsec run` and a real control
plane: an actor ended by ``ray.kill`` is deregistered ``ray_kill``, one still alive at ``ray.shutdown()`` is
deregistered ``ray_shutdown``, one sent SIGTERM from outside (Ray's own handler replaced the probe's) ``sigterm`` —
none is ``lost``. Without lifecycle_ray the first two were ``lost`` (no Python runs in a killed actor; at shutdown
the raylet's SIGKILL follows its SIGTERM within about a millisecond)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, stop_process_group, wait_for

if importlib.util.find_spec("ray") is None or importlib.util.find_spec("gymnasium") is None:
    pytest.skip("ray and gymnasium are not installed", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ray_actors.py"
DSEC = Path(sys.executable).with_name("dsec")
BEAT_S = 0.3
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _by_steps(server: Harness) -> dict[float, dict[str, Any]]:
    return {w["metrics"].get("env_steps_total", 0.0): w for w in server.admin.workers(pool="pool-a")}


def test_ray_kill_shutdown_and_sigterm_deregister_the_actors_with_their_reason_not_lost(
    server: Harness, tmp_path: Path
) -> None:
    stop, pids, log = tmp_path / "stop", tmp_path / "pids.json", tmp_path / "job.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update({"DSEC_HEARTBEAT_INTERVAL": str(BEAT_S), **RAY_ENV})
    cmd = [
        str(DSEC), "run", "--endpoint", server.url, "--sandbox-id", "pool-a", "--token", server.pool_tokens["pool-a"],
        "--", sys.executable, str(FIXTURE), "--stop-file", str(stop), "--pids", str(pids),
    ]  # fmt: skip
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        actors = wait_for(
            lambda: (s := _by_steps(server)).keys() >= {200.0, 400.0, 600.0} and pids.exists() and s,
            timeout=150,
            interval=0.2,
            what="the three actors reporting their env steps",
        )
        os.kill(json.loads(pids.read_text())["termed"], signal.SIGTERM)
        wait_for(
            lambda: server.admin.worker(actors[600.0]["id"])["state"] != "active",
            timeout=30,
            what="the SIGTERMed actor to end",
        )
        stop.touch()
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        stop.touch()
        stop_process_group(proc)
    print(log.read_text().strip().splitlines()[-1])  # how long ray.kill and ray.shutdown took
    time.sleep(4 * BEAT_S)  # past the detection time: a worker that ended without deregistering is lost by now
    ended = {
        steps: (
            server.admin.worker(w["id"])["state"],
            [e["data"]["reason"] for e in server.admin.all_events(worker_id=w["id"], types=["deregistered"])],
        )
        for steps, w in actors.items()
    }
    assert ended == {
        200.0: ("deregistered", ["ray_kill"]),
        400.0: ("deregistered", ["ray_shutdown"]),
        600.0: ("deregistered", ["sigterm"]),
    }, log.read_text()[-3000:]
    assert server.admin.all_events(types=["lost"]) == []
