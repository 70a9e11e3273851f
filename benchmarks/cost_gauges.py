"""The cost gauges' refresh at fleet scale: a full replay of the last hour against the ledger kept between refreshes.

Builds a real SQLite store holding ``--workers`` workers' last hours (registrations, a snapshot per worker every
``--snapshot-every`` seconds, breaker trips and recoveries, lost workers that rejoin, log events the report never
reads), then advances time a minute per refresh: each minute commits its new events and both paths report the hour
ending then, through ``CostMeter`` as the control plane runs it (``_account``: what ``GET /v1/cost`` does, and what
the gauges' refresh did before; ``_gauge_report``: what the gauges' refresh does now, without the per-worker
throughput effects no gauge shows). Both reports must agree on every other figure (``equal``); the ledger with the
throughput effects too is timed and compared as well (``ledger_throughput_ms``).

    python benchmarks/cost_gauges.py                       # 10,000 workers, 10 refreshes
    python benchmarks/cost_gauges.py --workers 2000 --refreshes 5

Last stdout line: one JSON object — ``full_ms`` / ``ledger_ms`` / ``ledger_throughput_ms`` (median per refresh,
after the ledger's first read), ``ledger_first_ms`` (its first read), ``speedup`` (full / ledger), ``equal``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec.control.cost import CostMeter
from dsec.control.settings import Settings
from dsec.control.state import HotState
from dsec.control.store import WriteBatch, open_store
from dsec.cost import Window, WorkerRecord
from dsec.model import Event, EventType

H = 3600.0
MINUTE = 60.0


def minute_events(rnd: random.Random, workers: list[WorkerRecord], t0: float, args: argparse.Namespace) -> list[Event]:
    """What a fleet commits in [t0, t0 + 60 s): snapshots on each worker's cadence, a few breaker trips (recovered a
    few minutes later), a few lost workers (rejoined after a restart), logs."""
    out: list[Event] = []
    for i, w in enumerate(workers):
        phase = (i * 7.919) % args.snapshot_every
        k = int((t0 - phase) // args.snapshot_every) + 1
        while (ts := phase + k * args.snapshot_every) < t0 + MINUTE:
            out.append(
                Event(
                    ts=ts, type=EventType.SNAPSHOT, worker_id=w.id, pool=w.pool, data={"step": int(ts), "bytes": 4096}
                )
            )
            k += 1
        r = rnd.random()
        ts = t0 + rnd.uniform(0, MINUTE)
        if r < args.trip_rate:
            out.append(
                Event(ts=ts, type=EventType.BREAKER, worker_id=w.id, pool=w.pool, data={"level_from": 0, "level_to": 1})
            )
            out.append(Event(ts=ts + 180, type=EventType.RECOVERED, worker_id=w.id, pool=w.pool, data={"level_to": 0}))
        elif r < args.trip_rate + args.loss_rate:
            out.append(Event(ts=ts, type=EventType.LOST, worker_id=w.id, pool=w.pool, data={}))
            out.append(Event(ts=ts + 20, type=EventType.REJOINED, worker_id=w.id, pool=w.pool, data={}))
        if rnd.random() < 0.3:
            out.append(Event(ts=ts, type=EventType.LOG, worker_id=w.id, pool=w.pool, data={"msg": "episode"}))
    # Events carry their own times: a minute's commit holds some that end after it (a recovery 3 minutes on).
    return sorted(out, key=lambda e: e.ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=10_000)
    ap.add_argument("--pools", type=int, default=4)
    ap.add_argument("--history-min", type=int, default=70, help="minutes of history committed before the first refresh")
    ap.add_argument("--refreshes", type=int, default=10)
    ap.add_argument("--snapshot-every", type=float, default=300.0)
    ap.add_argument("--trip-rate", type=float, default=0.002, help="per worker and minute")
    ap.add_argument("--loss-rate", type=float, default=0.0005, help="per worker and minute")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    rnd = random.Random(args.seed)
    start = 1_000_000.0
    workers = [
        WorkerRecord(
            f"w{i}",
            f"pool{i % args.pools}",
            f"g{i % 64}",
            start + rnd.uniform(0, 120),
            device=f"n{i // 8}/gpu{i % 8}",
            devices=1,
            progressed=True,
            step_ms=50.0,
        )
        for i in range(args.workers)
    ]
    with tempfile.TemporaryDirectory() as d:
        store = open_store(f"sqlite:///{Path(d) / 'state.db'}")
        pending: list[Event] = [
            Event(ts=w.registered_at, type=EventType.REGISTERED, worker_id=w.id, pool=w.pool, data={"group": w.group})
            for w in workers
        ]
        clock = [start]
        meter = CostMeter(
            HotState(),
            store,
            Settings(home=Path(d), database_url="sqlite://", cost_device_hour=2.0),
            lambda: clock[0],
            start,
        )

        def commit_until(t: float) -> None:
            # Commit, in time order, every event whose minute has passed (late ones stay pending, as in the server).
            nonlocal pending
            due = [e for e in pending if e.ts < t]
            pending = [e for e in pending if e.ts >= t]
            for k in range(0, len(due), 5000):
                store.write(WriteBatch(events=due[k : k + 5000]))

        t = start
        for _ in range(args.history_min):
            pending += minute_events(rnd, workers, t, args)
            t += MINUTE
            commit_until(t)
        full_ms: list[float] = []
        ledger_ms: list[float] = []
        with_tp_ms: list[float] = []
        first_ms = None
        equal = True
        for n in range(args.refreshes + 1):
            clock[0] = now = t
            window = Window(now - H, now)
            t0 = time.perf_counter()
            full = meter._account(workers, window, None, now)
            t1 = time.perf_counter()
            gauges = meter._gauge_report(workers, window, now)
            t2 = time.perf_counter()
            with_tp = meter._gauge_report(workers, window, now, throughput=True)
            t3 = time.perf_counter()
            if n == 0:
                first_ms = (t2 - t1) * 1000
            else:
                ledger_ms.append((t2 - t1) * 1000)
                with_tp_ms.append((t3 - t2) * 1000)
            full_ms.append((t1 - t0) * 1000)
            equal = equal and comparable(full) == comparable(with_tp)
            equal = equal and comparable(full, throughput=False) == comparable(gauges, throughput=False)
            print(
                f"refresh {n}: full {full_ms[-1]:.0f} ms, ledger {(t2 - t1) * 1000:.0f} ms "
                f"(with throughput {(t3 - t2) * 1000:.0f} ms), equal {equal}",
                file=sys.stderr,
            )
            pending += minute_events(rnd, workers, t, args)
            t += MINUTE
            commit_until(t)
        store.close()
    result = {
        "workers": args.workers,
        "refreshes": args.refreshes,
        "full_ms": round(statistics.median(full_ms), 1),
        "ledger_ms": round(statistics.median(ledger_ms), 1),
        "ledger_throughput_ms": round(statistics.median(with_tp_ms), 1),
        "ledger_first_ms": round(first_ms or 0.0, 1),
        "speedup": round(statistics.median(full_ms) / statistics.median(ledger_ms), 2),
        "equal": equal,
    }
    print(json.dumps(result))
    return 0 if equal else 1


def comparable(report: Any, throughput: bool = True) -> dict[str, Any]:
    d = report.to_dict()
    d["implicit"]["process"] = None  # the control plane's own CPU and RSS, measured at each call
    if not throughput:
        d["notes"] = [n for n in d["notes"] if not n.startswith("throughput:")]
        for pool in d["pools"]:
            pool["opportunity"]["throughput"] = []
    return d


if __name__ == "__main__":
    sys.exit(main())
