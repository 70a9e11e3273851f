"""Memory quotas on a real job: two PPO learners sharing one card, one of them leaking, allocator caps on and off.

The simulator's finding that quotas did not prevent OOMs came from a model; this is the real counterpart. Two groups
of the PPO example (examples/ppo_cartpole_ddp.py, one rank each, no dsec import) run under the supervisor and a real
control plane (``dsec serve``, SQLite, snapshots every ``--snapshot-interval`` s, the default judgment) and share one
card. No GPU here, so the card is the probe's stand-in (dsec.probe.fake_card): an ``--card-gb`` card whose memory
the two processes hold through a shared file; an allocation at an optimizer step fails, in the allocating process
only, at that process's allocator limit (the one the probe would set with ``set_per_process_memory_fraction``) or
when the card is full; the failure is ``torch.OutOfMemoryError`` raised into the training code, which dies of it;
the supervisor restarts the group from its latest snapshot.

What each process holds: ``--base-gb`` from its first optimizer step (model, optimizer, activations' cache) plus the
probe's ``DSEC_CHAOS`` memory growth, which with a card is device memory:

* ``leaky``: a slow climb of ``--leak-gb-per-s`` (0.045: below the control plane's 0.05 GB/s line between a leak and
  a burst) from ``--leak-after`` s after its training starts, without bound;
* ``steady``: an episode-phase burst of ``--burst-gb`` built at ``--burst-gb-per-s`` (0.4: a sparse-reward rollout's
  rate), held ``--burst-hold`` s, every ``--burst-every`` s.

A restarted process starts its windows again (a leak leaks again). The control plane sees the card as two devices
(the card's two process slots) of one card (``card``), each with the card's memory; the pool's base is ``--base-gb``
and its ceiling ``--ceiling-gb``. Its elastic quotas (dsec.quota.elastic) issue each worker's grant and allocator
limit: a slow climb is stopped at the ceiling, a burst's limit runs past it into the card's free memory.

The defaults put the collision inside a run of a few minutes: without caps the leaker takes the steady worker's
burst room after ~2 GB of leak (~55 s), and the steady worker's bursts then fail for want of card; with caps the
leaker meets its ceiling after ~1 GB (~32 s). A roomier card or a slower leak moves both later (a real leak runs for
hours); what the comparison shows is who fails, and what each failure costs.

Runs (``--sides``), the same in everything but the allocator cap and the drain:

* ``on`` (``limits=obey``): each process's allocator is capped at the limit its directives give, and a slow climb
  into a final limit is drained before the cap (dsec.probe.recycle: snapshot, stop, restart from it);
* ``off`` (``limits=ignore``): the same control plane and directives, nothing capped (a deployment without quotas:
  every process may grow into the whole card; with no cap there is nothing to drain before);
* ``on-no-recycle``: caps without the drain (``DSEC_MEMORY_RECYCLE_HORIZON_S=0``).

Reported per run and group: OOMs (the ``torch.OutOfMemoryError`` lines of the fake card in the group's logs, and
whose allocation failed: limit or full card), recycles (the drain's ``MemoryRecycle`` lines), restarts, PPO updates
retained at the end (from the last process's start, plus what the snapshot it restored embodied:
chaos_real.account), retained optimizer steps per second.
``goodput_ratio`` = retained optimizer steps of both groups, ``on`` / ``off``; ``oom_ratio`` the same for OOMs.

    python benchmarks/chaos_memory.py [--duration 150] [--seed 1] [--sides on,off,on-no-recycle]
    python benchmarks/chaos_real.py --scenario memory [...]   # the same
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos_real import (
    ADMIN,
    OPT_STEPS_PER_UPDATE,
    START_TIMEOUT_S,
    ControlPlane,
    LogTail,
    Schedule,
    Trace,
    account,
    base_env,
    published_snapshots,
    restore_records,
    script_args,
    tail,
)

POOL = "bench"
GROUPS = ("leaky", "steady")
RECYCLE = re.compile(r"MemoryRecycle: memory recycle: ")
OOM = re.compile(r"OutOfMemoryError: CUDA out of memory \(DSec fake card [^)]*\)\. Tried to allocate .*?; (.*)$")


def chaos_for(group: str, args: argparse.Namespace) -> str:
    if group == "leaky":
        return f"memory_growth_mb_per_s={args.leak_gb_per_s * 1024:g},max_mb={args.card_gb * 1024:g}," \
               f"after_s={args.leak_after:g}"  # fmt: skip
    build_s = args.burst_gb / args.burst_gb_per_s
    return f"memory_growth_mb_per_s={args.burst_gb_per_s * 1024:g},max_mb={args.burst_gb * 1024:g}," \
           f"after_s=5,for_s={build_s + args.burst_hold:g},every_s={args.burst_every:g}"  # fmt: skip


def stops(logs: Path, group: str) -> list[str]:
    """How the group's processes stopped, from its worker logs, oldest first: ``limit`` or ``card`` for the fake
    card's OOMs (whose allocation failed), ``recycle`` for a drain before the cap (dsec.probe.recycle)."""
    out: list[str] = []
    for f in sorted(logs.glob(f"*{group}*.log")):
        for line in f.read_text(errors="replace").splitlines():
            m = OOM.search(line)
            if m:
                out.append("limit" if "allocator limit" in m.group(1) else "card")
            elif RECYCLE.search(line):
                out.append("recycle")
    return out


