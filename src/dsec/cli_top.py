"""``dsec top``: a live terminal view of one pool (or worker group), its most troubled workers first.

Everything comes from the read API (``GET /v1/status``, ``/v1/events``, ``/v1/workers/{id}``,
``/v1/workers/{id}/directive``) and the headline gauges from ``GET /metrics``, so a read-only token is enough.
The pure part (:func:`worker_row`, :func:`build_rows`, :func:`build_frame`, :class:`ViewState`) turns API records
into rows and keys into view changes; the rest fetches, draws and reads the keyboard.
"""

from __future__ import annotations

import math
import os
import select
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass
from typing import Annotated, Any, TextIO

import typer
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from dsec import telemetry
from dsec.cli_common import (
    DEFAULT_ENDPOINT,
    PIPE_WIDTH,
    AsJson,
    Endpoint,
    ReadToken,
    admin_client,
    fail,
    print_json,
    stdout_console,
)
from dsec.client import ApiError, Client, ClientError
from dsec.model import EventType
from dsec.render import PHASE_STYLE, STATE_STYLE, events_table

Record = Mapping[str, Any]

# Breaker phases, the most troubled first once levels are equal.
PHASE_RANK = {"open": 4, "escalating": 3, "half_open": 2, "recovering": 1, "closed": 0}
# Left out of the view: every ack of every directive, and worker log lines, would bury the rest.
QUIET_EVENTS = frozenset({EventType.DIRECTIVE_ACKED.value, EventType.LOG.value})
SHOWN_EVENTS = tuple(t.value for t in EventType if t.value not in QUIET_EVENTS)
# Sync figure shown against the latency cap: what the rank cost its group if it reports it, else its own latency.
SYNC_METRICS = (telemetry.SYNC_COST_MS_P99, telemetry.SYNC_LATENCY_MS_P99)
HEADLINE_GAUGES = {
    telemetry.SANDBOX_UTILIZATION_RATE.name: "utilization",
    telemetry.GRADIENT_SYNC_SUCCESS_RATE.name: "sync_success",
    telemetry.SNAPSHOT_RECOVERY_TIME.name: "recovery_s",
}
SYNC_SUCCESS_FLOOR = 0.9995  # the dashboard's red line
EVENT_WINDOW_S = 900.0  # how far back the first poll reads events
RECENT_EVENTS = 5  # events under the table
DETAIL_EVENTS = 10  # events in a worker's detail


# -- rows ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One worker as ``dsec top`` shows it."""

    id: str
    pool: str
    group: str
    rank: int
    role: str
    state: str
    level: int
    phase: str
    sync_ms: float | None  # the sync figure shown (see SYNC_METRICS), ms
    sync_metric: str | None  # which metric it is
    cap_ms: float | None  # the latency cap in force for the worker
    step_ms: float | None
    mem_used_gb: float | None
    mem_quota_gb: float | None  # the quota the desired directive grants
    last_event: str | None
    last_event_at: float | None

    @property
    def lost(self) -> bool:
        return self.state == "lost"

    @property
    def sync_over(self) -> float:
        """sync / cap when over the cap, else 0."""
        if self.sync_ms is None or not self.cap_ms or self.sync_ms <= self.cap_ms:
            return 0.0
        return self.sync_ms / self.cap_ms

    @property
    def mem_over(self) -> float:
        """used / quota when over the quota, else 0."""
        if self.mem_used_gb is None or not self.mem_quota_gb or self.mem_used_gb <= self.mem_quota_gb:
            return 0.0
        return self.mem_used_gb / self.mem_quota_gb

    @property
    def troubled(self) -> bool:
        return self.lost or self.level > 0 or self.phase != "closed" or bool(self.sync_over) or bool(self.mem_over)

    def trouble_key(self) -> tuple[int, int, int, float, float, str]:
        """Sort key, most troubled first: lost, then breaker level, then phase, then how far sync is over its cap,
        then how far memory is over its quota; the id breaks ties."""
        return (
            0 if self.lost else 1,
            -self.level,
            -PHASE_RANK.get(self.phase, 0),
            -self.sync_over,
            -self.mem_over,
            self.id,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "sync_over_cap": bool(self.sync_over),
            "memory_over_quota": bool(self.mem_over),
            "troubled": self.troubled,
        }


