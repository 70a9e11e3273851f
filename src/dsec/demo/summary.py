"""The summary ``dsec demo`` ends with: a table, and the same facts as data (``--summary-json``: what tests read, not
the rendering)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.table import Table

from dsec.demo import observe as observe_scenes
from dsec.demo import simulation as simulation_scene
from dsec.demo import snapshots as snapshot_scenes
from dsec.demo.scenes import HEADLINE_METRICS
from dsec.demo.state import POOL, DemoRun


def summary(run: DemoRun, scenes_ok: dict[str, bool], elapsed: float) -> tuple[Table, dict[str, Any]]:
    """The summary table, and the same facts as data (``--summary-json``: what tests read, not the rendering)."""
    table = Table(title="DSec demo summary", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows: dict[str, str] = {}

    def add(key: str, value: str) -> None:
        table.add_row(key, value)
        if key and key not in scenes_ok:  # scenes and notes go into the data as such
            rows[key] = value

    ws = run.client.workers()
    evs = run.client.all_events()
    st = run.client.status()
    for key, value in _run_rows(run, ws, evs, st, elapsed):
        add(key, value)
    for key, value in _capability_rows(run):
        add(key, value)
    for title, ok in scenes_ok.items():
        add(title, "[green]ok" if ok else "[red]FAILED")
    for note in run.notes:
        add("", note)
    data = {
        "scenes": scenes_ok,
        "rows": rows,
        "notes": list(run.notes),
        "workers": dict(Counter(w["state"] for w in ws)),
        "events": dict(Counter(e["type"] for e in evs)),
    }
    return table, data


def _run_rows(
    run: DemoRun, ws: list[dict[str, Any]], evs: list[dict[str, Any]], st: dict[str, Any], elapsed: float
) -> list[tuple[str, str]]:
    """The run as a whole: wall time, workers, heartbeats, events, what the learners did, the PPO result."""
    rows: list[tuple[str, str]] = []
    rows.append(("wall time", f"{elapsed:.1f} s"))
    rows.append(("workers", ", ".join(f"{c} {s}" for s, c in sorted(Counter(w["state"] for w in ws).items()))))
    rows.append(("heartbeats", str(st["heartbeats"])))
    rows.append(("events", ", ".join(f"{ty}={n}" for ty, n in sorted(Counter(e["type"] for e in evs).items()))))
    learners = sorted((w for w in ws if w["role"] == "learner"), key=lambda w: w["rank"])
    rows.append(
        (
            "learner updates / env steps (probe)",
            ", ".join(
                f"rank {w['rank']}: {int(m.get('updates_total', 0))} / {int(m.get('env_steps_total', 0))}"
                for w in learners
                for m in (w["metrics"],)
            ),
        )
    )
    rows.append(
        (
            "learner grad syncs, p99 sync ms",
            ", ".join(
                f"rank {w['rank']}: {int(w['metrics'].get('sync_ops_total', 0))}, "
                f"{w['metrics'].get('sync_latency_ms_p99', float('nan')):.2f}"
                for w in learners
            ),
        )
    )
    ppo = run.state.get("ppo", {})
    if ppo:
        rows.append(
            (
                "PPO (examples/ppo_cartpole_ddp.py)",
                f"average return {ppo.get('avg_return', float('nan')):.1f} after {ppo.get('env_steps')} env steps, "
                f"{ppo.get('updates')} updates, {ppo.get('seconds', 0):.1f} s"
                + (" — reached 475" if ppo.get("reached") else ""),
            )
        )
    return rows


def _capability_rows(run: DemoRun) -> list[tuple[str, str]]:
    """What the capability scenes measured: snapshots, the simulation, cost, the headline gauges mid-run."""
    rows: list[tuple[str, str]] = []
    rows.extend(snapshot_scenes.summary_rows(run))
    if "simulation" in run.state:
        rows.extend(simulation_scene.summary_rows(run.state["simulation"]))
    if "cost" in run.state:
        rows.extend(observe_scenes.cost_rows(run.state["cost"]))
    metrics_text = run.state.get("metrics_text", "")
    for name in HEADLINE_METRICS:
        line = next((ln for ln in metrics_text.splitlines() if ln.startswith(f'{name}{{pool="{POOL}"}}')), None)
        rows.append((f"{name} (mid-run)", line.split(" ", 1)[1] if line else "missing"))
    return rows
