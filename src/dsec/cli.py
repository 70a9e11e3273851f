"""The ``dsec`` command. Thin: parses arguments and calls into the packages."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from dsec.cli_agent import agent
from dsec.cli_common import (
    DEFAULT_ENDPOINT,
    AdminToken,
    AsJson,
    Endpoint,
    Wide,
    admin_client,
    err,
    fail,
    print_json,
    stdout_console,
    widen,
)
from dsec.cli_cost import cost
from dsec.cli_launch import launch, placement_app
from dsec.cli_policy import metrics_app, policy_app
from dsec.cli_serve import serve
from dsec.cli_sim import simulate
from dsec.cli_snapshots import snapshots_app
from dsec.cli_top import top
from dsec.client import ClientError
from dsec.yamlconf import ConfigError

app = typer.Typer(
    help="DSec: state-aware elastic compute coordinator for distributed RL training.",
    no_args_is_help=True,
    add_completion=False,
)
token_app = typer.Typer(help="Manage API tokens.", no_args_is_help=True)
directive_app = typer.Typer(help="Read and change worker directives.", no_args_is_help=True)
app.add_typer(token_app, name="token")
app.add_typer(directive_app, name="directive")
app.add_typer(snapshots_app, name="snapshots")
app.add_typer(policy_app, name="policy")
app.add_typer(metrics_app, name="metrics")
app.add_typer(placement_app, name="placement")
app.command("simulate")(simulate)
app.command("serve")(serve)
app.command("agent")(agent)
app.command("launch")(launch)
app.command("top")(top)
app.command("cost")(cost)


@app.command()
def status(
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
    watch: Annotated[float, typer.Option(help="Refresh every N seconds (0: once).")] = 0.0,
    wide: Wide = False,
    json_out: AsJson = False,
) -> None:
    """Pools and workers: state, breaker, directive desired/acked, step time (--wide: every metric)."""
    from rich.console import Group
    from rich.live import Live

    from dsec.render import pools_table, workers_table

    if json_out and watch > 0:
        raise fail(ValueError("--json prints one document: drop --watch (or poll `dsec status --json`)"), 2)
    console = stdout_console()
    with admin_client(endpoint, admin_token) as c:

        def view() -> Group:
            s = c.status()
            return Group(
                pools_table(s, wide=wide, width=console.width),
                workers_table(s["workers"], now=s["server_time"], wide=wide, width=console.width),
            )

        try:
            if json_out:
                print_json(c.status())
                return
            first = view()
            if wide:
                widen(console, first)
            if watch <= 0:
                console.print(first)
                return
            with Live(first, console=console, refresh_per_second=4) as live:
                while True:
                    time.sleep(watch)
                    live.update(view())
        except ClientError as exc:
            raise fail(exc) from None
        except KeyboardInterrupt:
            pass


@app.command()
def workers(
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
    pool: Annotated[str | None, typer.Option()] = None,
    state: Annotated[str | None, typer.Option(help="active | lost | deregistered")] = None,
    wide: Wide = False,
    json_out: AsJson = False,
) -> None:
    """List workers."""
    from dsec.render import workers_table

    try:
        with admin_client(endpoint, admin_token) as c:
            items = c.workers(pool=pool, state=state)
    except ClientError as exc:
        raise fail(exc) from None
    if json_out:
        print_json(items)
    else:
        console = stdout_console()
        table = workers_table(items, wide=wide, width=console.width)
        if wide:
            widen(console, table)
        console.print(table)


@app.command()
def events(
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
    worker: Annotated[str | None, typer.Option(help="Worker id.")] = None,
    pool: Annotated[str | None, typer.Option()] = None,
    type_: Annotated[list[str] | None, typer.Option("--type", help="Event type (repeatable).")] = None,
    since: Annotated[float | None, typer.Option(help="Seconds ago.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    cursor: Annotated[int, typer.Option(min=0, help="Only events after this id (the `more:` line's).")] = 0,
    wide: Wide = False,
    json_out: AsJson = False,
) -> None:
    """Query events, oldest first (--json: the page, with next_cursor)."""
    from dsec.render import events_table

    try:
        with admin_client(endpoint, admin_token) as c:
            page = c.events(
                worker_id=worker,
                pool=pool,
                types=type_ or (),
                since=time.time() - since if since is not None else None,
                cursor=cursor,
                limit=limit,
            )
    except ClientError as exc:
        raise fail(exc) from None
    if json_out:
        print_json(page)
        return
    console = stdout_console()
    console.print(events_table(page["items"], wide=wide))
    if page["next_cursor"] is not None:
        console.print(f"more: --cursor {page['next_cursor']}", highlight=False)


@token_app.command("create")
def token_create(
    pool: Annotated[str | None, typer.Option(help="Pool the token may register workers in.")] = None,
    admin: Annotated[bool, typer.Option("--admin", help="Create an admin token instead.")] = False,
    read: Annotated[bool, typer.Option("--read", help="Create a read-only token (dashboards, status).")] = False,
    label: Annotated[str, typer.Option()] = "",
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
) -> None:
    """Create a token; it is printed once (the control plane keeps only its hash)."""
    kinds = [k for k, chosen in (("pool", bool(pool)), ("admin", admin), ("read", read)) if chosen]
    if len(kinds) != 1:
        raise fail(ValueError("give one of --pool P (a worker-registration token), --read or --admin"), 2)
    try:
        with admin_client(endpoint, admin_token) as c:
            stdout_console().print(c.create_token(pool=pool, kind=kinds[0], label=label), soft_wrap=True)
    except ClientError as exc:
        raise fail(exc) from None


@token_app.command("ls")
def token_ls(endpoint: Endpoint = DEFAULT_ENDPOINT, admin_token: AdminToken = None) -> None:
    """Tokens created over the API: id, kind, pool, label (never the tokens themselves)."""
    try:
        with admin_client(endpoint, admin_token) as c:
            items = c.tokens()
    except ClientError as exc:
        raise fail(exc) from None
    console = stdout_console()
    for t in items:
        console.print(f"{t['id']}  {t['kind']:<5}  {t['pool'] or '-':<16}  {t['label']}", markup=False)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="The id `dsec token ls` shows.")],
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
) -> None:
    """Revoke a token: requests with it are refused from now on."""
    try:
        with admin_client(endpoint, admin_token) as c:
            c.revoke_token(token_id)
    except ClientError as exc:
        raise fail(exc) from None
    stdout_console().print(f"revoked {token_id}", markup=False, highlight=False)


def _parse_assignment(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep:
        raise typer.BadParameter(f"{text!r}: expected FIELD=VALUE")
    value: Any = raw
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    elif raw.lower() in ("null", "none"):
        value = None
    else:
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
    return key, value


@directive_app.command("set")
def directive_set(
    worker_id: str, assignments: list[str], endpoint: Endpoint = DEFAULT_ENDPOINT, admin_token: AdminToken = None
) -> None:
    """Set directive fields, e.g. `dsec directive set w-123 compression_bits=8 grad_accum_steps=4`.

    `compression_bits=null` returns to the probe's configured default; `compression_bits=32` is uncompressed."""
    fields = dict(_parse_assignment(a) for a in assignments)
    try:
        with admin_client(endpoint, admin_token) as c:
            stdout_console().print_json(data=c.set_directive(worker_id, **fields))
    except ClientError as exc:
        raise fail(exc) from None


