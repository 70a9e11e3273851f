"""`dsec top` against a real control plane on loopback, with a read-only token: one frame fits 100 columns, the lost
worker first and the one over its latency cap next, ids whole; --json parses; --worker shows the directive desired
vs acked; without a terminal on stdin the live view refreshes until Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dsec.cli import app
from dsec.client import Client
from dsec.control.app import create_app
from dsec.control.server import ServerThread
from dsec.control.settings import Settings

REPO = Path(__file__).resolve().parents[2]
ADMIN = "top-admin-token"


@dataclass
class Cluster:
    server: ServerThread
    read_token: str
    ok: str  # healthy actor, group "actors"
    slow: str  # learner whose sync cost is over the 85 ms cap: breaker escalated
    lost: str  # learner that stopped beating


def _wait(what: str, check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    settings = Settings.from_env(home=tmp_path, admin_token=ADMIN, cluster_file=REPO / "examples" / "cluster.yaml")
    with ServerThread(create_app(settings)) as srv, Client(srv.url, token=ADMIN) as admin, Client(srv.url) as c:
        pool_token = admin.create_token(pool="pool-0", kind="pool")
        read_token = admin.create_token(kind="read")
        ok = c.register("pool-0", role="actor", group="actors", token=pool_token)
        slow = c.register("pool-0", role="learner", group="learners", rank=0, token=pool_token)
        lost = c.register(
            "pool-0", role="learner", group="learners", rank=1, token=pool_token, heartbeat_interval_s=0.1
        )
        c.heartbeat(lost["worker_id"], 1, metrics={"step_ms_mean": 20.0}, token=lost["worker_token"])
        for seq in range(1, 8):
            for reg, cost in ((ok, 10.0), (slow, 300.0)):
                metrics = {
                    "step_ms_mean": 12.5,
                    "sync_cost_ms_p50": cost,
                    "sync_cost_ms_p99": cost * 1.2,
                    "memory_used_gb": 3.0,
                }
                c.heartbeat(
                    reg["worker_id"], seq, acked_directive_version=1, metrics=metrics, token=reg["worker_token"]
                )
            time.sleep(0.1)
        _wait(
            "the breaker to degrade the slow worker", lambda: admin.worker(slow["worker_id"])["breaker"]["level"] >= 1
        )
        _wait("the silent worker to be lost", lambda: admin.worker(lost["worker_id"])["state"] == "lost")
        yield Cluster(srv, read_token, ok["worker_id"], slow["worker_id"], lost["worker_id"])


def _run(cl: Cluster, *args: str, columns: int = 100) -> str:
    # Only the read-only token: the command must not need the admin one.
    env = {
        "DSEC_ENDPOINT": cl.server.url,
        "DSEC_READ_TOKEN": cl.read_token,
        "DSEC_ADMIN_TOKEN": "",
        "COLUMNS": str(columns),
    }
    result = CliRunner().invoke(app, ["top", *args], env=env)
    assert result.exit_code == 0, result.output
    return result.output


def _table_rows(out: str, *ids: str) -> list[str]:
    """The worker lines of the table, in order (the recent events below it name workers too)."""
    table = out.split("Recent events")[0]
    return [line for line in table.splitlines() if any(i in line for i in ids)]


def test_once_fits_100_columns_troubled_first_ids_whole(cluster: Cluster) -> None:
    out = _run(cluster, "--once", "--pool", "pool-0")
    too_long = [line for line in out.splitlines() if len(line) > 100]
    assert not too_long, "\n".join(too_long)
    rows = _table_rows(out, cluster.ok, cluster.slow, cluster.lost)
    assert len(rows) == 3, out
    assert cluster.lost in rows[0] and "lost" in rows[0]
    assert cluster.slow in rows[1] and re.search(r"L[1-3] (escalating|open|half_open|recovering)", rows[1])
    assert "360/85" in rows[1]  # sync cost p99 vs the pool's latency cap
    assert cluster.ok in rows[2] and "L0 closed" in rows[2]
    for row, ident in zip(rows, (cluster.lost, cluster.slow, cluster.ok), strict=True):
        assert ident in row and "…" not in row.split(ident)[0]
    head = out.split("Recent events")[0]
    assert "pool-0" in head and "meltdowns 1" in head and "active 2" in head and "lost 1" in head
    assert "Recent events" in out and "meltdown" in out


def test_group_and_filter_narrow_the_rows(cluster: Cluster) -> None:
    out = _run(cluster, "--once", "--group", "actors")
    assert _table_rows(out, cluster.ok, cluster.slow, cluster.lost) == _table_rows(out, cluster.ok)
    assert len(_table_rows(out, cluster.ok)) == 1
    out = _run(cluster, "--once", "--filter", "escalat")
    rows = _table_rows(out, cluster.ok, cluster.slow, cluster.lost)
    assert len(rows) == 1 and cluster.slow in rows[0]


def test_json_is_one_frame(cluster: Cluster) -> None:
    frame = json.loads(_run(cluster, "--json", "--pool", "pool-0", columns=40))
    assert [w["id"] for w in frame["workers"]] == [cluster.lost, cluster.slow, cluster.ok]
    slow = frame["workers"][1]
    assert slow["sync_over_cap"] and slow["cap_ms"] == 85.0 and slow["sync_metric"] == "sync_cost_ms_p99"
    assert slow["mem_used_gb"] == 3.0 and slow["mem_quota_gb"] == 7.0 and not slow["memory_over_quota"]
    (pool,) = frame["pools"]
    assert pool["pool"] == "pool-0" and pool["lost"] == 1 and pool["active"] == 2 and pool["meltdowns"] == 1
    assert {"utilization", "sync_success", "recovery_s"} <= set(pool)
    assert frame["events"] and all(e["type"] not in ("directive_acked", "log") for e in frame["events"])


def test_worker_detail_shows_directive_metrics_events(cluster: Cluster) -> None:
    out = _run(cluster, "--worker", cluster.slow, "--once")
    assert cluster.slow in out
    versions = re.search(r"desired v(\d+)\s+acked v1\s+not acked yet", out)  # the breaker's directive, unacked
    assert versions and int(versions.group(1)) > 1, out
    assert "compression_bits" in out and "sync_cost_ms_p99" in out and "meltdown" in out
    too_long = [line for line in out.splitlines() if len(line) > 100]
    assert not too_long, "\n".join(too_long)
    detail = json.loads(_run(cluster, "--worker", cluster.slow, "--json"))
    assert detail["worker"]["id"] == cluster.slow
    assert detail["directive"]["desired_version"] > detail["directive"]["acked_version"]
    assert detail["directive"]["caps"]["latency_ms"] == 85.0
    assert any(e["type"] == "meltdown" for e in detail["events"])


def test_unknown_worker_is_an_error_without_traceback(cluster: Cluster) -> None:
    env = {"DSEC_ENDPOINT": cluster.server.url, "DSEC_READ_TOKEN": cluster.read_token, "COLUMNS": "100"}
    result = CliRunner().invoke(app, ["top", "--worker", "w-nope", "--once"], env=env)
    assert result.exit_code == 1 and "404" in result.output and "Traceback" not in result.output


def test_live_without_a_terminal_refreshes_until_ctrl_c(cluster: Cluster) -> None:
    import psutil

    from conftest import wait_for

    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update(DSEC_ENDPOINT=cluster.server.url, DSEC_READ_TOKEN=cluster.read_token, COLUMNS="100")
    port = int(cluster.server.url.rsplit(":", 1)[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec.cli", "top", "--interval", "0.3"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it: a test run started in the background (`make test &`, some CI runners)
        # has SIGINT ignored, children inherit that, and Python then installs no KeyboardInterrupt handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        # Running, not importing: it holds a connection to the control plane (a loaded machine imports slowly, and a
        # Ctrl-C during start-up is another case).
        wait_for(
            lambda: (
                proc.poll() is not None
                or any(c.raddr and c.raddr.port == port for c in psutil.Process(proc.pid).net_connections("tcp"))
            ),
            timeout=60,
            what="dsec top connected",
        )
        assert proc.poll() is None, proc.communicate()
        time.sleep(1.0)  # a few refreshes at 0.3 s
        proc.send_signal(signal.SIGINT)
        out, errs = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()  # closes the pipes
    assert proc.returncode == 0, errs
    assert cluster.lost in out and "Traceback" not in errs


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_keys_on_a_terminal_filter_open_detail_and_quit(cluster: Cluster) -> None:
    """On a pseudo-terminal: `/` then `esc` Enter filters to the escalating worker, Enter opens its detail, Esc goes
    back, `q` quits with status 0."""
    import pty
    import select

    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update(DSEC_ENDPOINT=cluster.server.url, DSEC_READ_TOKEN=cluster.read_token, COLUMNS="100", LINES="60")
    env["TERM"] = "xterm"
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec.cli", "top", "--interval", "0.5"],
        stdin=slave,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(slave)
    screen = bytearray()

    def read_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    screen.extend(os.read(master, 65536))
                except OSError:
                    return

    try:
        read_for(3.0)
        assert cluster.lost in screen.decode(errors="replace")
        for key in (b"/", b"e", b"s", b"c", b"\r"):
            os.write(master, key)
            read_for(0.3)
        read_for(1.0)
        assert "filter esc" in screen.decode(errors="replace")
        os.write(master, b"\r")
        read_for(1.5)
        assert "Directive (desired vs acked)" in screen.decode(errors="replace")
        os.write(master, b"\x1b")
        read_for(1.0)
        os.write(master, b"q")
        _, errs = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        os.close(master)
    assert proc.returncode == 0, errs
    assert "Traceback" not in errs.decode(errors="replace")
