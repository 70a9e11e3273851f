"""``dsec top``: a live terminal view of one pool (or worker group), its most troubled workers first.

Everything comes from the read API (``GET /v1/status``, ``/v1/events``, ``/v1/workers/{id}``,
``/v1/workers/{id}/directive``) and the headline gauges from ``GET /metrics``, so a read-only token is enough.
The pure part (dsec.top.frame: :func:`worker_row`, :func:`build_rows`, :func:`build_frame`; dsec.top.keys:
:class:`ViewState`) turns API records into rows and keys into view changes; dsec.top.view draws; this module fetches
and runs the live loop.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from contextlib import suppress
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.text import Text

from dsec.cli_common import (
    DEFAULT_ENDPOINT,
    AsJson,
    Endpoint,
    ReadToken,
    admin_client,
    fail,
    print_json,
    stdout_console,
)
from dsec.client import ApiError, Client, ClientError
from dsec.top.frame import DETAIL_EVENTS, EVENT_WINDOW_S, SHOWN_EVENTS, build_frame, parse_gauges
from dsec.top.keys import Keys, ViewState
from dsec.top.view import detail_frame, detail_view, frame_view


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
