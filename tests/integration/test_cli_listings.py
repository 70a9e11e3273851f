"""The `dsec` listings against a real control plane: readable at 80-100 columns, ids whole, details behind --wide,
and --json for scripts (typer's runner and a piped subprocess, real HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
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
ADMIN = "cli-admin-token"
STEP_MS = 12.345678912345  # more digits than any table shows: --json must keep them all
JOB = "ppo-cartpole-with-a-long-job-name"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ServerThread, list[str]]]:
    """A control plane with the example cluster (8 pools x 2 devices), three reporting workers in pool-0, a job
    placed there (14 devices excluded: not in the pool) and an event whose data looks like rich markup."""
    settings = Settings.from_env(home=tmp_path, admin_token=ADMIN, cluster_file=REPO / "examples" / "cluster.yaml")
    with ServerThread(create_app(settings)) as srv, Client(srv.url, token=ADMIN) as admin, Client(srv.url) as c:
        token = admin.create_token(pool="pool-0", kind="pool")
        ids = []
        for rank in range(3):
            reg = c.register("pool-0", role="learner", rank=rank, token=token)
            metrics = {"step_ms_mean": STEP_MS, "bytes_per_sync": 1234567.0, "grad_norm": 0.5}
            c.heartbeat(reg["worker_id"], 1, acked_directive_version=1, metrics=metrics, token=reg["worker_token"])
            ids.append(reg["worker_id"])
        admin.set_directive(ids[0], compression_bits=8, grad_accum_steps=4)
        workers = [{"name": f"{JOB}-learner-{i}", "role": "learner"} for i in range(2)]
        admin.place({"name": JOB, "pool": "pool-0", "groups": [{"name": "learners", "workers": workers}]})
        admin.record_event("log", {"text": "[bold]not markup[/bold]", "long": "x" * 300}, pool="pool-0")
        yield srv, ids


def _run(server: ServerThread, *args: str, columns: int = 100) -> str:
    env = {"DSEC_ENDPOINT": server.url, "DSEC_ADMIN_TOKEN": ADMIN, "COLUMNS": str(columns)}
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result.output


def _fits(out: str, columns: int) -> None:
    too_long = [line for line in out.splitlines() if len(line) > columns]
    assert not too_long, "\n".join(too_long)


def _whole(out: str, *ids: str) -> None:
    """Every id on one line, unshortened (an ellipsis would also fail this)."""
    lines = out.splitlines()
    for ident in ids:
        assert any(ident in line for line in lines), f"{ident} cut or folded in:\n{out}"


LISTINGS = (
    ("status",),
    ("workers",),
    ("workers", "--pool", "pool-0"),
    ("events",),
    ("placement", "explain", JOB),
)


@pytest.mark.parametrize("columns", [100, 80])
@pytest.mark.parametrize("args", LISTINGS, ids=" ".join)
def test_default_views_fit_and_keep_ids_whole(
    cluster: tuple[ServerThread, list[str]], args: tuple[str, ...], columns: int
) -> None:
    server, ids = cluster
    out = _run(server, *args, columns=columns)
    _fits(out, columns)
    if args[0] == "placement":
        _whole(out, f"{JOB}-learner-0", f"{JOB}-learner-1", "gpu-00", "gpu-01")
    else:
        _whole(out, *ids)
    if args[0] in ("status", "workers"):
        for line in out.splitlines():
            if ids[0] in line:
                assert "…" not in line, line  # nothing on a worker's line is cut either
                assert "v2/v1" in line and "8b/x4" in line  # the directive: versions and degradation


def test_status_default_is_compact_and_wide_has_every_column(cluster: tuple[ServerThread, list[str]]) -> None:
    server, ids = cluster
    out = _run(server, "status")
    assert "pool-7" in out and "step ms" in out and "12.3" in out
    for detail in ("bw cap MB/s", "sync p99 ms", "bytes/sync", "grad norm", "directive desired/acked", "beats"):
        assert detail not in out
    wide = _run(server, "status", "--wide")
    for detail in ("bw cap MB/s", "lat cap ms", "snap s/lvl", "sync p99 ms", "bytes/sync", "grad norm", "beats",
                   "bits/accum", "directive desired/acked", "8b/x4", "1234567"):  # fmt: skip
        assert detail in wide, detail
    # Every column at its natural width: headers on one line each, nothing squeezed to an ellipsis.
    header = next(line for line in wide.splitlines() if "worker" in line and "sync p99 ms" in line)
    assert "…" not in header
    _whole(wide, *ids)
    assert "sync p99 ms" in _run(server, "workers", "-l")


def test_events_default_one_line_each_wide_all_data_never_markup(cluster: tuple[ServerThread, list[str]]) -> None:
    server, _ = cluster
    out = _run(server, "events", "--type", "log")
    rows = [line for line in out.splitlines() if " log " in line]
    assert len(rows) == 1 and "…" in rows[0]  # 300 x's cut to the room left, on one line
    assert "[bold]not markup[/bold]" in out
    wide = _run(server, "events", "--type", "log", "--wide")
    _fits(wide, 100)
    assert "".join(line.strip("│ ") for line in wide.splitlines()).count("x") >= 300  # all of it, wrapped
    assert "pool-0" in wide and "[bold]not markup[/bold]" in wide


def test_events_cursor_pages_on(cluster: tuple[ServerThread, list[str]]) -> None:
    server, _ = cluster
    out = _run(server, "events", "--limit", "2")
    more = next(line for line in out.splitlines() if line.startswith("more: --cursor"))
    page = json.loads(_run(server, "events", "--json", "--limit", "2", "--cursor", more.split()[-1]))
    assert [e["id"] for e in page["items"]] == [3, 4]


def test_placement_summarises_exclusions_and_wide_names_them(cluster: tuple[ServerThread, list[str]]) -> None:
    server, _ = cluster
    out = _run(server, "placement", "explain", JOB)
    assert "excluded: 14 devices (not in the pool)" in out and "gpu-15" not in out
    assert "numa" not in out
    wide = _run(server, "placement", "explain", JOB, "--wide")
    assert "numa" in wide and "learners" in wide
    assert "gpu-02" in wide and "gpu-15" in wide


def _json(server: ServerThread, *args: str) -> Any:
    return json.loads(_run(server, *args, "--json", columns=40))  # JSON does not depend on the width


def test_json_on_every_listing(cluster: tuple[ServerThread, list[str]]) -> None:
    server, ids = cluster
    status = _json(server, "status")
    assert {w["id"] for w in status["workers"]} == set(ids) and len(status["pools"]) == 8
    assert {w["metrics"]["step_ms_mean"] for w in status["workers"]} == {STEP_MS}
    workers = _json(server, "workers", "--pool", "pool-0")
    assert sorted(w["id"] for w in workers) == sorted(ids)
    events = _json(server, "events")
    assert {"registered", "placement", "log"} <= {e["type"] for e in events["items"]}
    assert next(e for e in events["items"] if e["type"] == "log")["data"]["long"] == "x" * 300
    placement = _json(server, "placement", "explain", JOB)
    assert [a["worker"] for a in placement["assignments"]] == [f"{JOB}-learner-0", f"{JOB}-learner-1"]
    assert len(placement["excluded"]) == 14


def test_status_json_and_watch_are_exclusive(cluster: tuple[ServerThread, list[str]]) -> None:
    server, _ = cluster
    env = {"DSEC_ENDPOINT": server.url, "DSEC_ADMIN_TOKEN": ADMIN}
    result = CliRunner().invoke(app, ["status", "--json", "--watch", "1"], env=env)
    assert result.exit_code == 2 and "--watch" in result.output


def test_piped_output_is_100_columns_without_columns_set(cluster: tuple[ServerThread, list[str]]) -> None:
    """The real command with stdout on a pipe: no terminal, no $COLUMNS -> 100 columns (no longer 220)."""
    server, ids = cluster
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS" and not k.startswith("DSEC_")}
    env.update(DSEC_ENDPOINT=server.url, DSEC_ADMIN_TOKEN=ADMIN)
    proc = subprocess.run(
        [sys.executable, "-m", "dsec.cli", "status"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    _fits(proc.stdout, 100)
    _whole(proc.stdout, *ids)
    assert "step ms" in proc.stdout  # 100 columns: the full default view, nothing dropped
