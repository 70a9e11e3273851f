"""Demo scenes for state snapshots: ask the learners for periodic snapshots and one on demand, then compare
what they cost with a full checkpoint of the same state (measured here, with torch.save + fsync)."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.demo import DemoRun

SNAPSHOT_INTERVAL_S = 3.0


def request_snapshots(run: DemoRun) -> bool:
    learners = run.worker_ids("learner")
    if not learners:
        return False
    for w in learners:
        run.client.set_directive(w["id"], snapshot_interval_s=SNAPSHOT_INTERVAL_S, snapshot_now="demo-first")
    run.notes.append(
        f"asked {len(learners)} learners for a snapshot now (request 'demo-first') and every {SNAPSHOT_INTERVAL_S:g} s"
    )
    return True


def _checkpoint_ms(nbytes: int) -> float:
    """A full checkpoint of ``nbytes`` of float32 state: torch.save + fsync, as a training loop would do it."""
    import torch

    state = {"w": torch.randn(max(1, nbytes // 4))}
    with tempfile.NamedTemporaryFile(prefix="dsec-ckpt-") as fh:
        t0 = time.perf_counter()
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
        return (time.perf_counter() - t0) * 1e3


def snapshots_taken(run: DemoRun) -> bool:
    events = [e for e in run.client.all_events(types=["snapshot"]) if e["data"].get("status") == "ok"]
    if not events:
        run.notes.append("snapshots: none reported")
        return False
    data = [e["data"] for e in events]
    requested = [d for d in data if "demo-first" in d.get("requests", [])]
    full = max(int(d.get("full_bytes") or 0) for d in data)
    deltas = [d["bytes"] for d in data if d.get("kind") == "delta"] or [d["bytes"] for d in data]
    blocking = statistics.median(float(d.get("blocking_ms") or 0) for d in data)
    background = statistics.median(float(d.get("total_ms") or 0) for d in data)
    ckpt_ms = _checkpoint_ms(full)
    run.state["snapshot_summary"] = (
        f"{len(data)} snapshots ({data[0].get('mode')}); full state {full / 1024:.0f} KiB, incremental "
        f"{statistics.median(deltas) / 1024:.1f} KiB ({full / max(statistics.median(deltas), 1):.0f}x smaller); "
        f"training blocked {blocking:.2f} ms (median), background {background:.0f} ms; a full checkpoint of the same "
        f"state (torch.save + fsync, measured here): {ckpt_ms:.1f} ms blocking"
    )
    return bool(requested)


def restored(run: DemoRun) -> bool:
    events = run.client.all_events(types=["restore"])
    ok = [e for e in events if e["data"].get("status") == "ok"]
    for e in ok[:2]:  # the first restart (from the first run's snapshots); the recovery reports its own
        run.notes.append(
            f"restored: {e['worker_id']} resumed from snapshot {e['data']['id']} "
            f"(step {e['data']['step']}) in {e['data']['restore_s'] * 1e3:.0f} ms"
        )
    gauge = next(
        (ln for ln in run.client.metrics_text().splitlines() if ln.startswith("dsec_snapshot_recovery_time{")), None
    )
    if gauge:
        run.notes.append(f"after the restart: {gauge}")
    others = [e for e in events if e["data"].get("status") != "ok"]
    for e in others:
        run.notes.append(f"restore on {e['worker_id']}: {e['data']}")
    return bool(ok) and not others


def keeps_learning(run: DemoRun, before: dict[str, Any], after: dict[str, Any]) -> bool:
    """The restored run starts where the first run ended, not where it began: the average return of the restored
    run's *first* full window of episodes is at least 3x the first run's first window (a fresh start: ~20 on
    CartPole). The final return is no evidence either way: PPO relearns CartPole from scratch in ~8 s here, about
    as long as the restored run trains."""
    fresh, restored = before.get("first_window_return"), after.get("first_window_return")
    if fresh is None or restored is None:
        run.notes.append(f"restored PPO run: no first-window return (first run {fresh}, restored run {restored})")
        return False
    ok = float(restored) >= 3.0 * float(fresh)
    run.notes.append(
        f"restored PPO run: its first window of episodes averaged return {restored} (a fresh start: {fresh}; "
        f"the first run ended at {before.get('avg_return')}); "
        f"{after.get('avg_return')} after {after.get('seconds')} s"
    )
    return ok


def summary_rows(run: DemoRun) -> list[tuple[str, str]]:
    rows: list[tuple[str, Any]] = []
    if "snapshot_summary" in run.state:
        rows.append(("state snapshots", run.state["snapshot_summary"]))
    return [(k, str(v)) for k, v in rows]
