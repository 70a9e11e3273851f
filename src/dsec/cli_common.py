"""What every ``dsec`` sub-command module shares: the endpoint and admin-token options, the admin client, and the
error exit (plain text: messages carry paths and ``field[0]`` locations that must stay greppable)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

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
DEFAULT_ENDPOINT = "http://127.0.0.1:8080"


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