def snapshots_of(events: list[dict[str, Any]], ids: set[str]) -> list[dict[str, Any]]:
    """The data of the snapshots the workers ``ids`` published, oldest first."""
    return [
        e["data"]
        for e in events
        if e["type"] == "snapshot" and e["worker_id"] in ids and (e["data"] or {}).get("status") == "ok"
    ]


def run(limits: str, recycle_s: float, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from dsec.client import Client
    from dsec.launch.jobfile import JobFile
    from dsec.launch.local import LocalLauncher
    from dsec.launch.supervisor import Supervisor

    work.mkdir(parents=True)
    print(f"[{work.name}] starting ({args.duration:g} s budget)", file=sys.stderr)
    server = ControlPlane(work / "cp", work / "dsec-serve.log")
    client = Client(server.url, token=ADMIN, timeout=30.0)
    sup: Supervisor | None = None
    card = f"path={work / 'card0'},memory_gb={args.card_gb:g},base_gb={args.base_gb:g},limits={limits}"
    try:
        # The card's two process slots (placement puts one worker on a device), each giving the card's memory and
        # naming the card: the control plane plans quotas per card, so a burst's limit is what the other process
        # leaves of it (until 2026-12-06 it planned per pool and counted the card twice: limits at the whole card).
        devices = ["card0-a", "card0-b"]
        for d in devices:
            client.request("PUT", f"/v1/devices/{d}",
                           json={"id": d, "node": "node-0", "model": "sim", "memory_gb": args.card_gb,
                                 "card": "card0"})  # fmt: skip
        client.put_pool(POOL, devices=devices, memory_base_gb=args.base_gb, memory_ceiling_gb=args.ceiling_gb)
        job = JobFile.model_validate(
            {
                "job": "ppo-memory",
                "pool": POOL,
                "snapshots": {"dir": str(work / "snapshots"), "interval_s": args.snapshot_interval,
                              "cadence": args.cadence},
                "restart": {"max_restarts": 50, "resume_timeout_s": 120},
                "groups": [
                    {
                        "name": g,
                        "role": "learner",
                        "world_size": 1,
                        "memory_gb": args.base_gb,
                        "env": {"DSEC_HEARTBEAT_INTERVAL": str(args.beat), "DSEC_CHAOS": chaos_for(g, args),
                                "DSEC_FAKE_CARD": card, "PYTHONUNBUFFERED": "1",
                                "DSEC_MEMORY_RECYCLE_HORIZON_S": str(recycle_s)},
                        "command": [sys.executable, *script_args(args.seed + i, args.num_steps)],
                    }
                    for i, g in enumerate(GROUPS)
                ],
            }
        )  # fmt: skip
        logs = work / "logs"
        launcher = LocalLauncher(base_env=base_env(), log_dir=logs)
        sup = Supervisor(job, launcher, client=client, endpoint=server.url,
                         pool_token=client.create_token(POOL), poll_s=0.1)  # fmt: skip
        sup.start()
        tails = {g: LogTail(logs / f"{g}-0.log") for g in GROUPS}
        traces = {g: Trace(launched_at=time.time()) for g in GROUPS}
        end: float | None = None
        while True:
            now = time.time()
            for g in GROUPS:
                tr = traces[g]
                tr.lines += tails[g].poll()
                if tr.t0 is None and tr.lines:
                    tr.t0 = tr.lines[0].wall - tr.lines[0].t
            if end is None and all(tr.t0 is not None for tr in traces.values()):
                end = max(tr.t0 or 0.0 for tr in traces.values()) + args.duration  # both trained the budget
            if end is None and now - min(tr.launched_at for tr in traces.values()) > START_TIMEOUT_S:
                raise TimeoutError(f"no progress line within {START_TIMEOUT_S:.0f} s of the launch")
            if end is not None and now >= end:
                break
            sup.step()
            if sup.failed:
                raise RuntimeError(f"the supervisor gave up: {sup.failed}; {tail(logs / 'leaky-0.log')}")
            time.sleep(0.1)
        workers = client.workers(pool=POOL)
        events = client.all_events(pool=POOL)
        group_of = {w["id"]: w.get("group") for w in workers}
        records = restore_records(events, {w["id"]: int(w["rank"]) for w in workers}, published_snapshots(events))
        out: dict[str, Any] = {}
        for g in GROUPS:
            tr = traces[g]
            assert tr.t0 is not None
            tr.end = tr.t0 + args.duration
            ids = {wid for wid, grp in group_of.items() if grp == g}
            restores = [r for r in records if r["worker_id"] in ids]  # each group is one rank, rank 0
            acc = account(tr, Schedule(args.duration, args.duration, "", []), {"restores": restores}, args.num_steps)
            kinds = stops(logs, g)
            quota = [e["data"] for e in events if e["type"] == "quota" and e["worker_id"] in ids]
            out[g] = {
                "ooms": len(kinds) - kinds.count("recycle"),
                "recycles": kinds.count("recycle"),
                "ooms_at_limit": kinds.count("limit"),
                "ooms_card_full": kinds.count("card"),
                "oom_events": sum(
                    1 for e in events if e["type"] == "log" and e["worker_id"] in ids and "oom" in (e["data"] or {})
                ),
                "restarts": acc["restarts"],
                "ppo_updates": acc["ppo_updates"],
                "optimizer_steps_per_s": acc["optimizer_steps_per_s"],
                "work_lost_updates": acc["work_lost_updates"],
                "time_lost_to_recovery_s": acc["time_lost_to_recovery_s"],
                "quota_events": len(quota),
                "last_limit_gb": next((q.get("limit_to_gb") for q in reversed(quota) if "limit_to_gb" in q), None),
                "last_grant_gb": quota[-1].get("to_gb") if quota else None,
                "last_avg_return": acc["last_avg_return"],
                # What the cadence was told (--cadence failure_history): restarts that rolled the group back to a
                # snapshot nobody took for the failure (a burst's OOM after its burst snapshot is not one), and the
                # interval the learner's last snapshot reported.
                "rollbacks_counted": sup.rollbacks[g],
                "snapshots": len(snaps := snapshots_of(events, ids)),
                "last_interval_s": next((d["interval_s"] for d in reversed(snaps) if "interval_s" in d), None),
            }
        out["ooms"] = sum(out[g]["ooms"] for g in GROUPS)
        out["optimizer_steps"] = sum(out[g]["ppo_updates"] for g in GROUPS) * OPT_STEPS_PER_UPDATE
        out["breaker_events"] = sum(1 for e in events if e["type"] in ("meltdown", "breaker"))
        return out
    finally:
        if sup is not None:
            sup.stop()
        client.close()
        server.stop()


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=150.0, help="training seconds per run (each group's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--card-gb", type=float, default=28.0)
    p.add_argument("--base-gb", type=float, default=10.0, help="what each process holds from its first step")
    p.add_argument("--ceiling-gb", type=float, default=11.0, help="the pool's ceiling (grants stop there)")
    p.add_argument("--leak-gb-per-s", type=float, default=0.045, help="a slow climb (below 0.05 GB/s: not a burst)")
    p.add_argument("--leak-after", type=float, default=10.0, help="s after training starts")
    p.add_argument("--burst-gb", type=float, default=6.0)
    p.add_argument("--burst-gb-per-s", type=float, default=0.4, help="how fast a burst builds")
    p.add_argument("--burst-hold", type=float, default=5.0, help="s a burst holds at its peak")
    p.add_argument("--burst-every", type=float, default=30.0)
    p.add_argument("--recycle-horizon", type=float, default=2.0, help="DSEC_MEMORY_RECYCLE_HORIZON_S, quotas on")
    p.add_argument("--num-steps", type=int, default=32, help="rollout length per env (the example's)")
    p.add_argument("--beat", type=float, default=0.5, help="heartbeat interval (s)")
    p.add_argument("--snapshot-interval", type=float, default=5.0)
    p.add_argument("--sides", default="on,off", help="comma-separated of on, off, on-no-recycle")
    p.add_argument(
        "--cadence",
        default="fixed",
        choices=("fixed", "failure_history"),
        help="the job's snapshots.cadence (failure_history: --snapshot-interval is the prior)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep logs here (default: temporary)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    result: dict[str, Any] = {"scenario": "memory", **{k: v for k, v in vars(args).items() if k != "workdir"}}
    result["workdir"] = str(args.workdir) if args.workdir else None
    try:
        with tempfile.TemporaryDirectory(prefix="dsec-mem-") as tmp:
            root = args.workdir or Path(tmp)
            sides = {"on": ("obey", args.recycle_horizon), "off": ("ignore", args.recycle_horizon),
                     "on-no-recycle": ("obey", 0.0)}  # fmt: skip
            for side in args.sides.split(","):
                if side not in sides:
                    p.error(f"--sides: {side!r} is not one of {sorted(sides)}")
                limits, recycle_s = sides[side]
                result[f"quotas_{side.replace('-', '_')}"] = run(limits, recycle_s, root / f"quotas-{side}", args)
    except KeyboardInterrupt:
        print(json.dumps({**result, "error": "interrupted"}))
        return 130
    on, off = result.get("quotas_on"), result.get("quotas_off")
    if on and off:
        result["goodput_ratio"] = (
            round(on["optimizer_steps"] / off["optimizer_steps"], 3) if off["optimizer_steps"] else None
        )
        result["oom_ratio"] = round(on["ooms"] / off["ooms"], 3) if off["ooms"] else None
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
