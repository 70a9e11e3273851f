"""Rich tables for the CLI and the demo, built from the API's JSON (so both show the same thing).

Every listing has a default view that fits 100 columns and a ``wide`` view with every column. Id columns are as
wide as their longest id, so that when a table is too wide for the terminal rich narrows (wraps) the other columns
first; and they fold (``overflow="fold"``) rather than end in an ellipsis, so that on a very narrow terminal an id
wraps onto the next line but every character of it is printed. Text that comes from outside (ids, names, event
data, error messages) is passed as :class:`rich.text.Text`, so brackets in it are never read as markup.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Console, JustifyMethod, OverflowMethod, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from dsec import telemetry

Record = Mapping[str, Any]

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


@dataclass(frozen=True)
class _Col:
    """One column of a listing: its header, how a record fills it, and in which views it appears."""

    header: str
    cell: Callable[[Record], RenderableType]
    justify: JustifyMethod = "left"
    ident: bool = False  # an id or name people copy: as wide as the longest, folded, never cut
    overflow: OverflowMethod = "ellipsis"
    default: bool = True  # in the default (narrow) view; every column is in the wide view
    drop: int = 0  # > 0: the default view leaves it out when the terminal is too narrow, highest first


def _cell_len(cell: RenderableType) -> int:
    return cell.cell_len if isinstance(cell, Text) else Text.from_markup(cell).cell_len if isinstance(cell, str) else 0


def _table(
    title: str | None, cols: Sequence[_Col], records: Sequence[Record], wide: bool, width: int | None = None
) -> Table:
    """The wide view has every column; the default view its ``default`` ones, less those marked ``drop`` (highest
    first) while the table is wider than ``width``."""
    shown = [c for c in cols if wide or c.default]
    table = _build(title, shown, records)
    droppable = sorted((c for c in shown if c.drop), key=lambda c: -c.drop)
    while not wide and width is not None and droppable and _natural_width(table) > width:
        shown.remove(droppable.pop(0))
        table = _build(title, shown, records)
    return table


def _build(title: str | None, shown: Sequence[_Col], records: Sequence[Record]) -> Table:
    rows = [[c.cell(r) for c in shown] for r in records]
    t = Table(title=title, expand=False)
    for i, c in enumerate(shown):
        if c.ident:
            # A fixed width keeps rich's first way to fit a wide table (wrapping the widest columns) off the ids.
            width = max([cell_len(c.header), *(_cell_len(r[i]) for r in rows)])
            t.add_column(c.header, justify=c.justify, width=width, overflow="fold")
        else:
            t.add_column(c.header, justify=c.justify, overflow=c.overflow)
    for row in rows:
        t.add_row(*row)
    return t


def _natural_width(table: Table) -> int:
    console = Console(width=10_000)
    return Measurement.get(console, console.options, table).maximum


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


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


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


def _amount(v: float) -> str:
    """Hours and prices: whole above 100, three significant digits below (a minute of one device is 0.0167)."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _hours(key: str) -> Callable[[Record], str]:
    return lambda r: _amount(r["device_hours"][key])


def _share(key: str) -> Callable[[Record], str]:
    def cell(r: Record) -> str:
        total = r["device_hours"]["total"]
        return f"{100 * r['device_hours'][key] / total:.0f}%" if total > 0 else "-"

    return cell


_COST_COLUMNS = (
    _Col("pool", lambda r: Text(r["pool"]), ident=True),
    _Col("group", lambda r: Text(r.get("group") or "*"), ident=True, default=False),
    _Col("workers", lambda r: str(r["workers"]), "right", drop=1),
    _Col("device-h", _hours("total"), "right"),
    _Col("useful", _share("useful"), "right"),
    _Col("degraded", _share("degraded"), "right"),
    _Col("recovering", _share("recovering"), "right"),
    _Col("idle", _share("idle"), "right"),
    _Col("useful h", _hours("useful"), "right", default=False),
    _Col("degraded h", _hours("degraded"), "right", default=False),
    _Col("recovering h", _hours("recovering"), "right", default=False),
    _Col("idle h", _hours("idle"), "right", default=False),
    _Col("cost", lambda r: _amount(r["cost"]["total"]), "right"),
    _Col("snap MiB", lambda r: _mib((r.get("implicit") or {}).get("snapshots", {}).get("bytes")), "right", drop=3),
)


def cost_rows(report: Mapping[str, Any], *, groups: bool = False) -> list[dict[str, Any]]:
    """The table's rows of a ``GET /v1/cost`` answer: one per pool (``group`` None), each followed by its groups'
    when ``groups``."""
    rows: list[dict[str, Any]] = []
    for p in report["pools"]:
        rows.append({**p, "group": None})
        if groups:
            for name, g in p["groups"].items():
                rows.append({"pool": p["pool"], "group": name, **g})
    return rows


def cost_table(report: Mapping[str, Any], *, wide: bool = False, width: int | None = None) -> Table:
    """Device-hours per pool over the report's window, the share of each phase and the price (``wide``: each
    group's row too and the hours of each phase)."""
    span = (report["until"] - report["since"]) / 3600
    title = f"cost over {span:.2f} h at {report['price_per_device_hour']:g} per device-hour"
    return _table(title, _COST_COLUMNS, cost_rows(report, groups=wide), wide, width)


def cost_summary(report: Mapping[str, Any]) -> list[str]:
    """The lines under the cost table: totals, DSec's own overhead, the opportunity cost, what is estimated."""
    h, cost = report["device_hours"], report["cost"]
    lines = [
        f"total: {_amount(h['total'])} device-h (useful {_amount(h['useful'])}, degraded {_amount(h['degraded'])}, "
        f"recovering {_amount(h['recovering'])}, idle {_amount(h['idle'])}); cost {_amount(cost['total'])}"
    ]
    proc = report["implicit"]["process"]
    if proc:
        lines.append(
            f"control plane: {proc['cpu_s']:.1f} CPU s over {proc['uptime_s'] / 3600:.2f} h up, "
            f"RSS {_mib(proc['rss_bytes'])} MiB; probe overhead per step: not reported"
        )
    for p in report["pools"]:
        opp = p["opportunity"]
        rec = opp["recoveries"]
        parts = []
        if opp["degraded_steps"] is not None:
            parts.append(f"~{opp['degraded_steps']:.0f} steps degraded (estimate)")
        for t in opp["throughput"]:
            d = t["degraded_minus_useful"]
            if d["mean"] is not None:
                ci = f" [{d['ci95'][0]:.3g}, {d['ci95'][1]:.3g}]" if d["ci95"] else ""
                parts.append(f"{t['worker']} degraded-useful {d['mean']:+.3g} steps/s{ci} (n={d['n']})")
        if rec.get("saved_device_hours_estimate") is not None:
            parts.append(f"heals saved ~{rec['saved_device_hours_estimate']:.3f} device-h vs restarts (estimate)")
        if parts:
            lines.append(f"{p['pool']}: " + "; ".join(parts))
    lines += [f"estimated: {e}" for e in report["estimated"]]
    return lines
