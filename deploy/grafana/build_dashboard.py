"""Writes deploy/grafana/dsec.json: the Grafana dashboard over DSec's Prometheus metrics (docs/observability.md).

Plain Python (no dependency): the panels are a list below; ``python deploy/grafana/build_dashboard.py`` rewrites the
JSON, and tests/integration/test_prometheus_rules.py fails when the committed file differs from what this writes or
when a query names a metric DSec does not expose (the names come from ``dsec.telemetry``) or a recording rule that
deploy/prometheus/dsec-rules.yml does not define.

The datasource is a dashboard variable (``$datasource``), so the file imports as is (Dashboards -> New -> Import) and
provisions as is (a file provider pointing at this folder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("dsec.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
POOL = 'pool=~"$pool"'
WORKER = 'pool=~"$pool", worker=~"$worker"'


def target(expr: str, legend: str, ref: str = "A") -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in steps]}


def panel(
    kind: str,
    title: str,
    targets: list[dict[str, Any]],
    grid: tuple[int, int, int, int],
    unit: str = "short",
    description: str = "",
    steps: tuple[tuple[float | None, str], ...] = ((None, "green"),),
    custom: dict[str, Any] | None = None,
    overrides: list[dict[str, Any]] | None = None,
    options: dict[str, Any] | None = None,
    **defaults: Any,
) -> dict[str, Any]:
    x, y, w, h = grid
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": thresholds(*steps),
                "custom": custom or {},
                **{k: v for k, v in defaults.items() if v is not None},
            },
            "overrides": overrides or [],
        },
        "options": options or {},
    }


def row(title: str, y: int) -> dict[str, Any]:
    return {
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
        "panels": [],
    }


LINES = {"drawStyle": "line", "lineWidth": 2, "fillOpacity": 0, "showPoints": "never", "spanNulls": False}
STEPS = {**LINES, "lineInterpolation": "stepAfter"}
LEGEND = {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]}}
STAT = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "background"}


def panels() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [row("Headline gauges per pool", 0)]
    headline = (
        ("Sandbox utilization", "dsec_sandbox_utilization_rate", "percentunit", ((None, "green"), (0.9, "orange"),
         (1.0, "red")), "Mean over the pool's active workers of memory used / memory quota."),
        ("Gradient sync success", "dsec_gradient_sync_success_rate", "percentunit", ((None, "red"), (0.9995, "green")),
         "Share of gradient syncs within the latency cap without error (alert under 99.95%)."),
        ("Snapshot recovery time", "dsec_snapshot_recovery_time", "s", ((None, "green"), (5, "red")),
         "Lower median of the workers' latest restore times (alert over 5 s)."),
        ("Meltdowns", "dsec_melt_down_count", "short", ((None, "green"), (1, "orange")),
         "Entries into degradation since the store was created (a gauge that only grows)."),
    )  # fmt: skip
    for i, (title, metric, unit, steps, text) in enumerate(headline):
        out.append(
            panel("stat", title, [target(f"{metric}{{{POOL}}}", "{{pool}}")], (6 * i, 1, 6, 4), unit, text, steps,
                  options={**STAT, "textMode": "value_and_name"}, decimals=3 if unit == "percentunit" else None)
        )  # fmt: skip
    for i, (title, metric, unit, steps, text) in enumerate(headline):
        expr = f"increase({metric}{{{POOL}}}[$__rate_interval])" if metric == "dsec_melt_down_count" else None
        out.append(
            panel("timeseries", title + (" (increase)" if expr else ""),
                  [target(expr or f"{metric}{{{POOL}}}", "{{pool}}")], (6 * i, 5, 6, 7), unit, text, steps,
                  custom={**(STEPS if expr else LINES), "thresholdsStyle": {"mode": "line"}})
        )  # fmt: skip

    out.append(row("Circuit breakers", 12))
    out.append(
        panel("timeseries", "Breaker level per worker",
              [target(f"dsec_breaker_level{{{WORKER}}}", "{{pool}} {{worker}}")], (0, 13, 12, 8), "short",
              "0 healthy, 1 4-bit compression, 2 + gradient accumulation, 3 + sampling paused (active workers).",
              ((None, "green"), (1, "orange"), (3, "red")), custom=STEPS, options=LEGEND, min=0, max=3, decimals=0)
    )  # fmt: skip
    out.append(
        panel("timeseries", "Workers degraded and meltdowns in 15 min per pool",
              [target(f"pool:dsec_workers_degraded:count{{{POOL}}}", "{{pool}} degraded"),
               target(f"pool:dsec_meltdowns:increase15m{{{POOL}}}", "{{pool}} meltdowns / 15 min")],
              (12, 13, 12, 8), "short", "From the recording rules in deploy/prometheus/dsec-rules.yml.",
              custom=STEPS, options=LEGEND, min=0)
    )  # fmt: skip

    out.append(row("Sync latency vs caps", 21))
    out.append(
        panel("timeseries", "Sync latency vs cap per worker",
              [target(f"dsec_worker_sync_latency_seconds{{{WORKER}}}", "{{worker}} latency"),
               target(f"dsec_worker_latency_cap_seconds{{{WORKER}}}", "{{worker}} cap")],
              (0, 22, 16, 9), "s",
              "The breaker's latency signal (sync cost p50, else sync latency p50) against the cap in force.",
              custom=LINES, options=LEGEND, min=0,
              overrides=[{"matcher": {"id": "byRegexp", "options": ".* cap"},
                          "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [8, 4]}},
                                         {"id": "custom.lineWidth", "value": 1}]}])
    )  # fmt: skip
    out.append(
        panel("timeseries", "Worst latency / cap per pool",
              [target(f"pool:dsec_worker_sync_latency_over_cap:max{{{POOL}}}", "{{pool}}")], (16, 22, 8, 9),
              "percentunit", "Over 100%: some worker's sync is slower than its cap.",
              ((None, "green"), (1, "red")), custom={**LINES, "thresholdsStyle": {"mode": "line"}}, min=0)
    )  # fmt: skip

    out.append(row("Quotas and workers", 31))
    out.append(
        panel("timeseries", "Pool memory: used, granted, capacity",
              [target(f"dsec_pool_memory_gb{{{POOL}}}", "{{pool}} {{kind}}")], (0, 32, 12, 8), "decgbytes",
              "The elastic quotas' accounting per pool (GB).", custom=LINES, options=LEGEND, min=0)
    )  # fmt: skip
    out.append(
        panel("timeseries", "Workers by state",
              [target(f"dsec_workers{{{POOL}}}", "{{pool}} {{state}}"),
               target(f"dsec_directives_pending{{{POOL}}}", "{{pool}} directives pending")],
              (12, 32, 12, 8), "short", "Registered workers per state; directives not acked yet.",
              custom=STEPS, options=LEGEND, min=0, decimals=0)
    )  # fmt: skip
    out.append(
        panel("timeseries", "Heartbeats per second",
              [target(f"sum by (pool) (rate(dsec_heartbeats_total{{{POOL}}}[$__rate_interval]))", "{{pool}}")],
              (0, 40, 12, 7), "reqps", "Heartbeats the control plane applied.", custom=LINES, min=0)
    )  # fmt: skip
    out.append(
        panel("timeseries", "Control plane request latency p99",
              [target("histogram_quantile(0.99, sum by (le, route) "
                      "(rate(dsec_http_request_duration_seconds_bucket[$__rate_interval])))", "{{route}}")],
              (12, 40, 12, 7), "s", "Per route template.", custom=LINES, options=LEGEND, min=0)
    )  # fmt: skip
    for i, p in enumerate(out):
        p["id"] = i + 1
    return out


def variable(name: str, query: str, label: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    return {
        "title": "DSec",
        "uid": "dsec-overview",
        "description": "DSec control plane: headline gauges per pool, circuit breakers, sync latency vs caps, quotas.",
        "tags": ["dsec", "training"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "links": [],
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                },
                variable("pool", "label_values(dsec_workers, pool)", "pool"),
                variable("worker", 'label_values(dsec_breaker_level{pool=~"$pool"}, worker)', "worker"),
            ]
        },
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if OUT.read_text() == render() else 1)
    OUT.write_text(render())
    print(f"wrote {OUT}")