def _number(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def worker_row(w: Record, last_event: Record | None = None) -> Row:
    """A worker record of the API (``GET /v1/status`` ``workers[]``) and its latest event as a :class:`Row`."""
    metrics: Mapping[str, Any] = w.get("metrics") or {}
    sync_metric = next((m.name for m in SYNC_METRICS if _number(metrics.get(m.name)) is not None), None)
    breaker = w.get("breaker") or {}
    desired = (w.get("directive") or {}).get("desired") or {}
    return Row(
        id=w["id"],
        pool=w["pool"],
        group=w.get("group", "default"),
        rank=int(w.get("rank", 0)),
        role=w.get("role", "other"),
        state=w["state"],
        level=int(breaker.get("level", 0)),
        phase=str(breaker.get("phase", "closed")),
        sync_ms=_number(metrics.get(sync_metric)) if sync_metric else None,
        sync_metric=sync_metric,
        cap_ms=_number((w.get("caps") or {}).get("latency_ms")),
        step_ms=_number(metrics.get(telemetry.STEP_MS_MEAN.name)),
        mem_used_gb=_number(metrics.get(telemetry.MEMORY_USED_GB.name)),
        mem_quota_gb=_number(desired.get("memory_quota_gb")),
        last_event=last_event["type"] if last_event else None,
        last_event_at=_number(last_event["ts"]) if last_event else None,
    )


def _matches(row: Row, needle: str) -> bool:
    hay = (row.id, row.pool, row.group, row.role, row.state, row.phase, row.last_event or "")
    return any(needle in h.lower() for h in hay)


def build_rows(
    workers: Sequence[Record],
    last_events: Mapping[str, Record] | None = None,
    *,
    pool: str | None = None,
    group: str | None = None,
    match: str = "",
) -> list[Row]:
    """The rows of the view, most troubled first: workers of ``pool`` and ``group`` (all when None) that are active
    or lost (deregistered ones are history: ``dsec workers --state deregistered``), whose id, pool, group, role,
    state, breaker phase or last event contains ``match`` (case-insensitive)."""
    last = last_events or {}
    needle = match.strip().lower()
    rows = [
        worker_row(w, last.get(w["id"]))
        for w in workers
        if w["state"] != "deregistered"
        and (pool is None or w["pool"] == pool)
        and (group is None or w.get("group") == group)
    ]
    return sorted((r for r in rows if not needle or _matches(r, needle)), key=Row.trouble_key)


def parse_gauges(text: str) -> dict[str, dict[str, float | None]]:
    """The headline gauges per pool from ``GET /metrics`` text: ``{pool: {"utilization": .., "sync_success": ..,
    "recovery_s": ..}}``; NaN (nothing measured yet) is None."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float | None]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return out
    for family in families:
        for sample in family.samples:
            key = HEADLINE_GAUGES.get(sample.name)
            if key and "pool" in sample.labels:
                out.setdefault(sample.labels["pool"], {})[key] = _number(sample.value)
    return out


def latest_by_worker(events: Sequence[Record]) -> dict[str, Record]:
    last: dict[str, Record] = {}
    for e in events:
        if e.get("worker_id") and e["type"] not in QUIET_EVENTS:
            last[e["worker_id"]] = e
    return last


def build_frame(
    status: Record,
    gauges: Mapping[str, Mapping[str, float | None]],
    events: Sequence[Record],
    *,
    pool: str | None = None,
    group: str | None = None,
    match: str = "",
    last_events: Mapping[str, Record] | None = None,
    recent: int = RECENT_EVENTS,
) -> dict[str, Any]:
    """One frame of the view as plain data (what ``--json`` prints and the table is drawn from): the scope, the
    headline of each pool in it, the rows, and the last ``recent`` events of the scope."""
    last = latest_by_worker(events) if last_events is None else last_events
    rows = build_rows(status.get("workers", []), last, pool=pool, group=group, match=match)
    in_scope = build_rows(status.get("workers", []), pool=pool, group=group)  # the filter narrows rows only
    pools_by_name = {p["name"]: p for p in status.get("pools", [])}
    names = [pool] if pool is not None else sorted({r.pool for r in in_scope})
    headlines = []
    for name in names:
        p = pools_by_name.get(name, {})
        g = gauges.get(name, {})
        counts = p.get("workers", {})
        headlines.append(
            {
                "pool": name,
                "known": bool(p),
                "utilization": g.get("utilization"),
                "sync_success": g.get("sync_success"),
                "recovery_s": g.get("recovery_s"),
                "meltdowns": p.get("meltdowns", 0),
                "active": counts.get("active", 0),
                "lost": counts.get("lost", 0),
                "directives_pending": p.get("directives_pending", 0),
                "sync_slowdown": bool(p.get("sync_slowdown")),
            }
        )
    scope_ids = {r.id for r in in_scope}
    scoped = [
        e
        for e in events
        if e["type"] not in QUIET_EVENTS
        and (e.get("worker_id") in scope_ids or (group is None and e.get("pool") is not None and e["pool"] in names))
    ]
    return {
        "server_time": status.get("server_time"),
        "scope": {"pool": pool, "group": group, "filter": match or None},
        "pools": headlines,
        "workers": [r.to_dict() for r in rows],
        "events": list(scoped[-recent:]) if recent > 0 else [],
    }


# -- keys ------------------------------------------------------------------------------------------------------
@dataclass
class ViewState:
    """What the keys change: the filter (and whether it is being typed), the selected row, the worker whose detail
    is shown. :meth:`apply` is pure of I/O so that the key map is tested without a terminal."""

    match: str = ""
    editing: bool = False
    selected: int = 0
    detail: str | None = None
    quit: bool = False

    def apply(self, key: str, row_ids: Sequence[str]) -> None:
        if self.editing:
            if key in ("\r", "\n"):
                self.editing = False
            elif key == "esc":
                self.editing, self.match = False, ""
            elif key in ("\x7f", "\b"):
                self.match = self.match[:-1]
            elif len(key) == 1 and key.isprintable():
                self.match += key
            self.selected = 0
            return
        if key == "q":
            self.quit = True
        elif self.detail is not None:
            if key in ("esc", "\r", "\n", "d", "b", "\x7f", "\b"):
                self.detail = None
        elif key in ("/", "f"):
            self.editing = True
        elif key == "esc":
            self.match, self.selected = "", 0
        elif key in ("j", "down"):
            self.selected = min(self.selected + 1, max(len(row_ids) - 1, 0))
        elif key in ("k", "up"):
            self.selected = max(self.selected - 1, 0)
        elif key in ("\r", "\n", "d") and row_ids:
            self.detail = row_ids[min(self.selected, len(row_ids) - 1)]


_ARROWS = {"\x1b[A": "up", "\x1b[B": "down", "\x1bOA": "up", "\x1bOB": "down"}


def split_keys(data: str) -> list[str]:
    """Characters read from the terminal as keys: arrows as ``up``/``down``, a lone escape as ``esc``, other escape
    sequences dropped."""
    keys: list[str] = []
    i = 0
    while i < len(data):
        if data[i] == "\x1b":
            seq = data[i : i + 3]
            if seq in _ARROWS:
                keys.append(_ARROWS[seq])
                i += 3
                continue
            if len(seq) >= 2 and seq[1] in "[O":
                i += 3  # another sequence (left/right, function keys): ignored
                continue
            keys.append("esc")
            i += 1
            continue
        keys.append(data[i])
        i += 1
    return keys


class Keys:
    """Single keys from stdin while it is a terminal (cbreak mode, restored on exit). Otherwise (a pipe, a file,
    no termios) :meth:`wait` only sleeps: the view refreshes until Ctrl-C."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.fd: int | None = None
        self._saved: Any = None

    def __enter__(self) -> Keys:
        try:
            import termios
            import tty

            if self.stream.isatty():
                fd = self.stream.fileno()
                self._saved = termios.tcgetattr(fd)
                tty.setcbreak(fd)
                self.fd = fd
        except (ImportError, OSError, ValueError):
            self.fd = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self.fd = None

    @property
    def interactive(self) -> bool:
        return self.fd is not None

    def wait(self, timeout: float) -> list[str]:
        """The keys pressed within ``timeout`` seconds (returns at the first)."""
        if self.fd is None:
            time.sleep(max(timeout, 0.0))
            return []
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0.0))
        if not ready:
            return []
        return split_keys(os.read(self.fd, 64).decode(errors="ignore"))


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


