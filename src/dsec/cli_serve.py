"""``dsec serve``: the control plane under uvicorn, in the foreground."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dsec.cli_common import err, fail
from dsec.yamlconf import ConfigError

if TYPE_CHECKING:
    from dsec.control.settings import Settings


def _admin_token_file(home: Path) -> str:
    """The admin token in ``home/admin.token``, made (0600 from its first byte) when there is none."""
    from dsec.fsutil import PRIVATE_FILE, private_file, write_atomic

    token_file = home / "admin.token"
    with contextlib.suppress(FileExistsError):
        write_atomic(token_file, f"dsa_{secrets.token_urlsafe(32)}\n".encode(), overwrite=False, mode=PRIVATE_FILE)
    private_file(token_file)  # one written by an older version may be wider
    err.print(f"admin token in {token_file}", markup=False, soft_wrap=True)
    return token_file.read_text().strip()


def _tls(cert: Path | None, key: Path | None, host: str) -> dict[str, str]:
    if (cert is None) != (key is None):
        raise fail(ValueError("--tls-cert and --tls-key go together: give both or neither"), 2)
    if cert is None or key is None:
        if not _loopback(host):
            err.print(f"warning: serving plain HTTP on {host}: tokens cross the network in the clear "
                      "(--tls-cert/--tls-key, or a TLS-terminating proxy)", markup=False)  # fmt: skip
        return {}
    for what, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not path.is_file():
            raise fail(ValueError(f"{what} {path}: no such file"), 2)
    return {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8080,
    cluster: Annotated[Path | None, typer.Option(help="Cluster YAML (pools, devices).")] = None,
    home: Annotated[Path | None, typer.Option(envvar="DSEC_HOME", help="State directory.")] = None,
    database_url: Annotated[
        str | None, typer.Option(envvar="DSEC_DATABASE_URL", help="SQLAlchemy URL (default SQLite in home).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    alert_webhook: Annotated[
        list[str] | None,
        typer.Option(
            envvar="DSEC_ALERT_WEBHOOK",
            help="Send alerts to this URL, signed (HMAC-SHA256) with the secret in DSEC_ALERT_SECRET. Repeatable.",
        ),
    ] = None,
    policy: Annotated[
        Path | None, typer.Option(help="Policy file (default: the last one applied with `dsec policy apply`).")
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(envvar="DSEC_TLS_CERT", help="Serve HTTPS: certificate (PEM).")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(envvar="DSEC_TLS_KEY", help="Serve HTTPS: private key (PEM).")] = None,
    webhook_allow_private: Annotated[
        bool,
        typer.Option(
            envvar="DSEC_WEBHOOK_ALLOW_PRIVATE",
            help="Let runtime callbacks go to private, loopback and link-local addresses (a receiver on this host).",
        ),
    ] = False,
    webhook_allowed_host: Annotated[
        list[str] | None,
        typer.Option(help="A callback host (fnmatch pattern) pool tokens may register runtimes for. Repeatable."),
    ] = None,
) -> None:
    """Run the control plane (uvicorn)."""
    import uvicorn

    from dsec.control.server import tune_gc, uvicorn_config

    _check_policy(policy)
    hooks, secret = _alert_webhooks(alert_webhook)
    tls = _tls(tls_cert, tls_key, host)
    settings = _settings(
        webhook_allow_private,
        webhook_allowed_host,
        home=home,
        database_url=database_url,
        host=host,
        port=port,
        cluster_file=cluster,
        alert_webhooks=tuple((u, secret) for u in hooks),
        policy_file=policy,
    )
    fastapi_app = _app(settings)
    scheme = "https" if tls else "http"
    err.print(f"DSec control plane on {scheme}://{host}:{port} (store: {settings.database_url.split('@')[-1]})")
    tune_gc()
    uvicorn.Server(uvicorn_config(fastapi_app, host, port, log_level=log_level, **tls)).run()


def _check_policy(policy: Path | None) -> None:
    if policy is not None:
        from dsec.policy import load_policies

        try:
            load_policies(policy)  # checked before anything starts: a typo in a rule starts nothing
        except ConfigError as exc:
            raise fail(exc, 2) from None


def _alert_webhooks(alert_webhook: list[str] | None) -> tuple[list[str], str]:
    """The alert webhook URLs given and the secret they are signed with (exit 2: URLs but no secret)."""
    hooks = [u for u in (alert_webhook or []) if u]
    secret = os.environ.get("DSEC_ALERT_SECRET", "")
    if hooks and not secret:
        raise fail(ValueError("--alert-webhook needs DSEC_ALERT_SECRET (the key alerts are signed with)"), 2)
    return hooks, secret


def _settings(webhook_allow_private: bool, webhook_allowed_host: list[str] | None, **given: Any) -> Settings:
    """The control plane's settings (the environment, then the options), its home made private and an admin token
    in it when none is configured."""
    from dsec.control.settings import Settings
    from dsec.fsutil import private_dir

    overrides: dict[str, object] = {"webhook_allow_private": webhook_allow_private}
    if webhook_allowed_host:
        overrides["webhook_allowed_hosts"] = tuple(webhook_allowed_host)
    try:
        settings = Settings.from_env(**given, **overrides)
    except ValueError as exc:  # a setting from the environment (DSEC_COST_DEVICE_HOUR, ...): its message names it
        raise fail(exc, 2) from None
    private_dir(settings.home)
    if settings.admin_token is None:
        settings = replace(settings, admin_token=_admin_token_file(settings.home))
    return settings


def _app(settings: Settings) -> Any:
    """The control plane's app (exit 2 when its configuration or store is unusable)."""
    from dsec.control.app import create_app
    from dsec.control.store import StoreError

    try:
        return create_app(settings)
    except (ConfigError, StoreError) as exc:
        raise fail(exc, 2) from None