@directive_app.command("show")
def directive_show(worker_id: str, endpoint: Endpoint = DEFAULT_ENDPOINT, admin_token: AdminToken = None) -> None:
    """Desired vs acked directive of a worker."""
    try:
        with admin_client(endpoint, admin_token) as c:
            stdout_console().print_json(data=c.directive(worker_id))
    except ClientError as exc:
        raise fail(exc) from None


def _probe_env(config: Path | None, **given: str | None) -> dict[str, str]:
    """This environment plus the probe's DSEC_* settings: the harness plugin file's (exit 2 when it is invalid), then
    the options given."""
    from dsec.probe.config import plugin_env
    from dsec.probe.launch import probe_env

    settings: dict[str, str] = {}
    if config is not None:
        try:
            settings.update(plugin_env(config))
        except ConfigError as exc:
            raise fail(exc, 2) from None
    for key, value in given.items():
        if value is not None:
            settings[key] = value
    return probe_env(os.environ, settings)


def _check_run(env: dict[str, str], role: str | None, restore: str | None, heal: bool, nproc: int | None) -> None:
    """Refuse (exit 2) what would only fail inside the job; warn when the command will run without the probe."""
    from dsec.probe.chaos import ChaosError
    from dsec.probe.chaos import parse as parse_chaos

    try:
        # Checked here, before anything starts: inside the job a bad spec would only be logged.
        parse_chaos(env.get("DSEC_CHAOS") or "")
    except ChaosError as exc:
        raise fail(exc, 2) from None
    if role is not None and role not in ("auto", "actor", "learner", "other"):
        raise fail(ValueError(f"--role {role!r} is invalid: expected auto, actor, learner or other"), 2)
    if restore is not None and restore != "latest" and not restore.isdigit():
        raise fail(ValueError(f"--restore {restore!r} is invalid: expected latest or a snapshot number"), 2)
    if env.get("DSEC_RESTORE") and not env.get("DSEC_SNAPSHOT_DIR"):
        raise fail(ValueError("--restore needs --snapshot-dir (or DSEC_SNAPSHOT_DIR): where are the snapshots?"), 2)
    if heal and nproc is None:
        raise fail(ValueError("--heal needs --nproc-per-node: DSec must launch the ranks to replace one"), 2)
    if not env.get("DSEC_ENDPOINT") or not env.get("DSEC_SANDBOX_ID"):
        if heal or nproc is not None:
            raise fail(ValueError("--nproc-per-node/--heal need a control plane: --endpoint and --sandbox-id"), 2)
        err.print("warning: no DSEC_ENDPOINT/DSEC_SANDBOX_ID: the command runs without the probe")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(help="Harness plugin file (plugins: - name: dsec_monitor).")] = None,
    sandbox_id: Annotated[str | None, typer.Option(help="Pool (sandbox) id; default $DSEC_SANDBOX_ID.")] = None,
    endpoint: Annotated[str | None, typer.Option(help="Control plane; default $DSEC_ENDPOINT.")] = None,
    token: Annotated[str | None, typer.Option(help="Pool token; default $DSEC_TOKEN.")] = None,
    role: Annotated[
        str | None,
        typer.Option(
            help="auto | actor | learner | other; default $DSEC_ROLE, else auto: inferred from what each process does "
            "(optimizer steps: learner; env steps without them: actor). An explicit role is kept."
        ),
    ] = None,
    chaos: Annotated[
        str | None,
        typer.Option(help='Fault injection, e.g. "sync_delay_ms=200,rank=1,after_s=20,for_s=30"; default $DSEC_CHAOS.'),
    ] = None,
    snapshot_dir: Annotated[
        Path | None,
        typer.Option(help="Snapshot store for the job's workers; default $DSEC_SNAPSHOT_DIR (off if unset)."),
    ] = None,
    restore: Annotated[
        str | None, typer.Option(help="Restore each worker from its snapshot before training resumes: latest or N.")
    ] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            min=1, max=1024, help="Run N ranks of COMMAND (RANK/WORLD_SIZE/MASTER_* set) under DSec's supervisor."
        ),
    ] = None,
    heal: Annotated[
        bool, typer.Option(help="With --nproc-per-node: replace a dead rank in place; its peers keep training.")
    ] = False,
) -> None:
    """Run COMMAND with the DSec probe injected into every Python process it starts: dsec run -- python train.py"""
    from dsec.probe.launch import run as run_command

    command = list(ctx.args)
    if not command:
        raise fail(ValueError("no command given: dsec run [OPTIONS] -- COMMAND [ARGS...]"), 2)
    env = _probe_env(
        config,
        DSEC_SANDBOX_ID=sandbox_id,
        DSEC_ENDPOINT=endpoint,
        DSEC_TOKEN=token,
        DSEC_ROLE=role,
        DSEC_CHAOS=chaos,
        DSEC_SNAPSHOT_DIR=str(snapshot_dir) if snapshot_dir is not None else None,
        DSEC_RESTORE=restore,
    )
    _check_run(env, role, restore, heal, nproc_per_node)
    try:
        if nproc_per_node is not None:
            from dsec.launch.runner import run_group

            sys.exit(run_group(command, env, nproc_per_node, heal))
        sys.exit(run_command(command, env))
    except FileNotFoundError as exc:
        raise fail(exc, 127) from None


@app.command()
def demo(
    workers_n: Annotated[int, typer.Option("--workers", min=2, max=8, help="DDP learner ranks (PPO).")] = 2,
    duration: Annotated[float, typer.Option(min=5, max=600, help="Longest PPO training time, seconds.")] = 75.0,
    keep: Annotated[bool, typer.Option(help="Keep the temporary DSEC_HOME.")] = False,
    summary_json: Annotated[
        Path | None, typer.Option(help="Also write the summary as JSON here (scenes passed, counts, notes).")
    ] = None,
) -> None:
    """Run an embedded control plane and real training processes, show them live, print a summary."""
    from dsec.demo import run_demo

    # The demo is a show for a terminal; piped (CI logs, `| tee`) it keeps its wide tables on 220 columns.
    console = Console(width=None if sys.stdout.isatty() else 220)
    sys.exit(run_demo(console, workers=workers_n, duration_s=duration, keep_home=keep, summary_json=summary_json))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
