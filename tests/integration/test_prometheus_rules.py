"""deploy/: the Prometheus rules pass `promtool check rules` and their unit tests (`promtool test rules`), and the
Grafana dashboard is what deploy/grafana/build_dashboard.py writes, queries only names DSec exposes or the rules
record, and every one of its queries parses (checked by promtool as recording rules)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from conftest import load_module
from dsec import telemetry

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "dsec-rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "dsec-rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "dsec.json"
PROMTOOL = REPO / ".venv" / "tools" / "bin" / "promtool"
GRAFANA_VARS = {"$__rate_interval": "1m", "$pool": ".*", "$worker": ".*"}
# Functions, keywords and label names in the queries; everything else that looks like a name is a metric.
PROMQL_WORDS = {
    "sum", "max", "min", "count", "by", "without", "rate", "increase", "histogram_quantile", "le", "route", "pool",
    "worker", "kind", "state", "ignoring", "on", "job", "instance", "min_over_time", "up",
}  # fmt: skip


def promtool() -> str:
    found = str(PROMTOOL) if PROMTOOL.exists() else shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not available (scripts/fetch-promtool.sh could not fetch Debian's prometheus)")
    return found


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    tool = promtool()
    checked = run(tool, "check", "rules", RULES.name, cwd=RULES.parent)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 11 rules found" in checked.stdout
    tested = run(tool, "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # The four alerts the issue asks for have unit tests.
    text = RULE_TESTS.read_text()
    for alert in ("DsecMeltdownRate", "DsecGradientSyncSuccessLow", "DsecSnapshotRecoverySlow", "DsecWorkerLost"):
        assert f"alertname: {alert}" in text


def _builder() -> ModuleType:
    return load_module("build_dashboard", DEPLOY / "grafana" / "build_dashboard.py")


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def concrete(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def test_grafana_dashboard_is_generated_and_queries_only_exposed_or_recorded_names(tmp_path: Path) -> None:
    assert DASHBOARD.read_text() == _builder().render(), "run: python deploy/grafana/build_dashboard.py"
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "dsec-overview" and board["schemaVersion"] >= 36
    titles = [p["title"] for p in board["panels"]]
    assert titles[1:5] == ["Sandbox utilization", "Gradient sync success", "Snapshot recovery time", "Meltdowns"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])

    exposed = {m.name for m in telemetry.METRICS if m.prometheus}
    exposed |= {f"{m.name}_bucket" for m in telemetry.METRICS if m.prometheus and m.kind is telemetry.Kind.HISTOGRAM}
    recorded = {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r}
    queries = dashboard_queries()
    used = set()
    for q in queries:
        bare = re.sub(r'"[^"]*"|\[[^]]*\]|\$\w+', "", q)  # label values, ranges, variables
        used |= {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare) if w not in PROMQL_WORDS}
    assert used <= exposed | recorded, sorted(used - exposed - recorded)
    for name in ("dsec_sandbox_utilization_rate", "dsec_gradient_sync_success_rate", "dsec_snapshot_recovery_time",
                 "dsec_melt_down_count", "dsec_breaker_level", "dsec_worker_sync_latency_seconds",
                 "dsec_worker_latency_cap_seconds", "dsec_pool_memory_gb"):  # fmt: skip
        assert name in used, name

    # Every query parses: promtool checks them as recording rules.
    rules: dict[str, Any] = {
        "groups": [{"name": "grafana", "rules": [{"record": f"grafana:q{i}", "expr": concrete(q)} for i, q in
                                                 enumerate(queries)]}]
    }  # fmt: skip
    path = tmp_path / "grafana-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = run(promtool(), "check", "rules", str(path), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
