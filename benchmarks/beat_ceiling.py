"""What one control-plane process can ingest at most, without HTTP: the batch route's own work per worker beat.

``benchmarks/ingest.py --batch`` measures worker beats per second end to end (HTTP on loopback, a load generator on
the same cores). This one takes the network and the load generator away and calls what that route calls,
``dsec.control.ingest.handle_batch``, on a real ``ControlPlane`` (a temporary SQLite store, its group-commit writer
thread) with ``--workers`` registered workers, the same request bodies ``ingest.py`` sends (its metric summaries,
each item with the worker's own token, every beat acking the current directive), batch after batch. So it reports
the ceiling a single interpreter puts on ingest whatever the transport:

- ``alone``: only the beats (and the writer thread committing the beats with events and writing the hot state back),
  nothing else on the loop;
- ``serving``: also the reconcile pass every ``reconcile_interval_s``, as ``create_app`` runs it (fleet and quota
  judgments on their thread at this scale, the pacing that makes them give way). This is the ceiling the end-to-end
  figure approaches when the transport costs nothing;
- ``json``: of each beat's cost, what parsing the request and serializing the answer take (``pydantic_core.from_json``,
  ``orjson.dumps``, as ``HeartbeatShortcut`` does): how much a cheaper transport could ever save.

Both phases hold finer GIL switching, as a serving control plane does (``dsec.control.cpu_thread``), and keep
``--connections`` batches in flight (while one waits for the group commit of its beats with events, another is
applied); ``--event-ratio`` of the beats carry a log event, as in ``ingest.py``. Every figure is a wall-clock time
per worker beat over a phase's measured rounds (a round is one beat of every worker; a phase runs rounds for
``--duration`` seconds); ``*_beats_per_s`` is its inverse: the most beats a second one process makes, before
anything else costs anything. ``vs_target`` is ``serving_beats_per_s`` over the 50,000 worker beats/s the batch
ingest target names (docs/benchmarks.md). To compare two versions, run this file with ``PYTHONPATH`` set to each
one's ``src``.

    .venv/bin/python benchmarks/beat_ceiling.py                     # 10,000 workers, batches of 500, 10 s a phase
    .venv/bin/python benchmarks/beat_ceiling.py --workers 1000 --duration 3

Last stdout line: one JSON object (workers, batch, connections, event_ratio, duration_s, alone_beats,
alone_us_per_beat, alone_beats_per_s, serving_beats, serving_us_per_beat, serving_beats_per_s, json_us_per_beat,
target_beats_per_s, vs_target, errors).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import pydantic_core

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dsec.control.app import _reconcile_forever
from dsec.control.cpu_thread import finer_switching
from dsec.control.ingest import handle_batch
from dsec.control.metrics import ControlPlaneMetrics
from dsec.control.schemas import RegisterRequest
from dsec.control.server import tune_gc
from dsec.control.service import ControlPlane
from dsec.control.settings import Settings
from dsec.control.store import open_store
from dsec.model import Pool
from ingest import LOG_EVENT, METRIC_VARIANTS, NO_EVENTS, POOL, batch_body, batch_item, item_head, metric_blobs

ADMIN = "dsa_beat-ceiling-admin-token-0123"
TARGET_BEATS_PER_S = 50_000


class Workers:
    """The simulated workers' ids, tokens, next seq and acked directive version; their batches' bodies."""

    def __init__(self, ids: list[str], tokens: list[str], batch: int, event_ratio: float) -> None:
        self.heads = [item_head(i, t) for i, t in zip(ids, tokens, strict=True)]
        self.ids = ids
        self.seq = [0] * len(ids)
        self.acked = [0] * len(ids)
        self.batch = batch
        self.blobs = metric_blobs(METRIC_VARIANTS)
        self.event_ratio = event_ratio
        self.rnd = random.Random(7)

    def round(self) -> list[tuple[int, bytes]]:
        """One beat of every worker, as ``(first worker's index, body)`` per batch (built before it is timed)."""
        out = []
        for start in range(0, len(self.ids), self.batch):
            parts = []
            for k in range(start, min(start + self.batch, len(self.ids))):
                self.seq[k] += 1
                blob = self.blobs[(k + self.seq[k]) % len(self.blobs)]
                events = LOG_EVENT if self.rnd.random() < self.event_ratio else NO_EVENTS
                parts.append(batch_item(self.heads[k], self.seq[k], self.acked[k], blob, events))
            out.append((start, batch_body(parts)))
        return out

    def answered(self, start: int, answer: dict[str, Any]) -> int:
        """Take a batch's answer as ``ingest.py`` does (ack a directive it carries); the items not applied."""
        bad = 0
        for k, item in enumerate(answer["items"], start):
            if item.get("status") != 200 or item.get("duplicate"):
                bad += 1
            elif item.get("directive"):
                self.acked[k] = int(item["directive"]["version"])
        return bad


async def setup(args: argparse.Namespace, home: Path) -> tuple[ControlPlane, ControlPlaneMetrics, Workers]:
    settings = Settings.from_env(home=home, admin_token=ADMIN)
    cp = ControlPlane(settings, open_store(settings.database_url), time.time)
    await cp.put_pool(Pool(POOL, memory_base_gb=7.0, memory_ceiling_gb=12.0))
    ids, tokens = [], []
    for rank in range(args.workers):
        reg = await cp.register(RegisterRequest(pool=POOL, rank=rank, role="learner"), ADMIN)
        ids.append(reg["worker_id"])
        tokens.append(reg["worker_token"])
    return cp, ControlPlaneMetrics(cp.gauges), Workers(ids, tokens, args.batch, args.event_ratio)


async def rounds(
    cp: ControlPlane,
    metrics: ControlPlaneMetrics,
    ws: Workers,
    connections: int,
    count: int = 0,
    seconds: float = 0.0,
) -> tuple[float, int, int]:
    """``count`` rounds, or as many as start within ``seconds``: each round's batches answered by ``connections``
    concurrent tasks, one batch at a time each (as that many keep-alive connections of a node agent: while a batch
    waits for the group commit of its beats with events, another is applied). The seconds they took (building the
    bodies not counted), the beats sent and the items not applied."""
    spent, sent, bad = 0.0, 0, 0
    auth = f"Bearer {ADMIN}"
    done = 0

    async def connection(queue: list[tuple[int, bytes]]) -> int:
        failed = 0
        while queue:
            start, body = queue.pop()
            status, answer = await handle_batch(cp, metrics, auth, body)
            if status != 200:
                raise SystemExit(f"batch answered {status}: {str(answer)[:300]}")
            failed += ws.answered(start, answer)
            await asyncio.sleep(0)  # the loop's turn between requests
        return failed

    while done < count or spent < seconds:
        queue = ws.round()[::-1]
        t0 = time.perf_counter()
        bad += sum(await asyncio.gather(*(connection(queue) for _ in range(connections))))
        spent += time.perf_counter() - t0
        sent += len(ws.ids)
        done += 1
    return spent, sent, bad


def json_cost(ws: Workers) -> float:
    """Seconds per beat to parse a round's bodies and serialize answers of the same shape (one beat's answer:
    seq, duplicate, server time, no directive, the latency cap, status)."""
    bodies = ws.round()
    answer = {"seq": 1, "duplicate": False, "server_time": time.time(), "directive": None, "latency_cap_ms": 150.0,
              "status": 200}  # fmt: skip
    t0 = time.perf_counter()
    for _, body in bodies:
        doc = pydantic_core.from_json(body)
        orjson.dumps({"items": [dict(answer, seq=item["seq"]) for item in doc["items"]]})
    return (time.perf_counter() - t0) / len(ws.ids)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    tune_gc()  # as ``dsec serve`` does
    with tempfile.TemporaryDirectory(prefix="dsec-ceiling-") as d:
        cp, metrics, ws = await setup(args, Path(d))
        try:
            with finer_switching():  # what create_app's lifespan holds for as long as it serves
                # The first beats and the directive acks are committed: not the steady state.
                await rounds(cp, metrics, ws, args.connections, count=args.warmup)
                alone_s, alone_n, bad_alone = await rounds(cp, metrics, ws, args.connections, seconds=args.duration)
                json_s = json_cost(ws)
                ws.seq = [s + 1 for s in ws.seq]  # json_cost's round was never applied: skip its seqs
                passes = asyncio.create_task(_reconcile_forever(cp))
                try:
                    # Let the passes start (the first takes every view).
                    await rounds(cp, metrics, ws, args.connections, count=1)
                    # Long enough for several fleet (every 1 s) and quota (every 2 s) judgments.
                    serving = await rounds(cp, metrics, ws, args.connections, seconds=args.duration)
                    serving_s, serving_n, bad_serving = serving
                finally:
                    passes.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await passes
        finally:
            cp.close()
            cp.store.close()
    serving_per_s = round(serving_n / serving_s)
    return {
        "workers": args.workers,
        "batch": args.batch,
        "connections": args.connections,
        "event_ratio": args.event_ratio,
        "duration_s": args.duration,
        "alone_beats": alone_n,
        "alone_us_per_beat": round(1e6 * alone_s / alone_n, 2),
        "alone_beats_per_s": round(alone_n / alone_s),
        "serving_beats": serving_n,
        "serving_us_per_beat": round(1e6 * serving_s / serving_n, 2),
        "serving_beats_per_s": serving_per_s,
        "json_us_per_beat": round(1e6 * json_s, 2),
        "target_beats_per_s": TARGET_BEATS_PER_S,
        "vs_target": round(serving_per_s / TARGET_BEATS_PER_S, 3),
        "errors": bad_alone + bad_serving,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=10_000, help="registered workers (default 10,000)")
    ap.add_argument("--batch", type=int, default=500, help="worker beats per batch request (default 500)")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per phase (default 10)")
    ap.add_argument("--connections", type=int, default=4, help="batches in flight (default 4, as ingest.py's)")
    ap.add_argument(
        "--event-ratio", type=float, default=0.01, help="beats carrying a log event (default 0.01, as ingest.py's)"
    )
    ap.add_argument("--warmup", type=int, default=3, help="rounds (one beat of every worker) before measuring")
    args = ap.parse_args(argv)
    result = asyncio.run(bench(args))
    print(
        f"{args.workers} workers, batches of {args.batch}: alone {result['alone_us_per_beat']} us/beat "
        f"({result['alone_beats_per_s']:,} beats/s), serving {result['serving_us_per_beat']} us/beat "
        f"({result['serving_beats_per_s']:,} beats/s, x{result['vs_target']} of {TARGET_BEATS_PER_S:,}), "
        f"of which JSON {result['json_us_per_beat']} us; {result['errors']} errors",
        file=sys.stderr,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
