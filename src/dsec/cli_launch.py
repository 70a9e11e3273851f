"""``dsec launch JOB.yaml`` and ``dsec placement plan | explain``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dsec.cli_common import DEFAULT_ENDPOINT, AdminToken, Endpoint, admin_client, fail
from dsec.yamlconf import ConfigError

placement_app = typer.Typer(help="Place jobs and explain placements.", no_args_is_help=True)
out = Console()


def _job(path: Path) -> Any:
    from dsec.launch.jobfile import load_job

    try:
        return load_job(path)
    except ConfigError as exc:
        raise fail(exc, 2) from None


def explain_table(p: dict[str, Any]) -> Table:
    t = Table(title=f"placement of {p['job']}: score {p['score']:g}" + ("" if p["complete"] else " (INCOMPLETE)"))
    for col in ("worker", "group", "role", "device", "node", "numa", "score", "terms"):
        t.add_column(col)
    for a in p["assignments"]:
        terms = ", ".join(f"{k} {v:+g}" for k, v in a["terms"].items() if v)
        t.add_row(
            a["worker"], a["group"], a["role"], a["device"], a["node"], str(a["numa_node"]), f"{a['score']:g}", terms
        )
    return t


def _print(p: dict[str, Any]) -> None:
    out.print(explain_table(p))
    for worker, why in p["unplaced"].items():
        out.print(f"[red]unplaced[/red] {worker}: {why}", highlight=False)
    if p["excluded"]:
        out.print("excluded: " + "; ".join(f"{d} ({why})" for d, why in p["excluded"].items()), highlight=False)


@placement_app.command("plan")
def plan(
    job: Annotated[Path, typer.Argument(help="Job file.")],
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
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
    out.print_json(json.dumps(p)) if as_json else _print(p)


@placement_app.command("explain")
def explain(
    job: Annotated[str, typer.Argument(help="Job name.")],
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show a job's placement: each worker's device and the score of every term that put it there."""
    from dsec.client import ClientError

    with admin_client(endpoint, admin_token) as c:
        try:
            p = c.placement(job)
        except ClientError as exc:
            raise fail(exc) from None
    out.print_json(json.dumps(p)) if as_json else _print(p)


def launch(
    job: Annotated[Path, typer.Argument(help="Job file (see examples/jobs/ppo.yaml).")],
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
    token: Annotated[str | None, typer.Option(envvar="DSEC_TOKEN", help="Pool token for the workers' probes.")] = None,
    log_dir: Annotated[Path, typer.Option(help="Worker logs.")] = Path(".dsec/logs"),
    timeout: Annotated[float | None, typer.Option(help="Give up after this many seconds.")] = None,
) -> None:
    """Place a job, start its workers (local processes or Ray), and restart failed groups from their snapshots."""
    from dsec.client import ClientError
    from dsec.launch import make_launcher
    from dsec.launch.supervisor import Recovery, Supervisor

    spec = _job(job)

    def report(r: Recovery) -> None:
        out.print(f"recovered group {r.group}: " + json.dumps(r.timings()), highlight=False, soft_wrap=True)

    with admin_client(endpoint, admin_token) as c:
        launcher = make_launcher(spec.launcher, log_dir=log_dir, base_env=dict(os.environ), warm=spec.warm_standby)
        sup = Supervisor(spec, launcher, client=c, endpoint=endpoint, pool_token=token, on_recovery=report)
        try:
            sup.start()
            out.print(
                f"started {spec.job}: "
                + ", ".join(f"{a['worker']}@{a['device']}" for a in sup.placement["assignments"])
            )
            ok = sup.run(timeout)
        except (ClientError, RuntimeError) as exc:
            raise fail(exc) from None
        finally:
            sup.stop()
    if not ok:
        raise fail(f"job {spec.job} did not finish: {sup.failed or 'timeout'}")
    out.print(f"job {spec.job} finished ({sum(sup.restarts.values())} restart(s))")
