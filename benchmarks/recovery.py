"""Kill-and-recover: a 4-rank CPU PPO job under `dsec launch`'s supervisor, one rank SIGKILLed, repeatedly.

An embedded control plane (uvicorn on loopback, SQLite) with a pool of 4 simulated devices; the PPO example with 4
DDP ranks (gloo) launched by the local launcher with snapshots every 2 s. Each round waits until every rank has a
snapshot, SIGKILLs one rank, and times the recovery the supervisor reports (see dsec/launch/supervisor.py):
detect (kill -> exit noticed), restart (spawn -> restores begin: interpreter, imports, process group, model;
with warm standbys, the default, only the last two),
restore (slowest rank), total (kill -> every rank restored, i.e. training resumed). Last stdout line: JSON with
the medians.

    python benchmarks/recovery.py [--runs 3] [--ranks 4]
"""

from __future__ import annotations

import argparse
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
ADMIN = "bench-admin"


def wait_snapshots(c: Client, since: float, ranks: int, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        evs = [e for e in c.all_events(types=["snapshot"], since=since) if e["data"].get("status") == "ok"]
        if len({e["worker_id"] for e in evs}) >= ranks:
            return
        time.sleep(0.2)
    raise TimeoutError("not every rank snapshotted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--cold", action="store_true", help="no warm standby processes (every restart starts Python)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-recovery-") as tmp:
        home = Path(tmp)
        settings = Settings.from_env(home=home / "cp", admin_token=ADMIN, reconcile_interval_s=0.1, alert_log=False)
        with ServerThread(create_app(settings)) as server, Client(server.url, token=ADMIN) as c:
            devices = [f"gpu-{i}" for i in range(args.ranks)]
            for d in devices:
                c.request("PUT", f"/v1/devices/{d}", json={"id": d, "node": "node-0", "model": "sim", "memory_gb": 16})
            c.put_pool("bench", devices=devices)
            token = c.create_token("bench")
            job = JobFile.model_validate(
                {
                    "job": "ppo-bench",
                    "pool": "bench",
                    "snapshots": {"dir": str(home / "snaps"), "interval_s": 2},
                    "restart": {"max_restarts": args.runs + 1, "resume_timeout_s": 120},
                    "groups": [
                        {
                            "name": "learners",
                            "world_size": args.ranks,
                            "memory_gb": 4,
                            "env": {"OMP_NUM_THREADS": "1", "DSEC_HEARTBEAT_INTERVAL": "0.25"},
                            "command": [sys.executable, str(REPO / "examples" / "ppo_cartpole_ddp.py"),
                                        "--max-seconds", "900", "--log-every", "0", "--target-return", "100000"],
                        }
                    ],
                }
            )  # fmt: skip
            launcher = LocalLauncher(log_dir=home / "logs", warm=not args.cold)
            recoveries: list[Recovery] = []
            sup = Supervisor(job, launcher, client=c, endpoint=server.url, pool_token=token, poll_s=0.02,
                             on_recovery=recoveries.append)  # fmt: skip
            rows: list[dict[str, Any]] = []
            try:
                sup.start()
                since = time.time()
                for run in range(args.runs):
                    wait_snapshots(c, since, args.ranks)
                    # Failures are not seconds apart: let the standbys for the next restart finish their imports.
                    deadline = time.time() + 120
                    while not args.cold and launcher.standbys_ready("learners") < args.ranks and time.time() < deadline:
                        sup.step()
                        time.sleep(0.1)
                    pids = launcher.pids("learners")
                    victim = f"learners-{run % args.ranks}"
                    t_kill = time.time()
                    os.kill(pids[victim], signal.SIGKILL)
                    deadline = time.time() + 180
                    while len(recoveries) <= run and time.time() < deadline:
                        sup.step()
                        time.sleep(sup.poll_s)
                    rec = recoveries[run]
                    if rec.resumed_at is None:
                        raise RuntimeError(f"run {run}: the group did not report its restores")
                    row = {
                        "run": run,
                        "killed": victim,
                        "detect_s": round(rec.detected_at - t_kill, 4),
                        "stop_s": round(rec.stopped_at - rec.detected_at, 4),
                        "restart_s": round(rec.resumed_at - (rec.restore_s or 0) - rec.spawned_at, 4),
                        "restore_s": round(rec.restore_s or 0.0, 4),
                        "total_s": round(rec.resumed_at - t_kill, 4),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    since = time.time()
            finally:
                warm_starts = launcher.warm_starts
                sup.stop()
    med = {
        k: round(statistics.median(r[k] for r in rows), 3) for k in ("detect_s", "restart_s", "restore_s", "total_s")
    }
    summary = {"runs": len(rows), "ranks": args.ranks, "warm_standby": not args.cold, "warm_starts": warm_starts}
    print(json.dumps({**summary, **med}))


if __name__ == "__main__":
    main()
