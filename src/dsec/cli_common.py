"""What every ``dsec`` sub-command module shares: the endpoint and admin-token options (``ReadToken``: the same, for
commands a read-only token is enough for), the admin client, the listings' console and ``--wide`` / ``--json``
options, and the error exit (plain text: messages carry paths and ``field[0]`` locations that must stay greppable)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console, RenderableType
from rich.measure import Measurement

from dsec.client import Client

err = Console(stderr=True)

Endpoint = Annotated[str, typer.Option(envvar="DSEC_ENDPOINT", help="Control-plane URL.")]
AdminToken = Annotated[
    str | None,
    typer.Option(
        envvar="DSEC_ADMIN_TOKEN",
        show_default=False,
        help="Admin token (default: $DSEC_HOME/admin.token); a read-only token does for commands that only read.",
    ),
]
ReadToken = Annotated[
    str | None,
    typer.Option(
        "--token",
        "--admin-token",
        envvar=["DSEC_READ_TOKEN", "DSEC_ADMIN_TOKEN"],
        show_default=False,
        help="A read-only token (`dsec token create --read`) or the admin token (default: $DSEC_HOME/admin.token).",
    ),
]
DEFAULT_ENDPOINT = "http://127.0.0.1:8080"

Wide = Annotated[bool, typer.Option("--wide", "-l", help="Every column (the default view fits 100 columns).")]
AsJson = Annotated[bool, typer.Option("--json", help="The records as one JSON document, full precision.")]

# The width listings get when stdout is not a terminal (CI logs, `| less`) and $COLUMNS is unset: what the default
# views fit. Rich's own fallback, 80, made it cut ids short ("defaul…").
PIPE_WIDTH = 100


def stdout_console() -> Console:
    """The console listings print on, made when the command runs (so it sees the environment of that run):
    the terminal's width or $COLUMNS; :data:`PIPE_WIDTH` when stdout is not a terminal and $COLUMNS is unset."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit():
        return Console()
    return Console(width=PIPE_WIDTH)


def widen(console: Console, renderable: RenderableType) -> None:
    """Give a ``--wide`` view its natural width when the console is narrower: every column at full width (lines
    longer than the terminal run on; ``less -S`` scrolls them) rather than each squeezed to a few characters."""
    need = Measurement.get(console, console.options.update_width(_UNBOUNDED), renderable).maximum
    console.width = max(console.width, need)


_UNBOUNDED = 10_000


def print_json(data: object) -> None:
    """One JSON document on stdout, plain (no colours, no wrapping), for scripts."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def home() -> Path:
    from dsec.control.settings import default_home

    return default_home()


def admin_token(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    path = home() / "admin.token"
    return path.read_text().strip() if path.exists() else None


def admin_client(endpoint: str, token: str | None) -> Client:
    return Client(endpoint, token=admin_token(token))


def fail(message: str | Exception, code: int = 1) -> typer.Exit:
    err.print("error:", style="red", end=" ")
    err.print(str(message), markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)
