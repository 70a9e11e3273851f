"""Demo phase for room for a burst (dsec.quota.room): a learner and two env runners share one card; the learner's
memory starts to burst; the control plane sees the card about to fill and asks for an actor to move (a ``room``
event); the supervisor moves that actor alone to another node's card, before anyone runs out of memory. The learner
and the other actor keep their processes, and the move uses up no restart.

No GPU here: the learner's growth is real host pages (``DSEC_CHAOS`` memory growth), which the probe reports as the
process's memory (its RSS) where no CUDA device is; the card is three process slots declared with one ``card``
(docs/scheduling.md, "Inventory"), 2 GB, so that a burst of 100 MB/s fills it within seconds. The scene's pool gets
those devices for the scene and its own back after."""

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

CARD = "room-card0"
CARD_GB = 2.0
#: Three slots of one card on node-0 (the learner and its two actors are placed next to each other), two cards of
#: their own on node-1: where a moved actor goes.
DEVICES = {
    "room-0a": ("node-0", CARD),
    "room-0b": ("node-0", CARD),
    "room-0c": ("node-0", CARD),
    "room-1a": ("node-1", None),
    "room-1b": ("node-1", None),
}
BASE_GB, CEILING_GB = 0.5, 1.5
# 100 MB/s (a burst: over 0.05 GB/s) up to the card's whole memory, a few seconds after training starts.
CHAOS = "memory_growth_mb_per_s=100,max_mb=2048,after_s=6"


def room_for_burst(run: DemoRun, pool: str, endpoint: str, home: Path) -> dict[str, Any]:
    """The learner and two actors on one card under the supervisor in ``pool`` (devices and quotas set for the scene,
    restored after), until an actor was moved for the learner's burst and registered again; what happened, for
    :func:`made_room`."""
    for dev, (node, card) in DEVICES.items():
        body: dict[str, Any] = {"id": dev, "node": node, "memory_gb": CARD_GB}
        if card is not None:
            body["card"] = card
        run.client.request("PUT", f"/v1/devices/{dev}", json=body)
    spec = run.client.request("GET", f"/v1/pools/{pool}")
    kept = {k: v for k, v in spec.items() if k != "name"}
    run.client.put_pool(
        pool, **{**kept, "devices": list(DEVICES), "memory_base_gb": BASE_GB, "memory_ceiling_gb": CEILING_GB}
    )
    stop = home / "room-stop"
    # 0.5 s beats: a learner that stalls ~1 s while it touches new pages on a busy machine keeps within its 3 beats.
    env = {"DSEC_HEARTBEAT_INTERVAL": "0.5", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dsec.demo.workload", "120", "--pause", "0.01", "--stop-file", str(stop)]
    job = JobFile.model_validate(
        {
            "job": "demo-room",
            "pool": pool,
            "snapshots": {"dir": str(home / "snapshots-room"), "interval_s": 5},
            "restart": {"max_restarts": 0, "resume_timeout_s": 30},
            "groups": [
                {"name": "learner", "world_size": 1, "memory_gb": BASE_GB,
                 "env": {**env, "DSEC_CHAOS": CHAOS}, "command": [*command, "--learn"]},
                {"name": "actors", "role": "actor", "world_size": 2, "memory_gb": BASE_GB, "env": env,
                 "command": command},
            ],
        }
    )  # fmt: skip
    launcher = LocalLauncher(log_dir=home / "launch-room")
    recoveries: list[Recovery] = []
    sup = Supervisor(job, launcher, client=run.client, endpoint=endpoint, pool_token=run.client.create_token(pool),
                     poll_s=0.05, device_check_s=0.2, on_recovery=recoveries.append)  # fmt: skip
    t0 = time.time()
    out: dict[str, Any] = {}
    try:
        sup.start()
        out["placed"] = {a["worker"]: a["device"] for a in sup.placement["assignments"]}
        _wait(sup, lambda: len([w for w in run.client.workers(pool=pool) if w["state"] == "active"]) == 3, 60)
        before = {**launcher.pids("learner"), **launcher.pids("actors")}
        _wait(sup, lambda: recoveries and recoveries[0].resumed_at is not None, 60)
        after = {**launcher.pids("learner"), **launcher.pids("actors")}
        out["rooms"] = [e["data"] for e in run.client.all_events(pool=pool, types=["room"], since=t0)]
        out["recovery"] = recoveries[0].timings() if recoveries else None
        moved = recoveries[0].worker if recoveries else None
        out["kept"] = {w: after.get(w) == pid for w, pid in before.items() if w != moved}
        out["replaced"] = moved is not None and after.get(moved) not in (None, before.get(moved))
        out["ooms"] = [
            e["data"] for e in run.client.all_events(pool=pool, types=["log"], since=t0) if "oom" in e["data"]
        ]
        out["restarts"] = dict(sup.restarts)
        out["seconds"] = round(time.time() - t0, 1)
        stop.touch()
        out["finished"] = sup.run(timeout_s=30)
    finally:
        stop.touch()
        sup.stop()
        run.client.put_pool(pool, **kept)
    return out


def made_room(run: DemoRun, m: dict[str, Any]) -> bool:
    """One room event for the card, the actor it named moved alone to the other node (no restart used up), the
    learner and the other actor still in their processes, no OOM."""
    rooms, rec = m.get("rooms") or [], m.get("recovery") or {}
    if not rooms or not rec:
        run.notes.append(f"room for a burst: {len(rooms)} room events, recovery {rec or 'none'} (expected one each)")
        return False
    room = rooms[0]
    placed = m.get("placed") or {}
    moved = rec.get("worker")
    to = (rec.get("devices") or {}).get(moved)
    to_node = DEVICES.get(to, ("?", None))[0] if to else "?"
    kept = m.get("kept") or {}
    run.notes.append(
        f"room for a burst: card {room.get('card')} projected {room.get('projected_gb')} GB of {CARD_GB:g} "
        f"(bursting: {room.get('bursting')}); {moved} moved alone {placed.get(moved)} -> {to} ({to_node}, reason "
        f"{rec.get('reason')}); kept their processes: {', '.join(w for w, ok in sorted(kept.items()) if ok)}; "
        f"restarts used {m.get('restarts')}; {len(m.get('ooms') or [])} OOMs; {m.get('seconds')} s"
    )
    return (
        room.get("card") == CARD
        and placed.get(moved) == room.get("device")
        and str(moved).startswith("actors-")
        and rec.get("reason") == "make-room"
        and rec.get("mode") == "worker"
        and to_node == "node-1"
        and bool(m.get("replaced"))
        and len(kept) == 2
        and all(kept.values())
        and not any(m.get("restarts", {}).values())
        and not m.get("ooms")
        and bool(m.get("finished"))
    )
