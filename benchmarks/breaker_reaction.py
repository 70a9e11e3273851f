"""Breaker reaction time: repeated sync-latency faults injected into a real multi-process PPO run.

A control plane runs in this process (uvicorn on 127.0.0.1, SQLite). The PPO example trains with
``--world-size 3`` over gloo under `dsec run`; ``DSEC_CHAOS`` makes one rank at a time arrive late at
every gradient sync (rank 1, then rank 2, alternating windows). For each fault window we measure, from
the recorded events (one clock: same host):

* onset  — the scheduled start of the window (the probe's chaos ``start`` event carries it),
* detect — the breaker's ``meltdown`` event for that rank,
* ack    — the ``directive_acked`` event of the directive the meltdown issued (4-bit compression in force).

``false_escalations`` counts meltdowns of ranks that were not under injection at the time (with a grace
period after a window ends, while the rank is still stepping down). The baseline in the same run is the
heartbeat interval: ``detect_to_ack_p50_beats`` says how many beats the directive round trip took.
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "ppo_cartpole_ddp.py"
DSEC = Path(sys.executable).with_name("dsec")
ADMIN = "bench-admin-token"
GRACE_S = 3.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=6, help="fault windows (alternating ranks 1 and 2)")
    ap.add_argument("--period", type=float, default=16.0, help="seconds between window starts")
    ap.add_argument("--fault", type=float, default=6.0, help="seconds each window lasts")
    ap.add_argument("--delay-ms", type=float, default=150.0, help="injected lateness per sync")
    ap.add_argument("--beat", type=float, default=0.25, help="heartbeat interval of the workers (s)")
    ap.add_argument("--warmup", type=float, default=8.0, help="seconds before the first window")
    args = ap.parse_args()

    from dsec.breaker import BreakerConfig
    from dsec.client import Client
    from dsec.control.app import create_app
    from dsec.control.judge import JudgeConfig
    from dsec.control.server import ServerThread
    from dsec.control.settings import Settings

    home = Path(tempfile.mkdtemp(prefix="dsec-bench-breaker-"))
    judge = JudgeConfig(breaker=BreakerConfig(window_s=1.0, min_samples=3, recovery_s=1.5, max_recovery_s=6.0))
    settings = Settings.from_env(
        home=home, admin_token=ADMIN, flush_interval_s=0.2, reconcile_interval_s=0.1, judge=judge, alert_log=False
    )
    server = ServerThread(create_app(settings))
    admin = Client(server.url, token=ADMIN)
    try:
        admin.put_pool("bench")
        token = admin.create_token(kind="pool", pool="bench")
        # Two clauses, one per rank, each repeating every 2 periods: the faults alternate 1, 2, 1, ...
        two = 2 * args.period
        chaos = ";".join(
            f"sync_delay_ms={args.delay_ms:g},rank={rank},after_s={args.warmup + i * args.period:g},"
            f"for_s={args.fault:g},every_s={two:g}"
            for i, rank in enumerate((1, 2))
        )
        duration = args.warmup + args.windows * args.period + 2.0
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
        env.update(
            GLOO_SOCKET_IFNAME="lo",
            DSEC_ENDPOINT=server.url,
            DSEC_SANDBOX_ID="bench",
            DSEC_TOKEN=token,
            DSEC_ROLE="learner",
            DSEC_HEARTBEAT_INTERVAL=str(args.beat),
            DSEC_COMPRESSION_BITS="8",
            DSEC_CHAOS=chaos,
        )
        cmd = [
            str(DSEC), "run", "--", sys.executable, str(EXAMPLE), "--world-size", "3", "--total-steps", "100000000",
            "--target-return", "1e9", "--max-seconds", str(duration), "--num-steps", "32", "--log-every", "0",
        ]  # fmt: skip
        print(f"training for {duration:.0f} s with DSEC_CHAOS={chaos!r}", file=sys.stderr)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=duration + 240, check=False)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
        time.sleep(1.0)  # let the last beats' events commit
        events = admin.all_events(pool="bench")
        workers = {w["id"]: w for w in admin.workers(pool="bench")}
    finally:
        server.close()

    rank_of = {wid: int(w["rank"]) for wid, w in workers.items()}
    starts = [
        (e["data"]["at"], rank_of[e["worker_id"]])
        for e in events
        if e["type"] == "log" and e["data"].get("chaos") == "start" and e["worker_id"] in rank_of
    ]
    meltdowns = [e for e in events if e["type"] == "meltdown"]
    runs: list[dict[str, float]] = []
    false_escalations = 0
    for m in meltdowns:
        rank = rank_of[m["worker_id"]]
        window = [s for s, r in starts if r == rank and s - 0.5 <= m["ts"] <= s + args.fault + GRACE_S]
        if not window:
            false_escalations += 1
            continue
        onset = max(window)
        version = next(
            e["data"]["version"]
            for e in events
            if e["type"] == "directive_set" and e["worker_id"] == m["worker_id"] and e["ts"] == m["ts"]
        )
        acks = [
            e["ts"]
            for e in events
            if e["type"] == "directive_acked" and e["worker_id"] == m["worker_id"] and e["data"]["version"] >= version
        ]
        if not acks:
            continue
        ack = min(acks)
        runs.append({"onset": onset, "detect": m["ts"], "ack": ack, "rank": rank})
    onset_to_ack = [r["ack"] - r["onset"] for r in runs]
    detect_to_ack = [r["ack"] - r["detect"] for r in runs]
    onset_to_detect = [r["detect"] - r["onset"] for r in runs]
    result = {
        "runs": len(runs),
        "windows_injected": len(starts),
        "onset_to_ack_p50_s": round(percentile(onset_to_ack, 0.5), 3),
        "onset_to_ack_p99_s": round(percentile(onset_to_ack, 0.99), 3),
        "detect_to_ack_p50_s": round(percentile(detect_to_ack, 0.5), 3),
        "detect_to_ack_p99_s": round(percentile(detect_to_ack, 0.99), 3),
        "onset_to_detect_p50_s": round(percentile(onset_to_detect, 0.5), 3),
        "false_escalations": false_escalations,
        "heartbeat_interval_s": args.beat,
        "detect_to_ack_p50_beats": round(percentile(detect_to_ack, 0.5) / args.beat, 2),
        "evidence": {"window_s": 1.0, "min_samples": 3},
        "delay_ms": args.delay_ms,
        "train_rc": proc.returncode,
    }
    print(json.dumps(result))
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
