"""`dsec serve --policy`, `dsec policy apply | show` and `dsec metrics export` against a real control plane, and
the exported series replayed with `dsec policy test`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import make_settings, wait_for
from dsec.cli import app
from dsec.client import Client
from dsec.control.app import create_app
from dsec.control.server import ServerThread

REPO = Path(__file__).resolve().parents[2]
ADMIN = "policy-cli-admin"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    settings = make_settings(tmp_path / "cp", admin_token=ADMIN, policy_interval_s=0.05)
    with ServerThread(create_app(settings)) as srv:
        with Client(srv.url, token=ADMIN) as c:
            c.put_pool("pool-0")
        yield srv


def _cli(server: ServerThread, *args: str) -> tuple[int, str]:
    env = {"DSEC_ENDPOINT": server.url, "DSEC_ADMIN_TOKEN": ADMIN, "COLUMNS": "200"}
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.output


def test_apply_show_export_and_replay(server: ServerThread, tmp_path: Path) -> None:
    code, out = _cli(server, "policy", "apply", str(REPO / "examples/policies/meltdowns-tighten-latency-cap.yaml"))
    assert code == 0 and "applied" in out and "tighten-latency-cap-on-meltdowns" in out
    code, out = _cli(server, "policy", "show")
    shown = json.loads(out)
    assert code == 0 and [r["name"] for r in shown["rules"]] == ["tighten-latency-cap-on-meltdowns"]
    assert shown["source"].endswith("meltdowns-tighten-latency-cap.yaml")
    with Client(server.url, token=ADMIN) as c:
        wait_for(lambda: any(len(s["samples"]) >= 3 for s in c.metric_series()["series"]), timeout=10, what="samples")
    code, out = _cli(server, "metrics", "export", "-o", str(tmp_path / "series.json"))
    assert code == 0 and "series ->" in out
    exported = json.loads((tmp_path / "series.json").read_text())
    metrics = {s["metric"] for s in exported["series"] if s["labels"]["pool"] == "pool-0"}
    assert {"dsec_melt_down_count", "dsec_sandbox_utilization_rate", "dsec_workers_active"} <= metrics
    # No meltdowns were recorded: the replay of the live history decides nothing.
    code, out = _cli(server, "policy", "test", str(REPO / "examples/policies/meltdowns-tighten-latency-cap.yaml"),
                     "--series", str(tmp_path / "series.json"), "--step", "1s")  # fmt: skip
    assert code == 0 and "0 decision(s), 0 applied" in out


def test_apply_refuses_a_bad_file(server: ServerThread, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "policies:\n  - name: x\n    when: increase(dsec_melt_down_count[1h] > 3\n"
        "    then: [{knob: latency_cap_ms, by: -10}]\n"
    )
    code, out = _cli(server, "policy", "apply", str(bad))
    assert code == 1 and f"{bad}:3:45: policies[0].when: expected ')'" in out
    code, out = _cli(server, "policy", "show")
    assert json.loads(out)["rules"] == []


def test_serve_refuses_a_bad_policy_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies:\n  - name: x\n    when: foo > 1\n    then: [{knob: latency_cap_ms, by: -10}]\n")
    result = CliRunner().invoke(app, ["serve", "--home", str(tmp_path / "h"), "--policy", str(bad)])
    assert result.exit_code == 2 and f"{bad}:3:11: policies[0].when: unknown metric 'foo'" in result.output
