"""Demo phase for launching and recovery: the PPO learners restarted by DSec's supervisor (local launcher) from
their snapshots, then one rank SIGKILLed and the group recovered from its newest snapshots, each phase timed."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.launch.jobfile import JobFile
from dsec.launch.local import LocalLauncher
from dsec.launch.supervisor import Recovery, Supervisor

if TYPE_CHECKING:
    from dsec.demo import DemoRun


def _snapshots_since(run: DemoRun, since: float) -> set[str]:
    evs = run.client.all_events(types=["snapshot"], since=since)
    return {str(e["worker_id"]) for e in evs if e["data"].get("status") == "ok"}


def supervised_recovery(
    run: DemoRun, env: dict[str, str], pool: str, pool_token: str, endpoint: str, ppo: list[str], home: Path
) -> dict[str, Any]:
    """Start the learners under the supervisor from the first run's snapshots (group ``default``: the names the
    first run's snapshots carry), kill one rank once both have snapshotted again, let the supervisor recover the
    group, then let it finish. Returns the recovery timings and the restored run's PPO result."""
    world = int(ppo[ppo.index("--world-size") + 1])
    script = ppo[1]
    job = JobFile.model_validate(
        {
            "job": "demo-ppo",
            "pool": pool,
            "snapshots": {"dir": env["DSEC_SNAPSHOT_DIR"], "interval_s": 1},
            "restart": {"max_restarts": 2, "resume_timeout_s": 60},
            "groups": [
                {
                    "name": "default",
                    "world_size": world,
                    "memory_gb": 1,
                    "command": [sys.executable, script, "--seed", "1", "--max-seconds", "8", "--log-every", "0",
                                "--target-return", "100000"],
                }
            ],
        }
    )  # fmt: skip
    base = {k: v for k, v in env.items() if k not in ("DSEC_CHAOS", "DSEC_SNAPSHOT_DIR", "DSEC_RESTORE")}
    launcher = LocalLauncher(base_env=base, log_dir=home / "launch")
    recoveries: list[Recovery] = []
    sup = Supervisor(job, launcher, client=run.client, endpoint=endpoint, pool_token=pool_token, poll_s=0.02,
                     on_recovery=recoveries.append)  # fmt: skip
    out: dict[str, Any] = {}
    try:
        started = time.time()
        sup.start(restore=True)
        deadline = time.time() + 60
        while len(_snapshots_since(run, started)) < world and time.time() < deadline:
            sup.step()
            time.sleep(0.05)
        victim = f"default-{world - 1}"
        t_kill = time.time()
        os.kill(launcher.pids("default")[victim], signal.SIGKILL)
        deadline = time.time() + 60
        while not recoveries and time.time() < deadline:
            sup.step()
            time.sleep(0.02)
        if recoveries:
            rec = recoveries[0]
            out["recovery"] = {**rec.timings(), "total_from_kill_s": round((rec.resumed_at or t_kill) - t_kill, 3)}
        out["finished"] = sup.run(timeout_s=90)
    finally:
        sup.stop()
    log = home / "launch" / "default-0.log"
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")] if log.exists() else []
    out["ppo"] = json.loads(lines[-1]) if lines else {}
    return out


def recovered(run: DemoRun, result: dict[str, Any]) -> bool:
    rec = result.get("recovery")
    if not rec:
        run.notes.append("recovery: the supervisor did not report a recovery")
        return False
    run.notes.append(
        f"kill -9 of learner rank {rec['worker']}: detected in {rec['detect_s'] * 1e3:.0f} ms, group stopped in "
        f"{rec['stop_s'] * 1e3:.0f} ms, restarted in {rec.get('restart_s', float('nan')):.1f} s, restored in "
        f"{rec.get('restore_s', float('nan')) * 1e3:.0f} ms: training resumed {rec['total_from_kill_s']:.1f} s after "
        f"the kill (snapshots {', '.join(rec.get('restored', []))})"
    )
    return "restore_s" in rec and bool(result.get("finished"))
