"""``dsec simulate SCENARIO.yaml``: the cluster simulator, baseline vs DSec on one seeded fault trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dsec.cli_common import fail
from dsec.cli_progress import ShowProgress, bars
from dsec.yamlconf import ConfigError

out = Console()


def simulate(
    scenario: Annotated[Path, typer.Argument(help="Scenario file (examples/scenarios/).")],
    hours: Annotated[float | None, typer.Option(min=0.01, max=720, help="Override the simulated duration.")] = None,
    seed: Annotated[int | None, typer.Option(help="Override the scenario's seed.")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override any scenario field, e.g. --set dsec.latency_cap_ms=50 (repeatable)."),
    ] = None,
    report: Annotated[
        Path | None, typer.Option(help="Directory for report.md + PNG plots (default: dsec-sim-<scenario>).")
    ] = None,
    no_report: Annotated[bool, typer.Option("--no-report", help="Print the figures only.")] = False,
    publish: Annotated[
        bool,
        typer.Option(
            "--publish/--no-publish",
            help="Copy the report's plots to $DSEC_PLOTS_DIR (default: $DSEC_HOME/plots), where the dashboard of "
            "`dsec serve` shows the latest run's.",
        ),
    ] = True,
    sweep: Annotated[
        bool, typer.Option("--sweep", help="Also run the sensitivity sweep (jitter, OOM rate, latency cap).")
    ] = False,
    sweep_hours: Annotated[float, typer.Option(min=0.01, max=720, help="Simulated hours per sweep point.")] = 6.0,
    as_json: Annotated[bool, typer.Option("--json", help="End with the benchmark's one-line JSON.")] = False,
    show_progress: ShowProgress = None,
) -> None:
    """Simulate SCENARIO under the baseline (Kubernetes + torchrun practice) and under DSec's own decision code, on
    the same seeded fault trace, in virtual time; report goodput, GPU-hours lost, interruptions, recovery."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise fail("the simulator needs numpy: pip install 'dsec[sim]'", 2) from None
    from dsec.sim.report import write_report

    sc = _scenario(scenario, set_, hours, seed)
    comparison = _compare(sc, show_progress)
    _table(comparison)
    rows = None
    if sweep:
        rows = _sweep(sc, sweep_hours, show_progress)
    if not no_report:
        target = report or Path(f"dsec-sim-{sc.name}")
        path = write_report(comparison, target, rows)
        out.print(f"report: {path}")
        if publish:
            _publish(comparison, target)
    if as_json:
        headline = comparison.headline()
        if rows is not None:
            headline["sweep"] = rows
        sys.stdout.flush()
        print(json.dumps(headline), flush=True)


def _scenario(scenario: Path, set_: list[str] | None, hours: float | None, seed: int | None) -> Any:
    """The scenario file with the --set, --hours and --seed overrides (exit 2 when it is invalid)."""
    from dsec.sim.scenario import load_scenario, with_overrides

    settings = list(set_ or [])
    settings += [f"duration_h={hours}"] if hours is not None else []
    settings += [f"seed={seed}"] if seed is not None else []
    try:
        return with_overrides(load_scenario(scenario), settings)
    except ConfigError as exc:
        raise fail(str(exc), 2) from None


def _compare(sc: Any, show_progress: bool | None) -> Any:
    """Both regimes on the scenario's fault trace (exit 2 when a policy file the scenario names is invalid)."""
    from dsec.sim.runner import REGIMES
    from dsec.sim.runner import simulate as run_simulation

    with bars(show_progress) as b:
        task = b.task(f"simulating {sc.name}", total=sc.duration_h * len(REGIMES), unit="simulated h")
        try:
            comparison = run_simulation(sc, on_progress=task.update)
        except ConfigError as exc:  # a policy file the scenario names
            comparison, failed = None, str(exc)
    if comparison is None:
        raise fail(failed, 2)
    return comparison


def _sweep(sc: Any, sweep_hours: float, show_progress: bool | None) -> list[dict[str, Any]]:
    """The sensitivity sweep's rows; its findings printed."""
    from dsec.sim.sweep import findings, points
    from dsec.sim.sweep import sweep as run_sweep

    with bars(show_progress) as b:
        b.note(f"sweep: {sweep_hours:g} simulated hours per point, both regimes each")
        task = b.task("sweep", total=len(points(sc)), unit="points")

        def progress(p: Any, row: dict[str, Any]) -> None:
            b.note(f"  {p.parameter} = {p.value:g}: goodput ratio {row['goodput_ratio']}")
            task.advance()

        rows = run_sweep(sc, hours=sweep_hours, progress=progress)
    for line in findings(rows):
        out.print(f"[bold]sweep:[/] {line}")
    return rows


def _publish(c: Any, report: Path) -> None:
    from dsec.plots import plots_dir
    from dsec.plots import publish as publish_plots

    sc, target = c.scenario, plots_dir()
    run = {"scenario": sc.name, "seed": sc.seed, "simulated_h": sc.duration_h, "workers": sc.workers}
    try:
        names = publish_plots(report, target, run)
    except OSError as exc:  # the report is written; the dashboard copy is a convenience
        Console(stderr=True).print(f"plots not published to {target}: {exc}", markup=False, highlight=False)
        return
    out.print(f"plots for the dashboard: {target} ({', '.join(names)})", markup=False, highlight=False, soft_wrap=True)


def _table(c: Any) -> None:
    from dsec.sim.report import SUMMARY_ROWS, cell

    b, d = c.summary(c.comparator), c.summary("dsec")
    h = c.headline()
    t = Table(title=f"{c.scenario.name}: {c.scenario.workers} workers, {c.scenario.duration_h:g} simulated hours")
    t.add_column("")
    t.add_column(f"{c.comparator} baseline", justify="right")
    t.add_column("DSec", justify="right")
    for label, key, fmt in SUMMARY_ROWS:
        t.add_row(label, cell(b[key], fmt), cell(d[key], fmt))
    out.print(t)
    out.print(
        f"goodput ratio DSec/{c.comparator} baseline: [bold]{h['goodput_ratio']}[/] "
        f"(naive: {h['goodput_ratio_naive']}); captured share of the recoverable loss: [bold]{h['captured_share']}[/]"
        f"   simulation speed: {d['sim_speedup']}x real "
        f"time ({d['wall_s']} s wall for DSec, {b['wall_s']} s for the baseline)"
    )
