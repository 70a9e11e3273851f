"""`dsec run`: injection into every Python process, without breaking what it wraps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import Harness, wait_for
from dsec.control.server import free_port

DSEC = Path(sys.executable).with_name("dsec")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update(extra)
    return env


def test_exit_code_and_stdout_pass_through_without_a_control_plane() -> None:
    proc = subprocess.run(
        [str(DSEC), "run", "--", sys.executable, "-c", "import sys; print('hello'); sys.exit(7)"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 7
    assert proc.stdout.strip() == "hello"
    assert "without the probe" in proc.stderr


def test_existing_sitecustomize_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIR_SITE_RAN'] = '1'\n")
    code = "import os, sys; print(os.environ.get('THEIR_SITE_RAN'), 'dsec.probe.bootstrap' in sys.modules)"
    proc = subprocess.run(
        [str(DSEC), "run", "--endpoint", "http://127.0.0.1:9", "--sandbox-id", "p", "--", sys.executable, "-c", code],
        env=_env(PYTHONPATH=str(theirs)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "True"]


def test_unknown_command_and_missing_command() -> None:
    proc = subprocess.run(
        [str(DSEC), "run", "--", "no-such-program-xyz"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 127 and "no-such-program-xyz" in proc.stderr
    proc = subprocess.run([str(DSEC), "run"], env=_env(), capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "no command given" in proc.stderr


def test_plain_script_with_attach_twice_registers_once(server: Harness, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import dsec, gymnasium as gym\n"
        "a = dsec.attach(role='actor')\n"
        "b = dsec.attach()\n"
        "assert a is b and a is not None\n"
        "env = gym.make('CartPole-v1'); env.reset(seed=0)\n"
        "done = 0\n"
        "while done < 5:\n"
        "    _, _, t, tr, _ = env.step(env.action_space.sample())\n"
        "    if t or tr:\n"
        "        done += 1; env.reset()\n"
    )
    proc = subprocess.run(
        [
            str(DSEC),
            "run",
            "--endpoint",
            server.url,
            "--sandbox-id",
            "pool-b",
            "--token",
            server.pool_tokens["pool-b"],
            "--",
            sys.executable,
            str(script),
        ],
        env=_env(DSEC_HEARTBEAT_INTERVAL="0.2"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    workers = wait_for(lambda: server.admin.workers(pool="pool-b"), what="the worker")
    assert len(workers) == 1
    w = workers[0]
    assert w["role"] == "actor" and w["state"] == "deregistered"
    assert w["metrics"]["episodes_total"] == 5


def test_torchrun_workers_register_and_the_agent_does_not(server: Harness) -> None:
    repo = Path(__file__).resolve().parents[2]
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(DSEC),
        "run",
        "--endpoint",
        server.url,
        "--sandbox-id",
        "pool-a",
        "--token",
        server.pool_tokens["pool-a"],
        "--role",
        "learner",
        "--",
        str(torchrun),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(repo / "examples" / "ppo_cartpole_ddp.py"),
        "--total-steps",
        "4096",
        "--target-return",
        "1e9",
        "--log-every",
        "0",
    ]
    proc = subprocess.run(
        cmd,
        env=_env(GLOO_SOCKET_IFNAME="lo", DSEC_HEARTBEAT_INTERVAL="0.5"),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    workers = server.admin.workers(pool="pool-a")
    assert sorted(w["rank"] for w in workers) == [0, 1], "two ranks, no launcher process"
    for w in workers:
        assert w["role"] == "learner" and w["metrics"]["sync_ops_total"] > 0 and w["metrics"]["episodes_total"] > 0


def test_an_unknown_role_is_refused_before_anything_starts() -> None:
    proc = subprocess.run(
        [str(DSEC), "run", "--role", "critic", "--", sys.executable, "-c", "print('ran')"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "--role 'critic' is invalid" in proc.stderr and "ran" not in proc.stdout
