"""How a probed process ends, as the control plane records it (real processes under `dsec run`, a real control
plane on loopback): a normal end or a launcher's SIGTERM is ``deregistered`` with its reason, never ``lost``; a
SIGKILL is ``lost`` within the usual detection time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, stop_process_group, wait_for

pytest.importorskip("gymnasium")

DSEC = Path(sys.executable).with_name("dsec")
BEAT_S = 0.5  # lost after 3 beats: 1.5 s, a margin a loaded 2-core CI machine needs (0.6 s flaked)

# CartPole forever (or N episodes), with a little sleep so a 2-core machine keeps up.
ACTOR = """
import sys, time
import gymnasium as gym
episodes = int(sys.argv[1]) if len(sys.argv) > 1 else -1
env = gym.make("CartPole-v1"); env.reset(seed=0)
done = 0
while done != episodes:
    _, _, t, tr, _ = env.step(env.action_space.sample())
    time.sleep(0.001)
    if t or tr:
        done += 1; env.reset()
if len(sys.argv) > 2:
    raise RuntimeError("the script fails")
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update({"DSEC_HEARTBEAT_INTERVAL": str(BEAT_S), **extra})
    return env


def _start(server: Harness, script: Path, *args: str, pool: str = "pool-a") -> subprocess.Popen[bytes]:
    cmd = [str(DSEC), "run", "--endpoint", server.url, "--sandbox-id", pool, "--token", server.pool_tokens[pool]]
    with script.with_suffix(".log").open("ab") as log:
        return subprocess.Popen(
            [*cmd, "--", sys.executable, str(script), *args],
            env=_env(),
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _worker(server: Harness, pool: str = "pool-a") -> dict[str, Any]:
    def beating() -> dict[str, Any] | None:
        ws = server.admin.workers(pool=pool)
        return ws[0] if ws and ws[0]["metrics"].get("env_steps_total", 0) > 0 else None

    w: dict[str, Any] = wait_for(beating, timeout=60, what="the worker's first beat with env steps")
    return w


def _ended(server: Harness, worker_id: str, timeout: float = 20) -> dict[str, Any]:
    w: dict[str, Any] = wait_for(
        lambda: (w := server.admin.worker(worker_id))["state"] != "active" and w,
        timeout=timeout,
        what="the worker to end",
    )
    return w


def _events(server: Harness, worker_id: str, *types: str) -> list[dict[str, Any]]:
    return server.admin.all_events(worker_id=worker_id, types=list(types))


@pytest.fixture
def actor(tmp_path: Path) -> Path:
    path = tmp_path / "actor.py"
    path.write_text(ACTOR)
    return path


def test_sigterm_from_a_launcher_is_deregistered_not_lost(server: Harness, actor: Path) -> None:
    proc = _start(server, actor)
    try:
        w = _worker(server)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # what a launcher does: the whole group (`dsec run` forwards it too)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        stop_process_group(proc, timeout=0)
    # The process still died by SIGTERM (`dsec run` answers 128 + 15), promptly.
    assert code == 128 + signal.SIGTERM, actor.with_suffix(".log").read_text()[-2000:]
    assert took < 10, took
    ended = _ended(server, w["id"])
    assert ended["state"] == "deregistered"
    [ev] = _events(server, w["id"], "deregistered")
    assert ev["data"]["reason"] == "sigterm"
    # Well past the detection time (3 beats): still no `lost`.
    time.sleep(6 * BEAT_S)
    assert server.admin.worker(w["id"])["state"] == "deregistered"
    assert _events(server, w["id"], "lost") == []


def test_sigkill_is_still_lost_within_the_detection_time(server: Harness, actor: Path) -> None:
    proc = _start(server, actor)
    try:
        w = _worker(server)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        t0 = time.monotonic()
        ended = _ended(server, w["id"], timeout=10)
        took = time.monotonic() - t0
    finally:
        stop_process_group(proc, timeout=0)
    assert ended["state"] == "lost"
    assert took < 3 * BEAT_S + 2.0, took  # lost_after_beats x interval, plus the reconcile pass and polling
    assert len(_events(server, w["id"], "lost")) == 1
    assert _events(server, w["id"], "deregistered") == []


@pytest.mark.parametrize(("args", "reason", "code"), [(("3",), "exit", 0), (("3", "fail"), "error", 1)])
def test_the_script_ending_deregisters_with_exit_or_error(
    server: Harness, actor: Path, args: tuple[str, ...], reason: str, code: int
) -> None:
    proc = _start(server, actor, *args)
    try:
        assert proc.wait(timeout=60) == code, actor.with_suffix(".log").read_text()[-2000:]
    finally:
        stop_process_group(proc, timeout=0)
    [w] = server.admin.workers(pool="pool-a")
    assert w["state"] == "deregistered"
    [ev] = _events(server, w["id"], "deregistered")
    assert ev["data"]["reason"] == reason


def test_the_scripts_own_sigterm_handler_decides_and_the_exit_says_sigterm(server: Harness, tmp_path: Path) -> None:
    """A handler installed before the probe (here: the script attaches after installing it) is called; the probe
    does not swallow the signal nor kill the process itself, and the exit that follows is recorded as sigterm."""
    script = tmp_path / "graceful.py"
    script.write_text(
        "import signal, sys, time\n"
        "import dsec, gymnasium as gym\n"
        "def bye(signum, frame):\n"
        "    print('handler ran', flush=True)\n"
        "    sys.exit(5)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "dsec.attach()\n"
        "env = gym.make('CartPole-v1'); env.reset(seed=0)\n"
        "while True:\n"
        "    _, _, t, tr, _ = env.step(env.action_space.sample())\n"
        "    time.sleep(0.001)\n"
        "    if t or tr: env.reset()\n"
    )
    env = _env(DSEC_ENDPOINT=server.url, DSEC_SANDBOX_ID="pool-a", DSEC_TOKEN=server.pool_tokens["pool-a"])
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        w = _worker(server)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        stop_process_group(proc, timeout=0)
    assert proc.returncode == 5, err.decode()[-2000:]
    assert b"handler ran" in out
    [ev] = _events(server, w["id"], "deregistered")
    assert ev["data"]["reason"] == "sigterm"
