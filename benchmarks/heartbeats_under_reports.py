"""Heartbeat latency while agent runtimes report: does a runtime's report stall the event loop?

A runtime report used to save a JSON file with fsync on the control plane's event loop, so every heartbeat waiting
behind it waited for the disk (docs/security.md, finding 5). This benchmark runs a control plane in a child process
(``_common.ServerProcess``), registers ``--workers`` workers and ``--runtimes`` runtimes (their callback is never
called), and measures heartbeat latency in two phases of ``--duration`` seconds each: heartbeats alone, then
heartbeats while ``--reporters`` tasks send runtime reports back to back. Heartbeats are paced (``--rate`` per
second over ``--connections`` keep-alive connections) and each is timed from its send.

    .venv/bin/python benchmarks/heartbeats_under_reports.py
    .venv/bin/python benchmarks/heartbeats_under_reports.py --duration 20 --rate 400

The last line of stdout is one JSON object: per phase the heartbeats sent, p50/p99/max latency (ms) and errors, and
the reports sent in the second phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ServerProcess, admin_client, percentile

POOL = "bench"


async def _setup(
    url: str, admin: str, workers: int, runtimes: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    auth = {"Authorization": f"Bearer {admin}"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        token = (await c.post("/v1/tokens", json={"kind": "pool", "pool": POOL}, headers=auth)).json()["token"]
        ws = []
        for rank in range(workers):
            r = await c.post("/v1/workers/register", json={"pool": POOL, "rank": rank, "heartbeat_interval_s": 60},
                             headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            r.raise_for_status()
            ws.append({**r.json(), "seq": 0})
        rts = []
        for i in range(runtimes):
            body = {"name": f"rt-{i}", "type": "bench", "callback_url": "https://agents.example.com/hook",
                    "secret": "bench-secret-0123456789", "pool": POOL}  # fmt: skip
            r = await c.post("/v1/runtimes", json=body, headers=auth)
            r.raise_for_status()
            rts.append(r.json())
    return ws, rts


async def _beats(url: str, ws: list[dict[str, Any]], rate: float, conns: int, duration: float) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    per_conn = rate / conns
    end = time.perf_counter() + duration

    async def conn(k: int) -> None:
        nonlocal errors
        mine = ws[k::conns]
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            i = 0
            next_at = time.perf_counter()
            while next_at < end:
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                w = mine[i % len(mine)]
                w["seq"] += 1
                t0 = time.perf_counter()
                body = {"seq": w["seq"], "metrics": {"x": 1.0}}
                r = await c.post(f"/v1/workers/{w['worker_id']}/heartbeat", json=body,
                                 headers={"Authorization": f"Bearer {w['worker_token']}"})  # fmt: skip
                latencies.append((time.perf_counter() - t0) * 1e3)
                errors += r.status_code != 200
                i += 1
                next_at += 1.0 / per_conn

    await asyncio.gather(*(conn(k) for k in range(conns)))
    latencies.sort()
    return {
        "heartbeats": len(latencies),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "max_ms": round(max(latencies), 2),
        "errors": errors,
    }


async def _reports(url: str, rts: list[dict[str, Any]], reporters: int, stop: asyncio.Event) -> dict[str, int]:
    counts = {"reports": 0, "report_errors": 0}

    async def reporter(k: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            i = k
            while not stop.is_set():
                rt = rts[i % len(rts)]
                body = {"concurrent_agents": i % 50, "avg_llm_latency_ms": 420.0, "function_calling": True}
                r = await c.post(f"/v1/runtimes/{rt['id']}/report", json=body,
                                 headers={"Authorization": f"Bearer {rt['runtime_token']}"})  # fmt: skip
                counts["reports" if r.status_code == 200 else "report_errors"] += 1
                i += reporters

    await asyncio.gather(*(reporter(k) for k in range(reporters)))
    return counts


async def _run(args: argparse.Namespace, server: ServerProcess) -> dict[str, Any]:
    ws, rts = await _setup(server.url, server.admin_token, args.workers, args.runtimes)
    alone = await _beats(server.url, ws, args.rate, args.connections, args.duration)
    stop = asyncio.Event()
    reports = asyncio.create_task(_reports(server.url, rts, args.reporters, stop))
    with_reports = await _beats(server.url, ws, args.rate, args.connections, args.duration)
    stop.set()
    counts = await reports
    return {"heartbeats_alone": alone, "heartbeats_with_reports": with_reports, **counts,
            "reports_per_s": round(counts["reports"] / args.duration, 1)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--runtimes", type=int, default=16)
    p.add_argument("--reporters", type=int, default=4, help="concurrent runtime-report senders")
    p.add_argument("--rate", type=float, default=200.0, help="heartbeats per second in total")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    args = p.parse_args()
    with ServerProcess() as server:
        with admin_client(server) as admin:
            admin.put_pool(POOL)
        result = asyncio.run(_run(args, server))
    print(json.dumps({**vars(args), **result}))


if __name__ == "__main__":
    main()
