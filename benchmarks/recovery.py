"""Kill -9 one rank of a 4-rank PPO job, repeatedly: healing in place vs the whole-group restart vs TorchFT.

Modes, each on the same job (examples/ppo_cartpole_ddp.py: DDP over gloo on 127.0.0.1, CPU), measured in one run:

- ``heal``: `dsec launch`'s supervisor with ``heal: true`` (local launcher, warm standbys); the survivors keep
  their processes, a replacement is admitted at the next PPO update with the live state from a peer;
- ``restart``: the same supervisor without healing: the whole group is killed and restarted from its newest
  agreed snapshots (every 2 s) — the previous recovery path;
- ``torchft``: the same PPO loop on TorchFT (benchmarks/torchft_ppo.py): one replica group per rank, Lighthouse
  quorum, the killed replica restarted by the harness and healed from a peer.

Per kill, from each process's step trace (``DSEC_STEP_TRACE``: one line per optimizer step, wall clock):
``survivor_pause_s`` — a surviving rank's longest time without completing a step, from its last step before the kill
to its first step in the re-formed group (p50 and max over survivors and kills);
``replacement_rejoin_s`` — kill -> the killed rank's replacement completes its first step; ``healthy_ranks_restarted``
— surviving ranks whose process changed; ``steps_lost`` — optimizer steps the survivors redo or drop (their step
counter goes back after a restore); ``detect_s`` — kill -> the supervisor noticed the exit; ``total_s`` — kill ->
recovery complete as the supervisor records it. ``replica_max_abs_diff``: the largest parameter difference across
ranks, all-gathered by the PPO script itself at the end of the mode's run (after every kill and recovery); DSec's
drift check also compares fingerprints every 5 synchronized steps and right after each recovery
(``drift_checks``/``drift_found``). Last stdout line: one JSON object.

    python benchmarks/recovery.py [--runs 5] [--ranks 4] [--modes heal,restart,torchft]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec.client import Client
from dsec.control.app import create_app
from dsec.control.server import ServerThread
from dsec.control.settings import Settings
from dsec.launch.jobfile import JobFile
from dsec.launch.local import LocalLauncher
from dsec.launch.supervisor import Recovery, Supervisor

REPO = Path(__file__).resolve().parents[1]
ADMIN = "dsa_bench-admin-token-0123456789abc"


def traces(trace_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """pid -> its step lines (rank, step, t), oldest first."""
    out: dict[int, list[dict[str, Any]]] = {}
    for f in trace_dir.glob("steps-*.jsonl"):
        lines = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip().endswith("}")]
        if lines:
            out[int(f.stem.split("-")[1])] = lines
    return out


def per_kill(trace_dir: Path, t_kill: float, t_reform: float | None, victim: int, ranks: int) -> dict[str, Any]:
    """One kill's figures. A survivor's pause is the longest gap between its consecutive steps from its last step
    before the kill up to its first step in the re-formed group (``t_reform``: the epoch without the victim formed;
    None: a restart, where that is its new process's first step) — a step in flight at the kill may still complete
    just after it, the stall comes next (the same definition as benchmarks/torchft_ppo.py)."""
    by_pid = traces(trace_dir)
    row: dict[str, Any] = {"pauses": [], "restarted": 0, "lost": 0}
    for rank in range(ranks):
        lines = sorted(((pid, ln) for pid, ls in by_pid.items() for ln in ls if ln["rank"] == rank),
                       key=lambda x: x[1]["t"])  # fmt: skip
        before = [x for x in lines if x[1]["t"] <= t_kill]
        after = [x for x in lines if x[1]["t"] > t_kill]
        if not after:
            continue
        if rank == victim:
            row["replacement_rejoin_s"] = round(after[0][1]["t"] - t_kill, 4)
            continue
        if not before:
            continue
        last_pid, last = before[-1]
        if t_reform is None:
            resumed = next((x for x in after if x[0] != last_pid), after[0])
        else:
            resumed = next((x for x in after if x[1]["t"] >= t_reform), after[-1])
        window = [last["t"]]
        window += [x[1]["t"] for x in after if x[1]["t"] <= resumed[1]["t"]]
        row["pauses"].append(round(max(b - a for a, b in itertools.pairwise(window)), 4))
        row["restarted"] += int(resumed[0] != last_pid)
        row["lost"] = max(row["lost"], int(last["step"]) + 1 - int(after[0][1]["step"]))
    return row


def wait_steps(sup: Supervisor, trace_dir: Path, since: float, ranks: int, n: int, timeout: float = 300) -> None:
    """Until every rank has completed ``n`` steps after ``since``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        counts = {r: 0 for r in range(ranks)}
        for lines in traces(trace_dir).values():
            for ln in lines:
                if ln["t"] > since:
                    counts[ln["rank"]] += 1
        if min(counts.values()) >= n:
            return
        sup.step()
        time.sleep(0.05)
    raise TimeoutError(f"not every rank made {n} steps")


def dsec_mode(mode: str, runs: int, ranks: int, root: Path) -> dict[str, Any]:
    home, trace_dir = root / mode, root / mode / "trace"
    settings = Settings.from_env(home=home / "cp", admin_token=ADMIN, reconcile_interval_s=0.1, alert_log=False)
    with ServerThread(create_app(settings)) as server, Client(server.url, token=ADMIN) as c:
        devices = [f"gpu-{i}" for i in range(ranks)]
        for d in devices:
            c.request("PUT", f"/v1/devices/{d}", json={"id": d, "node": "node-0", "model": "sim", "memory_gb": 16})
        c.put_pool("bench", devices=devices)
        token = c.create_token("bench")
        stop = home / "stop"
        job = JobFile.model_validate(
            {
                "job": f"ppo-{mode}",
                "pool": "bench",
                "warm_standby": True,
                "snapshots": {"dir": str(home / "snaps"), "interval_s": 2},
                "restart": {"max_restarts": runs + 2, "resume_timeout_s": 120, "admit_timeout_s": 120},
                "groups": [
                    {
                        "name": "learners",
                        "world_size": ranks,
                        "memory_gb": 4,
                        "heal": mode == "heal",
                        "env": {"OMP_NUM_THREADS": "1", "DSEC_HEARTBEAT_INTERVAL": "0.25",
                                "DSEC_STEP_TRACE": str(trace_dir), "DSEC_DRIFT_CHECK_STEPS": "5",
                                "DSEC_HEAL_JOURNAL": str(home / "journal")},
                        "command": [sys.executable, str(REPO / "examples" / "ppo_cartpole_ddp.py"),
                                    # No limit a rank decides on its own counter: a replacement counts from zero
                                    # (docs/healing.md, "scripts must decide together").
                                    "--max-seconds", "900", "--total-steps", "1000000000", "--log-every", "0",
                                    "--target-return", "100000",
                                    "--stop-file", str(stop)],
                    }
                ],
            }
        )  # fmt: skip
        launcher = LocalLauncher(log_dir=home / "logs", warm=True)
        recoveries: list[Recovery] = []
        sup = Supervisor(job, launcher, client=c, endpoint=server.url, pool_token=token, poll_s=0.02,
                         on_recovery=recoveries.append)  # fmt: skip
        rows: list[dict[str, Any]] = []
        try:
            sup.start()
            since = time.time()
            first_kill: float | None = None
            for run in range(runs):
                # Warm: 4 PPO updates (128 steps) on every rank since the start or the last recovery, so the
                # group's loop is known and a snapshot exists; standbys done importing, as between real failures.
                wait_steps(sup, trace_dir, since, ranks, 128)
                deadline = time.time() + 120
                while launcher.standbys_ready("learners") < ranks and time.time() < deadline:
                    sup.step()
                    time.sleep(0.05)
                victim = (run + 1) % ranks
                pid = launcher.pids("learners")[f"learners-{victim}"]
                t_kill = time.time()
                first_kill = first_kill or t_kill
                os.kill(pid, signal.SIGKILL)
                deadline = time.time() + 180
                while len(recoveries) <= run and time.time() < deadline:
                    sup.step()
                    time.sleep(sup.poll_s)
                rec = recoveries[run]
                wait_steps(sup, trace_dir, t_kill, ranks, 5)  # 5 steps on every rank after the kill
                t_reform = rec.reconfigured_at if rec.mode == "heal" else None
                row = per_kill(trace_dir, t_kill, t_reform, victim, ranks)
                row.update(
                    run=run,
                    killed=victim,
                    detect_s=round(rec.detected_at - t_kill, 4),
                    total_s=round((rec.resumed_at or time.time()) - t_kill, 4),
                    mode=rec.mode,
                )
                rows.append(row)
                print(json.dumps({"mode": mode, **row}), flush=True)
                since = time.time()
            stop.touch()
            if not sup.run(timeout_s=120):
                raise RuntimeError(f"{mode}: the job did not finish: {sup.failed}")
        finally:
            sup.stop()
        # Rank 0's result line: in its own log, or a standby's (a replacement runs in a standby's process).
        final = [
            json.loads(ln)
            for log in sorted((home / "logs").glob("*.log"))
            for ln in log.read_text().splitlines()
            if ln.startswith('{"reached"')
        ]
        anomalies = c.all_events(types=["anomaly"])
        workers = c.workers(pool="bench")
    drift_checks = sum(int(w["metrics"].get("replica_checks_total", 0)) for w in workers)
    return summarize(
        rows,
        step_ms_median=step_ms(trace_dir, first_kill or time.time()),
        replica_max_abs_diff=final[-1]["replica_max_abs_diff"] if final else None,
        drift_checks=drift_checks,
        drift_found=sum(1 for e in anomalies if e["data"].get("kind") == "replica_drift"),
    )


def step_ms(trace_dir: Path, until: float) -> float | None:
    """Median time between consecutive optimizer steps before the first kill (the cost of a mode's sync path:
    under healing one collective per step, without overlap with backward())."""
    gaps = []
    for lines in traces(trace_dir).values():
        ts = [ln["t"] for ln in lines if ln["t"] < until]
        gaps += [b - a for a, b in itertools.pairwise(ts)]
    return round(statistics.median(gaps) * 1e3, 2) if gaps else None


def summarize(rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    pauses = [p for r in rows for p in r["pauses"]]
    rejoin = [r["replacement_rejoin_s"] for r in rows if "replacement_rejoin_s" in r]

    def q(xs: list[float]) -> dict[str, float] | None:
        return {"p50": round(statistics.median(xs), 3), "max": round(max(xs), 3)} if xs else None

    return {
        "runs": len(rows),
        "survivor_pause_s": q(pauses),
        "replacement_rejoin_s": q(rejoin),
        "healthy_ranks_restarted": max((r["restarted"] for r in rows), default=None),
        "steps_lost": {"p50": statistics.median(r["lost"] for r in rows), "max": max(r["lost"] for r in rows)}
        if rows
        else None,
        "detect_s": round(statistics.median(r["detect_s"] for r in rows), 4) if rows else None,
        "total_s": round(statistics.median(r["total_s"] for r in rows), 3) if rows else None,
        **extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--modes", default="heal,restart,torchft")
    ap.add_argument("--keep", type=Path, default=None, help="work in this directory and keep it (logs, traces)")
    args = ap.parse_args()
    out: dict[str, Any] = {"ranks": args.ranks}
    with tempfile.TemporaryDirectory(prefix="dsec-recovery-") as scratch:
        tmp = str(args.keep) if args.keep is not None else scratch
        for mode in args.modes.split(","):
            t0 = time.time()
            if mode == "torchft":
                import torchft_ppo  # benchmarks/torchft_ppo.py (needs the bench extra: pip install -e .[bench])

                out[mode] = torchft_ppo.run(runs=args.runs, world=args.ranks)
            else:
                out[mode] = dsec_mode(mode, args.runs, args.ranks, Path(tmp))
            out[mode]["wall_s"] = round(time.time() - t0, 1)
            print(json.dumps({mode: out[mode]}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