# -- fetching --------------------------------------------------------------------------------------------------
class Feed:
    """Reads the API for the view. Events are read once back to ``EVENT_WINDOW_S`` and then from the cursor, so a
    refresh asks only for what is new."""

    MAX_PAGES = 20

    def __init__(self, client: Client, keep: int = 500) -> None:
        self.client = client
        self.cursor: int | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=keep)
        self.last: dict[str, dict[str, Any]] = {}

    def _read_events(self, since: float | None) -> None:
        for _ in range(self.MAX_PAGES):
            page = self.client.events(types=SHOWN_EVENTS, since=since, cursor=self.cursor or 0, limit=1000)
            for e in page["items"]:
                self.events.append(e)
                if e.get("worker_id"):
                    self.last[e["worker_id"]] = e
                self.cursor = int(e["id"])
            if page["next_cursor"] is None:
                return

    def gauges(self) -> dict[str, dict[str, float | None]]:
        try:
            return parse_gauges(self.client.metrics_text())
        except ClientError:
            return {}  # the headline shows "-": the rows still matter

    def frame(self, *, pool: str | None, group: str | None, match: str) -> dict[str, Any]:
        status = self.client.status()
        self._read_events(status["server_time"] - EVENT_WINDOW_S if self.cursor is None else None)
        return build_frame(
            status, self.gauges(), list(self.events), pool=pool, group=group, match=match, last_events=self.last
        )

    def detail(self, worker_id: str) -> dict[str, Any]:
        worker = self.client.worker(worker_id)
        directive = self.client.directive(worker_id)
        since = float(worker.get("registered_at") or 0.0)
        events: deque[dict[str, Any]] = deque(maxlen=DETAIL_EVENTS)
        cursor = 0
        for _ in range(self.MAX_PAGES):
            page = self.client.events(worker_id=worker_id, types=SHOWN_EVENTS, since=since, cursor=cursor, limit=1000)
            events.extend(page["items"])
            if page["next_cursor"] is None:
                break
            cursor = int(page["next_cursor"])
        return detail_frame(worker, directive, list(events))


