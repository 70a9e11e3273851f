"""Rich tables for the CLI and the demo, built from the API's JSON (so both show the same thing).

Every listing has a default view that fits 100 columns and a ``wide`` view with every column. Id columns are as
wide as their longest id, so that when a table is too wide for the terminal rich narrows (wraps) the other columns
first; and they fold (``overflow="fold"``) rather than end in an ellipsis, so that on a very narrow terminal an id
wraps onto the next line but every character of it is printed. Text that comes from outside (ids, names, event
data, error messages) is passed as :class:`rich.text.Text`, so brackets in it are never read as markup.

How a listing is laid out is in :mod:`dsec.render_table`; the cost listing in :mod:`dsec.render_cost` (its names
are importable from here).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from dsec import telemetry
from dsec.render_cost import cost_rows as cost_rows
from dsec.render_cost import cost_summary as cost_summary
from dsec.render_cost import cost_table as cost_table
from dsec.render_table import Record, _Col, _mib, _table

STATE_STYLE = {"active": "green", "lost": "bold red", "deregistered": "dim"}

# Metrics shown in the wide workers table when a worker reports them (first found wins per column).
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


def _metric_cell(keys: Sequence[telemetry.Metric]) -> Callable[[Record], str]:
    return lambda w: _metric(w["metrics"], keys)


def _memory(mem: Mapping[str, Any] | None) -> str:
    if not mem:
        return "-"
    cap = mem.get("capacity_gb")
    return f"{mem['used_gb']:.1f}/{mem['granted_gb']:.1f}/{'?' if cap is None else f'{cap:g}'}"


_POOL_COLUMNS = (
    _Col("pool", lambda p: Text(p["name"]), ident=True),
    _Col("devices", lambda p: str(len(p["devices"])), "right"),
    _Col("bw cap MB/s", lambda p: f"{p['thresholds']['bandwidth_cap_mbps']:g}", "right", default=False),
    _Col("lat cap ms", lambda p: f"{p['thresholds']['latency_cap_ms']:g}", "right", default=False),
    _Col("mem base/ceil GB", lambda p: f"{p['memory_base_gb']:g}/{p['memory_ceiling_gb']:g}", "right", default=False),
    _Col(
        "snap s/lvl",
        lambda p: f"{p['snapshot_interval_s']:g}/{p.get('snapshot_compression_level', 2)}",
        "right",
        default=False,
    ),
    _Col("active", lambda p: str(p["workers"]["active"]), "right"),
    _Col("lost", lambda p: str(p["workers"]["lost"]), "right"),
    _Col("pending", lambda p: str(p["directives_pending"]), "right", drop=1),
    _Col(
        "meltdowns", lambda p: str(p["meltdowns"]) + (" [yellow]pool slow" if p.get("sync_slowdown") else ""), "right"
    ),
    _Col("mem used/granted/cap GB", lambda p: _memory(p.get("memory")), "right"),
)


def pools_table(status: Mapping[str, Any], *, wide: bool = False, width: int | None = None) -> Table:
    """Default: workers, directives and memory per pool (fitted to ``width``); ``wide`` adds the pool's thresholds
    and snapshot settings."""
    return _table("Pools", _POOL_COLUMNS, status.get("pools", []), wide, width)


PHASE_STYLE = {
    "closed": "green",
    "open": "bold red",
    "escalating": "red",
    "recovering": "yellow",
    "half_open": "yellow",
}


def _degradation(w: Record) -> str:
    desired = w["directive"]["desired"]
    bits = desired.get("compression_bits")
    text = f"{'default' if bits is None else f'{bits}b'}/x{desired['grad_accum_steps']}"
    return text if desired.get("async_sampling", True) else text + "/paused"


def _versions(w: Record) -> str:
    d = w["directive"]
    return f"{'[green]' if d['in_sync'] else '[yellow]'}v{d['desired_version']}/v{d['acked_version']}"


def _breaker(w: Record) -> str:
    b = w.get("breaker") or {}
    phase = b.get("phase", "closed")
    text = f"[{PHASE_STYLE.get(phase, 'white')}]L{b.get('level', 0)} {phase}"
    return text + (f" ({w['meltdowns']}x)" if w.get("meltdowns") else "")


def _unappliable(fields: Mapping[str, Any] | None) -> str:
    """Fields of the desired directive the worker answered it cannot carry out (``directive_unappliable``)."""
    if not fields:
        return ""
    return "".join(f"\n[red]unappliable {name}: {u.get('reason') or '?'}" for name, u in sorted(fields.items()))


def _worker_columns(now: float) -> tuple[_Col, ...]:
    return (
        _Col("worker", lambda w: Text(w["id"]), ident=True),
        _Col("pool", lambda w: Text(w["pool"]), ident=True),
        _Col("group", lambda w: Text(w["group"]), ident=True, default=False),
        _Col("role", lambda w: w["role"], drop=1),
        _Col("rank", lambda w: str(w["rank"]), "right", default=False),
        _Col("state", lambda w: f"[{STATE_STYLE.get(w['state'], 'white')}]{w['state']}"),
        _Col("beats", lambda w: str(w["beats"]), "right", default=False),
        _Col("last beat", lambda w: f"{max(0.0, now - w['last_beat_at']):.1f}s ago", "right", drop=2),
        _Col("breaker", _breaker, "right"),
        # The default view folds degradation and directive versions into one column.
        _Col(
            "directive",
            lambda w: f"{_versions(w)} {_degradation(w)}" + _unappliable(w["directive"].get("unappliable")),
            "right",
        ),
        _Col("bits/accum", _degradation, "right", default=False),
        _Col(
            "directive desired/acked",
            lambda w: _versions(w) + _unappliable(w["directive"].get("unappliable")),
            "right",
            default=False,
        ),
        *(_Col(name, _metric_cell(keys), "right", default=name == "step ms", drop=3) for name, keys in _METRIC_COLUMNS),
    )


def workers_table(
    workers: Sequence[Record],
    now: float | None = None,
    title: str = "Workers",
    *,
    wide: bool = False,
    width: int | None = None,
) -> Table:
    """Default: id, pool, role, state, last beat, breaker, directive (versions and degradation), step time, less
    step time, last beat and role (in that order) where ``width`` is too narrow for them; ``wide``: group, rank,
    beats, the directive split in two, and every metric column."""
    cols = _worker_columns(time.time() if now is None else now)
    if wide:
        cols = tuple(c for c in cols if c.header != "directive")
    return _table(title, cols, workers, wide, width)


def _event_data(e: Record) -> Text:
    return Text(", ".join(f"{k}={v}" for k, v in e["data"].items()))


def events_table(events: Sequence[Record], title: str = "Events", *, wide: bool = False) -> Table:
    """Default: one line per event, its data cut to the room left (``--json`` has all of it); ``wide``: the date,
    the pool, and the whole data, wrapped."""
    if wide:
        cols = (
            _Col("id", lambda e: str(e["id"]), "right"),
            _Col("time", lambda e: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["ts"]))),
            _Col("type", lambda e: e["type"]),
            _Col("worker", lambda e: Text(e["worker_id"] or "-"), ident=True),
            _Col("pool", lambda e: Text(e["pool"] or "-"), ident=True),
            _Col("data", _event_data, overflow="fold"),
        )
        return _table(title, cols, events, wide=True)
    # The data column takes whatever width the others leave (expand + ratio), on one line, cut with an ellipsis.
    t = Table(title=title, expand=True)
    t.add_column("id", justify="right", no_wrap=True)
    t.add_column("time", no_wrap=True)
    t.add_column("type", no_wrap=True)
    t.add_column("worker", width=max([6, *(len(e["worker_id"] or "-") for e in events)]), overflow="fold")
    t.add_column("data", ratio=1, no_wrap=True, overflow="ellipsis")
    for e in events:
        t.add_row(
            str(e["id"]),
            time.strftime("%H:%M:%S", time.localtime(e["ts"])),
            e["type"],
            Text(e["worker_id"] or "-"),
            _event_data(e),
        )
    return t


def _snapshot_cell(key: str, fmt: Callable[[Any], str]) -> Callable[[Record], RenderableType]:
    """A row of ``dsec.snapshot.listing``; an unreadable manifest has only ``id`` and ``error``."""

    def cell(r: Record) -> RenderableType:
        return "" if "error" in r else fmt(r[key])

    return cell


_SNAPSHOT_COLUMNS = (
    _Col("id", lambda r: Text(r["id"]), ident=True),
    _Col("kind", lambda r: "[red]unreadable[/red]" if "error" in r else r["kind"]),
    _Col("base", _snapshot_cell("base", str), "right", default=False),
    _Col("step", _snapshot_cell("step", str), "right"),
    _Col("mode", _snapshot_cell("mode", str), drop=1),
    _Col("full MiB", _snapshot_cell("full_bytes", _mib), "right", default=False),
    _Col("stored MiB", _snapshot_cell("stored_bytes", _mib), "right"),
    _Col("blocking ms", _snapshot_cell("blocking_ms", lambda v: f"{v:.1f}"), "right", drop=2),
    _Col("total ms", _snapshot_cell("total_ms", lambda v: f"{v:.0f}"), "right", default=False),
)


def snapshots_table(rows: Sequence[Record], *, wide: bool = False, width: int | None = None) -> Table:
    """Rows of ``dsec.snapshot.listing``. Default: id, kind, step, mode, stored size, blocking time (less blocking
    time, then mode, where ``width`` is too narrow); ``wide`` adds the base, the full size and the total time.
    An unreadable manifest is a row of kind ``unreadable``; its error is for the caller to print in full."""
    return _table(None, _SNAPSHOT_COLUMNS, rows, wide, width)


_PLACEMENT_COLUMNS = (
    _Col("worker", lambda a: Text(a["worker"]), ident=True),
    _Col("group", lambda a: Text(a["group"]), ident=True, default=False),
    _Col("role", lambda a: a["role"], drop=1),
    _Col("device", lambda a: Text(a["device"]), ident=True),
    _Col("node", lambda a: Text(a["node"]), ident=True),
    _Col("numa", lambda a: str(a["numa_node"]), "right", default=False),
    _Col("score", lambda a: f"{a['score']:g}", "right"),
    _Col("terms", lambda a: ", ".join(f"{k} {v:+g}" for k, v in a["terms"].items() if v)),
)


def placement_table(p: Mapping[str, Any], *, wide: bool = False, width: int | None = None) -> Table:
    """A placement (``Placement.to_dict``): each worker's device and the terms of its score; ``wide`` adds the
    group and the NUMA node."""
    title = f"placement of {p['job']}: score {p['score']:g}" + ("" if p["complete"] else " (INCOMPLETE)")
    return _table(title, _PLACEMENT_COLUMNS, p["assignments"], wide, width)


# Past this many devices excluded for one reason, the default view counts them instead of naming them.
_NAMED_EXCLUSIONS = 3


def excluded_summary(excluded: Mapping[str, str], *, wide: bool = False) -> str:
    """``excluded: 14 devices (not in the pool); gpu-03 (device is degraded)``: the devices a placement left out,
    grouped by reason; ``wide`` names every device."""
    by_reason: dict[str, list[str]] = {}
    for device, why in excluded.items():
        by_reason.setdefault(why, []).append(device)
    parts = [
        f"{', '.join(devices)} ({why})"
        if wide or len(devices) <= _NAMED_EXCLUSIONS
        else f"{len(devices)} devices ({why})"
        for why, devices in by_reason.items()
    ]
    return "excluded: " + "; ".join(parts)
