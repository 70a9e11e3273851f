"""A real Prometheus server (Debian's, unpacked by scripts/fetch-promtool.sh) scrapes a real `dsec serve` every second
with deploy/prometheus/dsec-rules.yml loaded: the four headline series come back through its query API with the
values the workers reported, the worker-level series carry only the documented labels, every rule evaluates
without error, and every query of the Grafana dashboard runs."""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from test_prometheus_rules import RULES, concrete, dashboard_queries

from conftest import Harness, wait_for
from dsec.control.server import free_port

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / ".venv" / "tools" / "bin" / "prometheus"
HEADLINE = (
    "dsec_sandbox_utilization_rate",
    "dsec_gradient_sync_success_rate",
    "dsec_snapshot_recovery_time",
    "dsec_melt_down_count",
)


@pytest.fixture
def prometheus(server: Harness, tmp_path: Path) -> Iterator[httpx.Client]:
    binary = str(PROMETHEUS) if PROMETHEUS.exists() else shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not available (scripts/fetch-promtool.sh could not fetch Debian's prometheus)")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "dsec", "static_configs": [{"targets": [f"{server.server.host}:{server.port}"]}]}
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as http:

            def ready() -> bool:
                if proc.poll() is not None:
                    pytest.fail(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
                try:
                    return http.get("/-/ready").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(ready, timeout=20, interval=0.1, what="prometheus ready")
            yield http
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(http: httpx.Client, expr: str) -> list[dict[str, Any]]:
    answer = http.get("/api/v1/query", params={"query": expr}).json()
    assert answer["status"] == "success", (expr, answer)
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def test_prometheus_scrapes_dsec_and_answers_the_four_series(server: Harness, prometheus: httpx.Client) -> None:
    w = server.register("pool-a", role="learner")
    seq = 0

    def beat(**metrics: float) -> None:
        nonlocal seq
        seq += 1
        events = [{"type": "restore", "data": {"restore_s": 0.42}}] if seq == 1 else []
        server.client(w.token).heartbeat(w.id, seq, metrics=metrics, events=events)

    beat(memory_used_gb=3.5, sync_ops_total=200, sync_ok_total=199, sync_cost_ms_p50=12.0)
    series = wait_for(
        lambda: (
            {name: query(prometheus, f'{name}{{pool="pool-a",job="dsec"}}') for name in HEADLINE}
            if all(query(prometheus, f'{name}{{pool="pool-a"}}') for name in HEADLINE)
            else None
        ),
        timeout=20,
        interval=0.25,
        what="the four headline series in Prometheus",
    )
    value = {name: float(rows[0]["value"][1]) for name, rows in series.items()}
    assert value["dsec_gradient_sync_success_rate"] == pytest.approx(199 / 200)
    assert value["dsec_snapshot_recovery_time"] == pytest.approx(0.42)
    assert value["dsec_melt_down_count"] == 0.0
    assert 0 < value["dsec_sandbox_utilization_rate"] < math.inf
    # Every pool has the four names (pool-b: no worker, no sync yet: NaN).
    assert {r["metric"]["pool"] for r in query(prometheus, "dsec_melt_down_count")} == {"pool-a", "pool-b"}
    nan = query(prometheus, 'dsec_gradient_sync_success_rate{pool="pool-b"}')
    assert nan and nan[0]["value"][1] == "NaN"

    # Worker-level series: the labels are pool and worker (plus Prometheus' job and instance), nothing else.
    latency = query(prometheus, "dsec_worker_sync_latency_seconds")
    assert [float(r["value"][1]) for r in latency] == [pytest.approx(0.012)]
    for name in ("dsec_breaker_level", "dsec_worker_sync_latency_seconds", "dsec_worker_latency_cap_seconds"):
        rows = query(prometheus, name)
        assert rows, name
        assert {k for r in rows for k in r["metric"]} == {"__name__", "pool", "worker", "job", "instance"}

    # The rules loaded and evaluate without error (recording rules produce series once evaluated).
    wait_for(lambda: query(prometheus, "pool:dsec_breaker_level:max"), timeout=10, what="a recording rule's series")

    def rules() -> list[dict[str, Any]]:
        groups = prometheus.get("/api/v1/rules").json()["data"]["groups"]
        return [r for g in groups for r in g["rules"]]

    assert len(rules()) == 11
    assert all(r["health"] == "ok" for r in rules()), [(r["name"], r.get("lastError")) for r in rules()]
    # 199 of 200 syncs (99.5%) is under 99.95%: that alert goes pending (it fires after 5 minutes); no other one.
    wait_for(
        lambda: (
            {r["name"]: r["state"] for r in rules() if r["type"] == "alerting" and r["state"] != "inactive"}
            == {"DsecGradientSyncSuccessLow": "pending"}
        ),
        timeout=10,
        what="the sync-success alert pending, the others inactive",
    )
    pending = next(r for r in rules() if r["name"] == "DsecGradientSyncSuccessLow")["alerts"]
    assert [a["labels"]["pool"] for a in pending] == ["pool-a"]

    # Every Grafana panel query runs against the scraped data.
    for expr in dashboard_queries():
        query(prometheus, concrete(expr))
