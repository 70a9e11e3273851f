"""``dsec cost``: cost accounting of a control plane over a window (``GET /v1/cost``)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from dsec.cli_common import (
    DEFAULT_ENDPOINT,
    AdminToken,
    AsJson,
    Endpoint,
    Wide,
    admin_client,
    fail,
    print_json,
    stdout_console,
    widen,
)
from dsec.client import ClientError


def cost(
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
    pool: Annotated[str | None, typer.Option(help="Only this pool.")] = None,
    since: Annotated[float, typer.Option(min=0, help="Window start, seconds ago.")] = 3600.0,
    until: Annotated[float, typer.Option(min=0, help="Window end, seconds ago (0: now).")] = 0.0,
    wide: Wide = False,
    json_out: AsJson = False,
) -> None:
    """Device-hours per pool (useful, degraded, recovering, idle) and their price, DSec's own overhead and the
    opportunity cost of degrading (--wide: per group and in hours)."""
    from rich.text import Text

    from dsec.render import cost_summary, cost_table

    if until >= since:
        raise fail(ValueError(f"--until {until:g} must be less than --since {since:g} (both are seconds ago)"), 2)
    now = time.time()
    try:
        with admin_client(endpoint, admin_token) as c:
            report = c.cost(pool=pool, since=now - since, until=None if until == 0 else now - until)
    except ClientError as exc:
        raise fail(exc) from None
    if json_out:
        print_json(report)
        return
    console = stdout_console()
    table = cost_table(report, wide=wide, width=console.width)
    if wide:
        widen(console, table)
    console.print(table)
    for line in cost_summary(report):
        console.print(Text(line))
