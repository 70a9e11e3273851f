"""``dsec top``'s drawing: a frame and a worker's detail as rich renderables that fit the terminal (ids never cut)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from dsec import telemetry
from dsec.cli_common import (
    PIPE_WIDTH,
)
from dsec.render import PHASE_STYLE, STATE_STYLE, events_table
from dsec.top.frame import DETAIL_EVENTS, SYNC_SUCCESS_FLOOR, Record, worker_row
from dsec.top.keys import ViewState


# -- drawing ---------------------------------------------------------------------------------------------------
def _ago(now: float | None, ts: float | None) -> str:
    if ts is None or now is None:
        return ""
    s = max(0.0, now - ts)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    return (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}") + unit


def _pct(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v * 100:.{digits}f}%"


def headline_text(h: Record, width: int = PIPE_WIDTH) -> Text:
    """A pool's headline gauges on one line, or on more where ``width`` is too narrow: broken between gauges,
    never inside one."""
    sync = h["sync_success"]
    first = Text(h["pool"], style="bold")
    if not h["known"]:
        first.append(" (no such pool)", style="red")
    parts = [first]
    for label, value, style in (
        ("util", _pct(h["utilization"], 0), ""),
        ("sync ok", _pct(sync, 2), "red" if sync is not None and sync < SYNC_SUCCESS_FLOOR else ""),
        ("recovery", _num(h["recovery_s"], "s"), ""),
        ("meltdowns", str(h["meltdowns"]), "yellow" if h["meltdowns"] else ""),
        ("active", str(h["active"]), ""),
        ("lost", str(h["lost"]), "bold red" if h["lost"] else ""),
        ("pending", str(h["directives_pending"]), "yellow" if h["directives_pending"] else ""),
    ):
        parts.append(Text(f"{label} ").append(value, style=style))
    if h["sync_slowdown"]:
        parts.append(Text("pool slow", style="yellow"))
    out = Text(overflow="fold")
    line = 0
    for i, part in enumerate(parts):
        if i and line + 2 + part.cell_len > width:
            out.append("\n")
            line = 0
        elif i:
            out.append("  ")
            line += 2
        out.append_text(part)
        line += part.cell_len
    return out


def _breaker_cell(r: Record) -> Text:
    if r["state"] == "lost":
        return Text("lost", style=STATE_STYLE["lost"])
    return Text(f"L{r['level']} {r['phase']}", style=PHASE_STYLE.get(r["phase"], ""))


def _ratio_cell(used: float | None, limit: float | None, over: bool) -> Text:
    if used is None and limit is None:
        return Text("-")
    return Text(f"{_num(used)}/{_num(limit)}", style="red" if over else "")


# Columns the table leaves out, in this order, while it is wider than the terminal (the id never goes, nor is cut).
_DROP_ORDER = ("step ms", "role", "last event")
_LAST_EVENT_MIN = 12


def workers_view(frame: Record, selected: int | None = None, width: int = PIPE_WIDTH) -> Table:
    """The rows of a frame: the worker id column as wide as the longest id (never cut), the last event taking what
    is left, on one line; where ``width`` is too narrow, step time, role and last event are left out (in that
    order)."""
    rows = frame["workers"]
    now = frame.get("server_time")
    cells: dict[str, list[RenderableType]] = {
        "worker": [Text(r["id"], style="bold red" if r["state"] == "lost" else "") for r in rows],
        "role": [r["role"] for r in rows],
        "breaker": [_breaker_cell(r) for r in rows],
        "sync/cap ms": [_ratio_cell(r["sync_ms"], r["cap_ms"], r["sync_over_cap"]) for r in rows],
        "step ms": [_num(r["step_ms"]) for r in rows],
        "mem/quota GB": [_ratio_cell(r["mem_used_gb"], r["mem_quota_gb"], r["memory_over_quota"]) for r in rows],
        "last event": [
            Text(f"{r['last_event']} {_ago(now, r['last_event_at'])}" if r["last_event"] else "-") for r in rows
        ],
    }
    id_width = max([6, *(len(r["id"]) for r in rows)])

    def build(shown: Sequence[str], measuring: bool) -> Table:
        t = Table(expand=not measuring)
        for name in shown:
            if name == "worker":
                t.add_column(name, width=id_width, overflow="fold")
            elif name == "last event":
                t.add_column(name, ratio=1, no_wrap=True, overflow="ellipsis", min_width=_LAST_EVENT_MIN)
            else:
                t.add_column(name, justify="left" if name in ("role", "breaker") else "right", no_wrap=True)
        for i in range(len(rows)):
            row = [
                Text("") if measuring and name == "last event" else cells[name][i]  # it takes what is left
                for name in shown
            ]
            t.add_row(*row, style="reverse" if i == selected else None)
        return t

    shown = list(cells)
    for name in _DROP_ORDER:
        if _natural_width(build(shown, measuring=True)) <= width:
            break
        shown.remove(name)
    return build(shown, measuring=False)


def _natural_width(table: Table) -> int:
    console = Console(width=10_000)
    return Measurement.get(console, console.options, table).maximum


def frame_view(
    frame: Record,
    *,
    state: ViewState | None = None,
    live: bool = False,
    width: int = PIPE_WIDTH,
    height: int | None = None,
) -> Group:
    """A frame drawn: a title line, each pool's headline, the workers, the recent events (and, live, the keys).
    With ``height`` (a live screen), the rows are a window that holds the selected one and leaves the events room."""
    scope = frame["scope"]
    rows = frame["workers"]
    title = Text("dsec top", style="bold")
    for label in ("pool", "group"):
        if scope[label]:
            title.append(f"  {label} {scope[label]}")
    match = state.match if state is not None else scope["filter"] or ""
    if match or (state is not None and state.editing):
        title.append(f"  filter {match}" + ("_" if state is not None and state.editing else ""), style="cyan")
    troubled = sum(1 for r in rows if r["troubled"])
    title.append(f"  {len(rows)} workers, {troubled} troubled", style="red" if troubled else "")
    if frame.get("server_time") is not None:
        title.append("  " + time.strftime("%H:%M:%S", time.localtime(frame["server_time"])), style="dim")
    heads = [headline_text(h, width) for h in frame["pools"]]
    parts: list[RenderableType] = [title, *heads]
    selected = state.selected if state is not None and live else None
    window = frame
    fixed = 1 + sum(h.plain.count("\n") + 1 for h in heads) + 4 + (len(frame["events"]) + 5 if frame["events"] else 0)
    room = None if height is None else max(1, height - fixed - 2)
    if room is not None and len(rows) > room:
        start = min(max((selected or 0) - room + 1, 0), len(rows) - room)
        window = {**frame, "workers": rows[start : start + room]}
        selected = None if selected is None else selected - start
        parts.append(workers_view(window, selected, width))
        parts.append(Text(f"rows {start + 1}-{start + room} of {len(rows)} (j/k to scroll, / to filter)", style="dim"))
    else:
        parts.append(workers_view(window, selected, width))
    if frame["events"]:
        parts.append(events_table(frame["events"], title="Recent events"))
    if live:
        parts.append(Text("q quit  / filter  j/k select  Enter detail  Esc clear", style="dim"))
    return Group(*parts)


def detail_frame(worker: Record, directive: Record, events: Sequence[Record]) -> dict[str, Any]:
    """One worker's detail as plain data: its record, its directive desired vs acked (with the caps in force),
    its latest events."""
    return {"worker": dict(worker), "directive": dict(directive), "events": list(events[-DETAIL_EVENTS:])}


def _kv_table(title: str, items: Sequence[tuple[str, RenderableType]]) -> Table:
    t = Table(title=title, title_justify="left", show_header=False, expand=False)
    t.add_column("field", style="dim", no_wrap=True)
    t.add_column("value", overflow="fold")
    for k, v in items:
        t.add_row(k, v)
    return t


def _plain(v: Any) -> Text:
    if isinstance(v, float):
        return Text(f"{v:.6g}")
    return Text("-" if v is None else str(v))


def detail_view(d: Record, *, live: bool = False) -> Group:
    """A worker's detail drawn: identity and breaker, the directive desired vs acked, every metric, recent events."""
    w, dv = d["worker"], d["directive"]
    b = w.get("breaker") or {}
    row = worker_row(w)
    head = Text("worker ", style="bold")
    head.append(w["id"], style="bold")
    head.append(f"  {w['state']}", style=STATE_STYLE.get(w["state"], ""))
    ident = _kv_table(
        "Worker",
        [
            ("pool / group / rank", Text(f"{w['pool']} / {w.get('group')} / {w.get('rank')}")),
            ("role", Text(str(w.get("role")))),
            ("host / pid / device", Text(f"{w.get('host') or '-'} / {w.get('pid')} / {w.get('device') or '-'}")),
            ("beats / last seq", Text(f"{w.get('beats')} / {w.get('last_seq')}")),
            ("breaker", Text(f"L{row.level} {row.phase}", style=PHASE_STYLE.get(row.phase, ""))),
            ("causes", Text(", ".join(b.get("causes") or []) or "-")),
            ("meltdowns / relapses", Text(f"{w.get('meltdowns', 0)} / {b.get('relapses', 0)}")),
            ("fleet outlier", Text(", ".join(w.get("fleet_outlier") or []) or "-")),
            ("sync vs cap ms", _ratio_cell(row.sync_ms, row.cap_ms, bool(row.sync_over))),
            ("memory vs quota GB", _ratio_cell(row.mem_used_gb, row.mem_quota_gb, bool(row.mem_over))),
        ],
    )
    in_sync = dv.get("in_sync")
    versions = Text(f"desired v{dv.get('desired_version')}  acked v{dv.get('acked_version')}")
    versions.append("  in sync" if in_sync else "  not acked yet", style="green" if in_sync else "yellow")
    fields: list[tuple[str, RenderableType]] = [("versions", versions)]
    fields += [(k, _plain(v)) for k, v in (dv.get("desired") or {}).items() if k not in ("version", "updated_at")]
    fields += [(f"cap {k}", _plain(v)) for k, v in (dv.get("caps") or {}).items()]
    fields += [
        (f"unappliable {k}", Text(str((u or {}).get("reason") or "?"), style="red"))
        for k, u in sorted((dv.get("unappliable") or {}).items())
    ]
    metrics = Table(title="Metrics", title_justify="left", expand=False)
    metrics.add_column("metric", no_wrap=True)
    metrics.add_column("value", justify="right", no_wrap=True)
    metrics.add_column("unit", style="dim", no_wrap=True)
    for name, value in sorted((w.get("metrics") or {}).items()):
        m = telemetry.lookup(name)
        metrics.add_row(Text(name), _plain(value), m.unit if m is not None else "")
    parts: list[RenderableType] = [head, ident, _kv_table("Directive (desired vs acked)", fields), metrics]
    if d["events"]:
        parts.append(events_table(d["events"], title="Recent events"))
    if live:
        parts.append(Text("Esc/Enter back  q quit", style="dim"))
    return Group(*parts)
