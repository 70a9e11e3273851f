"""Demo phase for memory quotas: a learner whose memory climbs slowly on a shared card (the probe's stand-in,
dsec.probe.fake_card) meets its quota's ceiling and is drained before the cap — a snapshot at the last step that fits,
a planned stop, a restart from that snapshot — instead of dying of an out-of-memory error (dsec.probe.recycle).

The pool's base and ceiling are set 0.5 GB apart for the scene (7.5 and 8 GB on an 80 GB card), so that a climb
slower than a burst (0.045 GB/s; the control plane stops those at the ceiling) reaches it within seconds."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.demo.recovery import _wait
from dsec.launch.jobfile import JobFile
from dsec.launch.local import LocalLauncher
from dsec.launch.supervisor import Recovery, Supervisor

if TYPE_CHECKING:
    from dsec.demo import DemoRun

CARD_GB, BASE_GB, CEILING_GB = 80.0, 7.5, 8.0
# What the learner holds from its first step: its base grant exactly (over 85 % of it, so the grant grows to the
# ceiling). Until 2026-12-06 it could not be more: a new worker's allocator cap was its base grant until its first
# quota plan, and a restarted process that registered before its first step failed there (one demo run of three).
# Registration now issues the pool's ceiling as the limit (DirectiveFields.for_pool).
HELD_GB = BASE_GB
CLIMB_MB_PER_S = 46  # 0.045 GB/s: below the 0.05 GB/s of a burst
CLIMB_AFTER_S = 4.0  # after training starts: the limit at the ceiling is in force by then (quota plans every 2 s)
# The burst scene: a sparse-reward rollout's rate (0.4 GB/s) for 2 GB over the held 7.5, on a 9 GB card: it fails at
# its limit or at the card, ~1-4 s after it starts; the probe sees it rising 2 s ahead and snapshots first.
BURST_CARD_GB, BURST_MB_PER_S, BURST_MB = 9.0, 410, 2048


def memory_drain(run: DemoRun, pool: str, endpoint: str, home: Path) -> dict[str, Any]:
    """One learner under the supervisor in ``pool`` (the pool's ceiling lowered for the scene, restored after): wait
    for its drain and for the restarted process to restore and train; what happened, for :func:`drained`."""
    card = f"path={home / 'card-memory'},memory_gb={CARD_GB:g},base_gb={HELD_GB:g}"
    chaos = f"memory_growth_mb_per_s={CLIMB_MB_PER_S},max_mb=8192,after_s={CLIMB_AFTER_S:g}"
    return _memory_scene(run, pool, endpoint, home, "memory", "climber", card, chaos, interval_s=2)


def memory_burst(run: DemoRun, pool: str, endpoint: str, home: Path) -> dict[str, Any]:
    """One learner whose memory bursts past what its card has (a 9 GB stand-in; snapshots every minute): wait for
    the burst's OOM and for the restarted process to restore and train; what happened, for :func:`burst_saved`."""
    card = f"path={home / 'card-burst'},memory_gb={BURST_CARD_GB:g},base_gb={HELD_GB:g}"
    chaos = f"memory_growth_mb_per_s={BURST_MB_PER_S},max_mb={BURST_MB},after_s={CLIMB_AFTER_S:g}"
    return _memory_scene(run, pool, endpoint, home, "burst", "burster", card, chaos, interval_s=60)


def _memory_scene(
    run: DemoRun,
    pool: str,
    endpoint: str,
    home: Path,
    scene: str,
    group: str,
    card: str,
    chaos: str,
    interval_s: float,
) -> dict[str, Any]:
    """Group ``group`` (one learner on the fake ``card`` with ``chaos`` memory growth) under the supervisor in
    ``pool``, its base and ceiling set for the scene (restored after), until it was restarted and restored."""
    spec = run.client.request("GET", f"/v1/pools/{pool}")
    kept = {k: v for k, v in spec.items() if k != "name"}
    run.client.put_pool(pool, **{**kept, "memory_base_gb": BASE_GB, "memory_ceiling_gb": CEILING_GB})
    stop = home / f"{scene}-stop"
    job = JobFile.model_validate(
        {
            "job": f"demo-{scene}",
            "pool": pool,
            # The failure-history cadence (the job file's default), ``interval_s`` its prior: the scene's restart
            # was foreseen (a burst's snapshot, a drain's), so it must not count as a rollback (launch/foreseen.py).
            "snapshots": {"dir": str(home / f"snapshots-{scene}"), "interval_s": interval_s},
            "restart": {"max_restarts": 2, "resume_timeout_s": 30},
            "groups": [
                {
                    "name": group,
                    "world_size": 1,
                    "memory_gb": BASE_GB,
                    "env": {"DSEC_HEARTBEAT_INTERVAL": "0.5", "DSEC_FAKE_CARD": card, "DSEC_CHAOS": chaos},
                    "command": [sys.executable, "-m", "dsec.demo.workload", "120", "--learn", "--pause", "0.01",
                                "--stop-file", str(stop)],
                }
            ],
        }
    )  # fmt: skip
    launcher = LocalLauncher(log_dir=home / f"launch-{scene}")
    recoveries: list[Recovery] = []
    sup = Supervisor(job, launcher, client=run.client, endpoint=endpoint, pool_token=run.client.create_token(pool),
                     poll_s=0.05, on_recovery=recoveries.append)  # fmt: skip
    t0 = time.time()

    def logs() -> list[dict[str, Any]]:
        return [e["data"] for e in run.client.all_events(pool=pool, types=["log"], since=t0)]

    def restored() -> list[dict[str, Any]]:
        evs = run.client.all_events(pool=pool, types=["restore"], since=t0)
        return [e["data"] for e in evs if e["data"].get("status") == "ok"]

    out: dict[str, Any] = {}
    try:
        sup.start()
        _wait(sup, lambda: recoveries and restored(), 60)
        out["recycles"] = [d for d in logs() if "memory_recycle" in d]
        out["bursts"] = [d for d in logs() if "memory_burst_snapshot" in d]
        out["ooms"] = [d for d in logs() if "oom" in d]
        out["restores"] = restored()
        out["recovery"] = recoveries[0].timings() if recoveries else None
        out["rollbacks"] = sup.rollbacks[group]  # what the learners' cadence is told of this restart
        out["seconds"] = round(time.time() - t0, 1)
        stop.touch()
        out["finished"] = sup.run(timeout_s=20)
    finally:
        sup.stop()
        run.client.put_pool(pool, **kept)
    return out


def drained(run: DemoRun, m: dict[str, Any]) -> bool:
    recycles, restores = m.get("recycles") or [], m.get("restores") or []
    if not recycles:
        run.notes.append(f"memory drain: no drain before the cap ({len(m.get('ooms') or [])} OOMs)")
        return False
    r = recycles[0]
    seq = r.get("snapshot")
    back = [d for d in restores if str(d.get("id", "")).rsplit("/", 1)[-1] == str(seq)]
    ooms = len(m.get("ooms") or [])
    where = f"its limit at the ceiling ({r.get('limit_gb')} GB)"
    what = f"snapshot {seq} written, process stopped, restarted from it ({'restored' if back else 'not restored'})"
    slope = r.get("slope_gb_per_s") or 0.0
    run.notes.append(
        f"memory climbing {slope:.3f} GB/s into {where}: drained at {r.get('held_gb')} GB held; {what}; "
        f"{ooms} OOMs; {_counted(m)}; {m.get('seconds')} s"
    )
    return bool(back) and not m.get("ooms") and m.get("rollbacks") == 0 and bool(m.get("finished"))


def _counted(m: dict[str, Any]) -> str:
    return f"rollbacks counted for the snapshot cadence: {m.get('rollbacks')} (the restart was foreseen)"


def burst_saved(run: DemoRun, m: dict[str, Any]) -> bool:
    """The burst was snapshotted as it rose, its OOM came after, and the restart resumed from that snapshot: the
    steps lost are those between the snapshot and the OOM (the periodic snapshot was a minute away)."""
    bursts, ooms, restores = m.get("bursts") or [], m.get("ooms") or [], m.get("restores") or []
    if not bursts or not ooms or not restores:
        run.notes.append(
            f"memory burst: {len(bursts)} burst snapshots, {len(ooms)} OOMs, {len(restores)} restores "
            "(expected at least one of each)"
        )
        return False
    b, oom, back = bursts[0], ooms[0], restores[0]
    snap_step, oom_step, restored_step = b.get("step"), oom.get("step"), back.get("step")
    lost = oom_step - restored_step if isinstance(oom_step, int) and isinstance(restored_step, int) else None
    run.notes.append(
        f"memory bursting {b.get('slope_gb_per_s') or 0.0:.2f} GB/s toward its limit ({b.get('limit_gb')} GB) or the "
        f"card's room ({b.get('room_gb')} GB): snapshot at step {snap_step}, OOM at step {oom_step}, restarted from "
        f"step {restored_step} ({lost} steps lost; the periodic snapshot was a minute apart); {_counted(m)}; "
        f"{m.get('seconds')} s"
    )
    return lost is not None and 0 <= lost <= 500 and m.get("rollbacks") == 0 and bool(m.get("finished"))
