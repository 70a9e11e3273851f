"""``dsec policy validate | test | apply | show`` and ``dsec metrics export``."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from dsec.cli_common import DEFAULT_ENDPOINT, AdminToken, Endpoint, admin_client, err, fail
from dsec.yamlconf import ConfigError

policy_app = typer.Typer(help="Validate, test (what-if replay), apply and inspect policy files.", no_args_is_help=True)
metrics_app = typer.Typer(help="Export the metric history policies read.", no_args_is_help=True)
out = Console()


def _load(path: Path) -> Any:
    from dsec.policy import load_policies

    try:
        return load_policies(path)
    except ConfigError as exc:
        raise fail(str(exc), 1) from None


@policy_app.command("validate")
def validate(files: Annotated[list[Path], typer.Argument(help="Policy files.")]) -> None:
    """Check policy files; every problem as FILE:LINE:COLUMN: where: what. Exit 1 on any error."""
    bad = 0
    for f in files:
        from dsec.policy import load_policies

        try:
            ps = load_policies(f)
        except ConfigError as exc:
            bad += 1
            err.print(str(exc), markup=False, highlight=False, soft_wrap=True)
            continue
        names = ", ".join(r.name for r in ps.rules)
        out.print(f"{f}: {len(ps.rules)} rule(s) ok: {names}", highlight=False, soft_wrap=True)
    if bad:
        raise typer.Exit(1)


def _parse_sets(items: list[str]) -> dict[tuple[str, str], float]:
    initial: dict[tuple[str, str], float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        scope, dot, knob = key.rpartition(".")
        try:
            if not sep or not dot:
                raise ValueError
            initial[(scope, knob)] = float(value)
        except ValueError:
            raise fail(f"--set {item!r} is invalid: expected SCOPE.KNOB=NUMBER, e.g. pool-0.gpu_quota=2", 2) from None
    return initial


def _when(t: float, start: float) -> str:
    rel = round(t - start)
    stamp = datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"{stamp} (+{rel // 3600:02d}:{rel % 3600 // 60:02d}:{rel % 60:02d})"


@policy_app.command("test")
def test(
    file: Annotated[Path, typer.Argument(help="Policy file.")],
    series: Annotated[Path, typer.Option("--series", help="Series JSON (from `dsec metrics export`, or synthetic).")],
    step: Annotated[str, typer.Option(help="Evaluation interval in virtual time.")] = "15s",
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Starting knob value, SCOPE.KNOB=N (e.g. pool-0.gpu_quota=2).")
    ] = None,
    show_states: Annotated[bool, typer.Option("--states", help="Also print pending/firing/resolved changes.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of text.")] = False,
) -> None:
    """Replay SERIES through the rules in virtual time and print what they would do, with timestamps."""
    from dsec.policy.expr import parse_duration
    from dsec.policy.replay import replay
    from dsec.policy.series import SeriesStore

    policies = _load(file)
    initial = _parse_sets(set_ or [])
    try:
        step_s = parse_duration(step)
    except ValueError as exc:
        raise fail(f"--step: {exc}", 2) from None
    try:
        data = json.loads(series.read_text())
        store = SeriesStore.from_export(data)
        result = replay(policies, store, step_s=step_s, initial=initial)
    except OSError as exc:
        raise fail(f"{series}: cannot read: {exc.strerror}", 2) from None
    except ValueError as exc:  # JSON, series shape, duration
        raise fail(f"{series}: {exc}", 2) from None
    rows: list[tuple[float, dict[str, Any]]] = [(d.at, {"kind": "action", **d.to_event()}) for d in result.decisions]
    if show_states:
        rows += [
            (t.at, {"kind": "state", **{k: v for k, v in t.to_event().items() if k != "state"}})
            for t in result.transitions
        ]
    rows.sort(key=lambda r: (r[0], r[1]["kind"] == "action"))  # a state change before what it caused
    for at, row in rows:
        if as_json:
            out.print(json.dumps({"t": at, **row}), markup=False, highlight=False, soft_wrap=True)
        elif row["kind"] == "action":
            change = f"{row['old']:g} -> {row['new']:g}" if row["new"] is not None and row["old"] is not None else "-"
            value = row["evidence"].get("observed")
            ev = "" if value is None or (isinstance(value, float) and math.isnan(value)) else f" (observed {value:g})"
            detail = f": {row['detail']}" if row.get("detail") else ""
            out.print(f"{_when(at, result.start)}  {row['rule']}  {row['scope']}  {row['knob']} {change}  "
                      f"{row['outcome']}{ev}{detail}", markup=False, highlight=False, soft_wrap=True)  # fmt: skip
        else:
            out.print(f"{_when(at, result.start)}  {row['rule']}  {row['scope']}  -> {row['phase']}",
                      markup=False, highlight=False, soft_wrap=True)  # fmt: skip
    if not as_json:
        applied = sum(1 for d in result.decisions if d.outcome == "applied")
        span_h = (result.end - result.start) / 3600
        out.print(f"{len(result.decisions)} decision(s), {applied} applied, over {span_h:.2f} h of series "
                  f"(step {step})", highlight=False)  # fmt: skip


@policy_app.command("apply")
def apply(
    file: Annotated[Path, typer.Argument(help="Policy file.")],
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
) -> None:
    """Validate FILE here, then hot-reload it in the running control plane (which validates it again)."""
    from dsec.client import ClientError

    ps = _load(file)
    with admin_client(endpoint, admin_token) as c:
        try:
            c.put_policies(file.read_text(), str(file))
        except ClientError as exc:
            raise fail(str(exc)) from None
    out.print(f"applied {file}: {len(ps.rules)} rule(s): {', '.join(r.name for r in ps.rules)}", highlight=False)


@policy_app.command("show")
def show(endpoint: Endpoint = DEFAULT_ENDPOINT, admin_token: AdminToken = None) -> None:
    """The rules in force and their state per scope."""
    from dsec.client import ClientError

    with admin_client(endpoint, admin_token) as c:
        try:
            out.print_json(json.dumps(c.policies()))
        except ClientError as exc:
            raise fail(str(exc)) from None


@metrics_app.command("export")
def export(
    output: Annotated[Path, typer.Option("--out", "-o", help="Write the series JSON here.")],
    endpoint: Endpoint = DEFAULT_ENDPOINT,
    admin_token: AdminToken = None,
) -> None:
    """Save the sampled gauge history (the input of `dsec policy test --series`)."""
    from dsec.client import ClientError

    with admin_client(endpoint, admin_token) as c:
        try:
            data = c.metric_series()
        except ClientError as exc:
            raise fail(str(exc)) from None
    output.write_text(json.dumps(data))
    out.print(f"{len(data['series'])} series -> {output}", highlight=False)
