"""Rich tables for the CLI and the demo, built from the API's JSON (so both show the same thing)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from dsec import telemetry

_STATE_STYLE = {"active": "green", "lost": "bold red", "deregistered": "dim"}

# Metrics shown in the status table when a worker reports them (first found wins per column).
_METRIC_COLUMNS: tuple[tuple[str, tuple[telemetry.Metric, ...]], ...] = (
    ("updates", (telemetry.UPDATES_TOTAL,)),
    ("step ms", (telemetry.STEP_MS_MEAN,)),
    ("sync p99 ms", (telemetry.SYNC_LATENCY_MS_P99,)),
    ("sync cost ms", (telemetry.SYNC_COST_MS_P50,)),
    ("bytes/sync", (telemetry.BYTES_PER_SYNC,)),
    ("grad norm", (telemetry.GRAD_NORM,)),
    ("env steps/s", (telemetry.ENV_STEPS_PER_S,)),
    ("return", (telemetry.EPISODE_RETURN_MEAN,)),
    ("mem GB", (telemetry.MEMORY_USED_GB,)),
)


def _metric(metrics: Mapping[str, float], keys: Sequence[telemetry.Metric]) -> str:
    for k in keys:
        if k.name in metrics:
            v = float(metrics[k.name])
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return "-"


def pools_table(status: Mapping[str, Any]) -> Table:
    t = Table(title="Pools", expand=False)
    for col in (
        "pool",
        "devices",
        "bw cap MB/s",
        "lat cap ms",
        "mem base/ceil GB",
        "snap s/lvl",
        "active",
        "lost",
        "pending",
        "meltdowns",
        "mem used/granted/cap GB",
    ):
        t.add_column(col, justify="right" if col != "pool" else "left")
    for p in status.get("pools", []):
        th = p["thresholds"]
        t.add_row(
            p["name"],
            str(len(p["devices"])),
            f"{th['bandwidth_cap_mbps']:g}",
            f"{th['latency_cap_ms']:g}",
            f"{p['memory_base_gb']:g}/{p['memory_ceiling_gb']:g}",
            f"{p['snapshot_interval_s']:g}/{p.get('snapshot_compression_level', 2)}",
            str(p["workers"]["active"]),
            str(p["workers"]["lost"]),
            str(p["directives_pending"]),
            str(p["meltdowns"]) + (" [yellow]pool slow" if p.get("sync_slowdown") else ""),
            _memory(p.get("memory")),
        )
    return t


def _memory(mem: Mapping[str, Any] | None) -> str:
    if not mem:
        return "-"
    cap = mem.get("capacity_gb")
    return f"{mem['used_gb']:.1f}/{mem['granted_gb']:.1f}/{'?' if cap is None else f'{cap:g}'}"


_PHASE_STYLE = {
    "closed": "green",
    "open": "bold red",
    "escalating": "red",
    "recovering": "yellow",
    "half_open": "yellow",
}


def workers_table(workers: Sequence[Mapping[str, Any]], now: float | None = None, title: str = "Workers") -> Table:
    now = time.time() if now is None else now
    t = Table(title=title, expand=False)
    for col in (
        "worker",
        "pool",
        "group",
        "role",
        "rank",
        "state",
        "beats",
        "last beat",
        "breaker",
        "bits/accum",
        "directive desired/acked",
        *(c for c, _ in _METRIC_COLUMNS),
    ):
        t.add_column(
            col,
            justify="left" if col in ("worker", "pool", "group", "role", "state") else "right",
            no_wrap=col in ("worker", "pool", "state"),  # ids must stay copyable from the table
        )
    for w in workers:
        d = w["directive"]
        sync = "[green]" if d["in_sync"] else "[yellow]"
        desired = d["desired"]
        bits = desired.get("compression_bits")
        degradation = f"{'default' if bits is None else f'{bits}b'}/x{desired['grad_accum_steps']}"
        if not desired.get("async_sampling", True):
            degradation += "/paused"
        b = w.get("breaker") or {}
        phase = b.get("phase", "closed")
        breaker = f"[{_PHASE_STYLE.get(phase, 'white')}]L{b.get('level', 0)} {phase}"
        if w.get("meltdowns"):
            breaker += f" ({w['meltdowns']}x)"
        t.add_row(
            w["id"],
            w["pool"],
            w["group"],
            w["role"],
            str(w["rank"]),
            f"[{_STATE_STYLE.get(w['state'], 'white')}]{w['state']}",
            str(w["beats"]),
            f"{max(0.0, now - w['last_beat_at']):.1f}s ago",
            breaker,
            degradation,
            f"{sync}v{d['desired_version']}/v{d['acked_version']}" + _unappliable(d.get("unappliable")),
            *(_metric(w["metrics"], keys) for _, keys in _METRIC_COLUMNS),
        )
    return t


def _unappliable(fields: Mapping[str, Any] | None) -> str:
    """Fields of the desired directive the worker answered it cannot carry out (``directive_unappliable``)."""
    if not fields:
        return ""
    return "".join(f"\n[red]unappliable {name}: {u.get('reason') or '?'}" for name, u in sorted(fields.items()))


def events_table(events: Sequence[Mapping[str, Any]], title: str = "Events") -> Table:
    t = Table(title=title, expand=False)
    for col in ("id", "time", "type", "worker", "pool", "data"):
        t.add_column(col)
    for e in events:
        data = ", ".join(f"{k}={v}" for k, v in e["data"].items())
        t.add_row(
            str(e["id"]),
            time.strftime("%H:%M:%S", time.localtime(e["ts"])),
            e["type"],
            e["worker_id"] or "-",
            e["pool"] or "-",
            data[:80],
        )
    return t