def _live(console: Console, feed: Feed, state: ViewState, pool: str | None, group: str | None, every: float) -> None:
    from rich.live import Live

    problem = ""

    def fetch() -> tuple[dict[str, Any], dict[str, Any] | None]:
        nonlocal problem
        frame = feed.frame(pool=pool, group=group, match=state.match)
        detail = None
        if state.detail:
            try:
                detail = feed.detail(state.detail)
            except ApiError as exc:  # gone (retired) or never there: back to the list, saying why
                problem, state.detail = f"{state.detail}: {exc}", None
        return frame, detail

    frame, detail = fetch()
    with Keys(sys.stdin) as keys, Live(console=console, auto_refresh=False, screen=keys.interactive) as live:

        def draw() -> None:
            if detail is not None and state.detail == detail["worker"]["id"]:
                view = detail_view(detail, live=keys.interactive)
            else:
                view = frame_view(
                    frame,
                    state=state,
                    live=keys.interactive,
                    width=console.width,
                    height=console.height if keys.interactive else None,
                )
            if problem:
                view = Group(view, Text(f"error: {problem}", style="red"))
            live.update(view, refresh=True)

        draw()
        due = time.monotonic() + every
        while not state.quit:
            pressed = keys.wait(due - time.monotonic())
            was = (state.match, state.detail)
            for key in pressed:
                state.apply(key, [r["id"] for r in frame["workers"]])
            if state.quit:
                break
            if time.monotonic() >= due or was != (state.match, state.detail):
                problem = ""
                try:
                    frame, detail = fetch()
                    state.selected = max(0, min(state.selected, len(frame["workers"]) - 1))
                except ClientError as exc:  # keep the last frame on screen; try again at the next refresh
                    problem = str(exc)
                due = time.monotonic() + every
            draw()


def top(
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    token: ReadToken = None,
    pool: Annotated[str | None, typer.Option(help="Only this pool.")] = None,
    group: Annotated[
        str | None, typer.Option(help="Only this worker group (a job's group, as `dsec launch` names it).")
    ] = None,
    filter_: Annotated[
        str, typer.Option("--filter", help="Only rows containing this text (id, role, phase, ...).")
    ] = "",
    worker: Annotated[str | None, typer.Option(help="One worker's detail: every metric, directive, events.")] = None,
    interval: Annotated[float, typer.Option(min=0.2, max=3600, help="Seconds between refreshes.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    json_out: AsJson = False,
) -> None:
    """Live view of a pool's workers, most troubled first (lost, breaker, sync over cap, memory over quota).

    Keys: q quits, / or f filters, j/k or arrows select, Enter or d opens the selected worker's detail, Esc back.

    Without a terminal on stdin it refreshes until Ctrl-C. A read-only token is enough."""
    console = stdout_console()
    state = ViewState(match=filter_, detail=worker)
    try:
        with admin_client(endpoint, token) as c, suppress(KeyboardInterrupt):
            feed = Feed(c)
            if json_out or once:
                data = feed.detail(worker) if worker else feed.frame(pool=pool, group=group, match=filter_)
                if json_out:
                    print_json(data)
                else:
                    console.print(detail_view(data) if worker else frame_view(data, width=console.width))
                return
            _live(console, feed, state, pool, group, interval)
    except ClientError as exc:
        raise fail(exc) from None
