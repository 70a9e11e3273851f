"""The `dsec` CLI against a real control plane (typer's runner, real HTTP)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsec.cli import app
from dsec.client import Client
from dsec.control.app import create_app
from dsec.control.server import ServerThread, free_port
from dsec.control.settings import Settings

REPO = Path(__file__).resolve().parents[2]
ADMIN = "cli-admin-token"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    settings = Settings.from_env(home=tmp_path, admin_token=ADMIN, cluster_file=REPO / "examples" / "cluster.yaml")
    with ServerThread(create_app(settings)) as srv:
        yield srv


def _run(server: ServerThread, *args: str) -> str:
    # A wide terminal whatever the caller's: at 80 columns the status view drops its step-time column.
    env = {"DSEC_ENDPOINT": server.url, "DSEC_ADMIN_TOKEN": ADMIN, "COLUMNS": "200", "LINES": "100"}
    result = CliRunner().invoke(app, [*args], env=env)
    assert result.exit_code == 0, result.output
    return result.output


def test_token_status_workers_events_directive(server: ServerThread) -> None:
    token = _run(server, "token", "create", "--pool", "pool-2").strip()
    assert token.startswith("dsp_")
    with Client(server.url) as c:
        reg = c.register("pool-2", role="learner", rank=3, token=token)
        c.heartbeat(
            reg["worker_id"], 1, acked_directive_version=1, metrics={"step_ms_mean": 12.5}, token=reg["worker_token"]
        )
    out = _run(server, "status")
    assert "pool-7" in out and reg["worker_id"] in out and "12.5" in out
    assert reg["worker_id"] in _run(server, "workers", "--pool", "pool-2")
    assert "registered" in _run(server, "events", "--type", "registered")
    out = _run(server, "directive", "set", reg["worker_id"], "compression_bits=8", "async_sampling=false")
    assert '"desired_version": 2' in out and '"compression_bits": 8' in out and '"async_sampling": false' in out
    assert '"acked_version": 1' in _run(server, "directive", "show", reg["worker_id"])


def test_cli_reports_api_errors_without_traceback(server: ServerThread) -> None:
    env = {"DSEC_ENDPOINT": server.url, "DSEC_ADMIN_TOKEN": ADMIN}
    result = CliRunner().invoke(app, ["directive", "set", "w-nope", "compression_bits=8"], env=env)
    assert result.exit_code == 1
    assert "404" in result.output and "worker_id" in result.output
    result = CliRunner().invoke(app, ["status"], env={**env, "DSEC_ADMIN_TOKEN": "wrong"})
    assert result.exit_code == 1 and "403" in result.output
    result = CliRunner().invoke(app, ["status"], env={**env, "DSEC_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
    assert result.exit_code == 1 and "error" in result.output


def test_serve_rejects_bad_cluster_file_with_position(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text("pools:\n  - name: a\n    memory_base_gb: 9\n    memory_ceiling_gb: 4\n  - name: b\n    bogus: 1\n")
    result = CliRunner().invoke(app, ["serve", "--cluster", str(bad), "--home", str(tmp_path / "h")])
    assert result.exit_code == 2
    assert f"{bad}:4:5: pools[0].memory_ceiling_gb" in result.output
    assert f"{bad}:6:5: pools[1].bogus" in result.output


def test_serve_runs_as_a_process_and_writes_admin_token(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env["DSEC_HOME"] = str(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsec.cli",
            "serve",
            "--port",
            str(port),
            "--cluster",
            str(REPO / "examples/cluster.yaml"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        token_file = tmp_path / "admin.token"
        deadline = time.monotonic() + 30
        while True:
            try:
                with Client(f"http://127.0.0.1:{port}", token=token_file.read_text().strip()) as c:
                    pools = c.pools()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        assert len(pools) == 8
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        assert (tmp_path / "dsec.db").exists()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_token_read_ls_and_revoke(server: ServerThread) -> None:
    read = _run(server, "token", "create", "--read", "--label", "dashboard").strip()
    assert read.startswith("dsv_")
    pool = _run(server, "token", "create", "--pool", "pool-1").strip()
    listed = _run(server, "token", "ls")
    assert "dashboard" in listed and read not in listed and pool not in listed
    # A read-only token serves `dsec status`; it cannot create tokens.
    result = CliRunner().invoke(app, ["status"], env={"DSEC_ENDPOINT": server.url, "DSEC_ADMIN_TOKEN": read})
    assert result.exit_code == 0 and "pool-7" in result.output
    result = CliRunner().invoke(app, ["token", "create", "--read"], env={"DSEC_ENDPOINT": server.url,
                                                                       "DSEC_ADMIN_TOKEN": read})  # fmt: skip
    assert result.exit_code == 1 and "403" in result.output
    read_id = next(line.split()[0] for line in listed.splitlines() if "dashboard" in line)
    assert f"revoked {read_id}" in _run(server, "token", "revoke", read_id)
    result = CliRunner().invoke(app, ["status"], env={"DSEC_ENDPOINT": server.url, "DSEC_ADMIN_TOKEN": read})
    assert result.exit_code == 1 and "403" in result.output
    result = CliRunner().invoke(
        app, ["token", "create", "--read", "--pool", "pool-1"], env={"DSEC_ENDPOINT": server.url}
    )
    assert result.exit_code == 2
