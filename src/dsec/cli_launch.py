"""``dsec launch JOB.yaml`` and ``dsec placement plan | explain``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

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
from dsec.cli_progress import Bars, ShowProgress, bars, wanted
from dsec.yamlconf import ConfigError

placement_app = typer.Typer(help="Place jobs and explain placements.", no_args_is_help=True)
out = Console()


def _job(path: Path) -> Any:
    from dsec.launch.jobfile import load_job

    try:
        return load_job(path)
    except ConfigError as exc:
        raise fail(exc, 2) from None


def _print(p: dict[str, Any], wide: bool) -> None:
    from dsec.render import excluded_summary, placement_table

    console = stdout_console()
    table = placement_table(p, wide=wide, width=console.width)
    if wide:
        widen(console, table)
    console.print(table)
    for worker, why in p["unplaced"].items():
        console.print("[red]unplaced[/red]", end=" ")
        console.print(f"{worker}: {why}", markup=False, highlight=False)
    if p["excluded"]:
        console.print(excluded_summary(p["excluded"], wide=wide), markup=False, highlight=False)


@placement_app.command("plan")
def plan(
    job: Annotated[Path, typer.Argument(help="Job file.")],
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
    wide: Wide = False,
    as_json: AsJson = False,
) -> None:
    """Place a job file's workers on the control plane's inventory and show why each went where it did."""
    from dsec.client import ClientError
    from dsec.launch.supervisor import place_job

    spec = _job(job)
    with admin_client(endpoint, admin_token) as c:
        try:
            p = place_job(spec, c)
        except (ClientError, RuntimeError) as exc:
            raise fail(exc) from None
    if as_json:
        print_json(p)
    else:
        _print(p, wide)


@placement_app.command("explain")
def explain(
    job: Annotated[str, typer.Argument(help="Job name.")],
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
    wide: Wide = False,
    as_json: AsJson = False,
) -> None:
    """Show a job's placement: each worker's device and the score of every term that put it there (--wide: group and
    NUMA node, and every excluded device by name)."""
    from dsec.client import ClientError

    with admin_client(endpoint, admin_token) as c:
        try:
            p = c.placement(job)
        except ClientError as exc:
            raise fail(exc) from None
    if as_json:
        print_json(p)
    else:
        _print(p, wide)


def launch(
    job: Annotated[Path, typer.Argument(help="Job file (see examples/jobs/ppo.yaml).")],
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
    token: Annotated[str | None, typer.Option(envvar="DSEC_TOKEN", help="Pool token for the workers' probes.")] = None,
    log_dir: Annotated[Path, typer.Option(help="Worker logs.")] = Path(".dsec/logs"),
    timeout: Annotated[float | None, typer.Option(help="Give up after this many seconds.")] = None,
    show_progress: ShowProgress = None,
) -> None:
    """Place a job, start its workers (local processes or Ray), and restart failed groups from their snapshots."""
    from dsec.client import ClientError
    from dsec.launch import make_launcher
    from dsec.launch.startup import known_workers, wait_for_ranks
    from dsec.launch.supervisor import Recovery, Supervisor

    spec = _job(job)
    shown = wanted(show_progress)
    printer = [Bars(None)]  # the start-up bars while they show: a recovery then prints above them

    def report(r: Recovery) -> None:
        printer[0].out(f"recovered group {r.group}: " + json.dumps(r.timings()), highlight=False, soft_wrap=True)

    with admin_client(endpoint, admin_token) as c:
        launcher = make_launcher(
            spec.launcher, log_dir=log_dir, base_env=dict(os.environ), warm=spec.warm_standby, ray=spec.ray
        )
        sup = Supervisor(spec, launcher, client=c, endpoint=endpoint, pool_token=token, on_recovery=report)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # Counting ranks asks the control plane for the pool's workers: only when a bar shows it.
            before = known_workers(c, spec.pool) if shown else set()
            sup.start()
            out.print(
                f"started {spec.job}: "
                + ", ".join(f"{a['worker']}@{a['device']}" for a in sup.placement["assignments"])
            )
            if shown:
                with bars(True) as printer[0]:
                    task = printer[0].task(f"{spec.job}: ranks registered", unit="ranks")
                    wait_for_ranks(sup, c, before, task.update, deadline)
                printer[0] = Bars(None)
            ok = sup.run(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except (ClientError, RuntimeError) as exc:
            raise fail(exc) from None
        finally:
            sup.stop()
    if not ok:
        raise fail(f"job {spec.job} did not finish: {sup.failed or 'timeout'}")
    out.print(f"job {spec.job} finished ({sum(sup.restarts.values())} restart(s))")
