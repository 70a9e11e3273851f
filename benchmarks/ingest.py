"""Heartbeat ingest benchmark: N simulated workers beating against a real control plane.

The control plane runs in a child process (``_common.ServerProcess``: ``create_app`` under
``uvicorn.Server`` with ``uvicorn_config``, a temporary SQLite store). This process creates one pool
and a pool token over the admin API, then simulates ``--workers`` workers as asyncio clients on
loopback: each registers with the pool token and then heartbeats with its own token (about 8 metric
summaries per beat; ``--event-ratio`` of the beats carry one ``log`` event, which takes the durable
group-commit path before it is answered).

The workers are multiplexed over ``--connections`` HTTP/1.1 keep-alive connections (worker i on
connection i mod C, one request in flight per connection). By default the load is closed-loop: a
connection sends its next worker's beat as soon as the previous answer arrived, so every worker's
next beat follows its previous answer. With ``--rate R`` the beats are paced instead (R beats/s in
total, each worker every N/R s) and latency is also measured from the scheduled send time
(``e2e_*``), so falling behind the schedule shows up in the numbers.

The default client is a hand-written HTTP/1.1 client (an asyncio ``Protocol`` on uvloop, requests
assembled from pre-built bytes), so it takes as little CPU as possible away from the server on a
small machine; ``--client httpx`` uses ``httpx.AsyncClient`` for comparison.

With ``--batch N`` the same workers also beat in batches — what ``dsec agent`` sends: each request is a
``POST /v1/heartbeats`` carrying N workers' beats (each with its own worker token), closed loop over the
connections — after a single-beat phase of the same length on the same server, so one run reports both:
``worker_beats_per_s`` and ``p99_ms`` (of the batch requests: what each worker's beat waited) for the batched
phase, ``single_heartbeats_per_s`` and ``single_p99_ms`` for the single-beat one, and ``batched_vs_single``: the
ratio of the two rates. For a change to the batch path only, it compares two versions across runs on a noisy
machine better than either rate. Workers register with as many pool tokens as their quota and burst need (2000
each).

    .venv/bin/python benchmarks/ingest.py --workers 10000 --batch 500 --duration 10

    .venv/bin/python benchmarks/ingest.py                      # 1000 workers, 64 conns, 20 s
    .venv/bin/python benchmarks/ingest.py --rate 2000          # paced
    .venv/bin/python benchmarks/ingest.py --py-spy /tmp/p.txt  # profile the server meanwhile
    .venv/bin/python benchmarks/_common.py pyspy-summary /tmp/p.txt --thread MainThread

The last line of stdout is one JSON object (workers, heartbeats_per_s, p50_ms, p99_ms, errors,
connections, duration_s and more).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PySpy, ServerProcess, admin_client, percentile

POOL = "bench"
METRIC_VARIANTS = 64
LOG_EVENT = b'[{"type":"log","data":{"level":"info","msg":"step 1234: loss=0.4312 lr=3.0e-4 tokens/s=51234"}}]'
NO_EVENTS = b"[]"


def metric_blobs(n: int, seed: int = 7) -> list[bytes]:
    """``n`` pre-serialised metric dicts: the ~8 summaries a training worker reports per beat."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        ops = rnd.randint(1_000, 1_000_000)
        out.append(
            orjson.dumps(
                {
                    "memory_used_gb": round(rnd.uniform(4.0, 11.5), 3),
                    "gpu_util": round(rnd.uniform(0.4, 1.0), 4),
                    "step_time_ms_p50": round(rnd.uniform(80, 400), 2),
                    "step_time_ms_p99": round(rnd.uniform(400, 1200), 2),
                    "sync_latency_ms_p99": round(rnd.uniform(5, 120), 2),
                    "bandwidth_mbps": round(rnd.uniform(10, 128), 2),
                    "sync_ops_total": float(ops),
                    "sync_ok_total": float(ops - rnd.randint(0, ops // 100)),
                }
            )
        )
    return out


def item_head(worker_id: str, token: str) -> bytes:
    """The start of a worker's item in a batch body: its id and its own token (the rest: :func:`batch_item`)."""
    return b'{"worker_id":"%s","token":"%s",' % (worker_id.encode(), token.encode())


def batch_item(head: bytes, seq: int, acked: int, metrics: bytes, events: bytes) -> bytes:
    """One worker's item of a ``POST /v1/heartbeats`` body, after its :func:`item_head`."""
    return b'%s"seq":%d,"acked_directive_version":%d,"metrics":%s,"events":%s}' % (head, seq, acked, metrics, events)


def batch_body(items: Iterable[bytes]) -> bytes:
    """A ``POST /v1/heartbeats`` body of the items (:func:`batch_item`)."""
    return b'{"items":[%s]}' % b",".join(items)


@dataclass
class Worker:
    rank: int
    id: str = ""
    token: str = ""
    acked: int = 0
    seq: int = 0
    raw_head: bytes = b""  # request line + headers up to "content-length: "
    path: str = ""
    item_head: bytes = b""  # the start of its item in a batch: worker id and token


@dataclass
class Stats:
    ok: int = 0
    errors: int = 0
    transport_errors: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    lat: list[float] = field(default_factory=list)  # send -> answer, seconds
    e2e: list[float] = field(default_factory=list)  # scheduled -> answer (paced mode)
    ev_lat: list[float] = field(default_factory=list)  # send -> answer of beats carrying an event
    events_sent: int = 0
    directives_seen: int = 0
    requests: int = 0  # measured requests (batches in batched mode)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])


# -- transports ------------------------------------------------------------------------------------
class RawConn(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection, one request in flight. Parses just the status line and
    Content-Length of uvicorn's answers (it never chunks a ``Response`` with a body)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> RawConn:
        _, proto = await asyncio.get_running_loop().create_connection(cls, host, port)
        return proto

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_exception(ConnectionError(f"connection lost: {exc}"))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(buf[:end]).lower()
        i = head.find(b"\r\ncontent-length:")
        if i < 0:
            self._fail(f"answer without content-length: {head[:200]!r}")
            return
        j = head.find(b"\r\n", i + 2)
        length = int(head[i + 17 : j if j >= 0 else len(head)])
        stop = end + 4 + length
        if len(buf) < stop:
            return
        status = int(head[9:12])
        body = bytes(buf[end + 4 : stop])
        del buf[:stop]
        w, self.waiter = self.waiter, None
        if not w.done():
            w.set_result((status, body))

    def _fail(self, why: str) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_exception(ConnectionError(why))
        if self.transport is not None:
            self.transport.close()

    async def post(self, path: str, token: str, head: bytes, body: bytes) -> tuple[int, bytes]:
        if self.transport is None:
            raise ConnectionError("not connected")
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self.waiter = fut
        self.transport.write(b"%s%d\r\n\r\n%s" % (head, len(body), body))
        return await fut

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class HttpxConn:
    """Same interface over a shared ``httpx.AsyncClient`` (for comparison)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def post(self, path: str, token: str, head: bytes, body: bytes) -> tuple[int, bytes]:
        import httpx

        headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
        try:
            resp = await self.client.post(path, content=body, headers=headers)
        except httpx.TransportError as exc:
            raise ConnectionError(str(exc) or type(exc).__name__) from exc
        return resp.status_code, resp.content

    def close(self) -> None:
        pass


# -- the benchmark ---------------------------------------------------------------------------------
REGISTRATIONS_PER_TOKEN = 2000  # a pool token's rate-limit burst (and within its quota of 4096 workers)


@dataclass
class Run:
    args: argparse.Namespace
    host: str
    port: int
    pool_tokens: list[str]
    stats: Stats = field(default_factory=Stats)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    t0: float = 0.0  # load starts (after registration)
    m0: float = float("inf")  # measured window
    m1: float = float("inf")
    stop: bool = False
    blobs: list[bytes] = field(default_factory=list)
    httpx_client: Any = None
    server_pid: int = 0

    def head_for(self, path: str, token: str) -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\nauthorization: Bearer {token}\r\n"
            "content-type: application/json\r\ncontent-length: "
        ).encode()

    async def connect(self) -> RawConn | HttpxConn:
        if self.httpx_client is not None:
            return HttpxConn(self.httpx_client)
        return await RawConn.open(self.host, self.port)

    async def register(self, conn: RawConn | HttpxConn, w: Worker) -> None:
        body = orjson.dumps(
            {
                "pool": POOL,
                "rank": w.rank,
                "role": "learner",
                "host": "bench-node",
                "pid": 10_000 + w.rank,
                "heartbeat_interval_s": self.args.interval,
            }
        )
        path = "/v1/workers/register"
        token = self.pool_tokens[w.rank // REGISTRATIONS_PER_TOKEN % len(self.pool_tokens)]
        status, answer = await conn.post(path, token, self.head_for(path, token), body)
        if status != 201:
            raise RuntimeError(f"register rank {w.rank}: HTTP {status} {answer[:300]!r}")
        reg = orjson.loads(answer)
        w.id, w.token = reg["worker_id"], reg["worker_token"]
        w.acked = int(reg["directive"]["version"])  # we apply it at once: ack it on the first beat
        w.path = f"/v1/workers/{w.id}/heartbeat"
        w.raw_head = self.head_for(w.path, w.token)
        w.item_head = item_head(w.id, w.token)

    async def register_all(self, workers: list[Worker]) -> None:
        conn = await self.connect()
        try:
            for w in workers:
                await self.register(conn, w)
        finally:
            conn.close()

    async def batch_connection(self, cid: int, workers: list[Worker]) -> None:
        """Closed loop of ``POST /v1/heartbeats``, ``--batch`` of this connection's workers per request."""
        args, st = self.args, self.stats
        conn = await self.connect()
        await self.go.wait()
        rnd = random.Random(cid)
        blobs, nblobs = self.blobs, len(self.blobs)
        perf = time.perf_counter
        groups = [workers[i : i + args.batch] for i in range(0, len(workers), args.batch)]
        path = "/v1/heartbeats"
        heads = [self.head_for(path, g[0].token) for g in groups]
        k = 0
        try:
            while not self.stop:
                g = k % len(groups)
                group, head = groups[g], heads[g]
                k += 1
                parts = []
                events = 0
                for w in group:
                    w.seq += 1
                    ev = NO_EVENTS
                    if rnd.random() < args.event_ratio:
                        ev, events = LOG_EVENT, events + 1
                    parts.append(batch_item(w.item_head, w.seq, w.acked, blobs[(w.rank + w.seq) % nblobs], ev))
                body = batch_body(parts)
                t_send = perf()
                try:
                    status, answer = await conn.post(path, group[0].token, head, body)
                except ConnectionError as exc:
                    st.transport_errors += 1
                    st.error(f"transport: {exc}")
                    if self.stop:
                        break
                    conn.close()
                    conn = await self.connect()
                    continue
                t_done = perf()
                measured = self.m0 <= t_done <= self.m1
                if status != 200:
                    st.statuses[status] += 1
                    st.error(f"HTTP {status}: {answer[:200]!r}")
                    continue
                applied = 0
                for w, r in zip(group, orjson.loads(answer)["items"], strict=True):
                    if r.get("status") != 200 or r.get("duplicate"):
                        st.error(f"item {w.id}: {str(r)[:200]}")
                        continue
                    applied += 1
                    if r.get("directive"):
                        st.directives_seen += 1
                        w.acked = int(r["directive"]["version"])
                if measured:
                    st.statuses[status] += 1
                    st.ok += applied
                    st.requests += 1
                    st.lat.append(t_done - t_send)
                    st.events_sent += events
                    if events:
                        st.ev_lat.append(t_done - t_send)
        finally:
            conn.close()

    async def connection(self, cid: int, workers: list[Worker]) -> None:
        args, st = self.args, self.stats
        conn = await self.connect()
        await self.go.wait()
        rnd = random.Random(cid)
        blobs, nblobs = self.blobs, len(self.blobs)
        paced = args.rate is not None
        period = args.connections / args.rate if paced else 0.0
        due = self.t0 + cid / args.rate if paced else 0.0
        perf = time.perf_counter
        k = 0
        n = len(workers)
        try:
            while not self.stop:
                w = workers[k % n]
                k += 1
                if paced:
                    due += period
                    delay = due - perf()
                    if delay > 0:
                        await asyncio.sleep(delay)
                        if self.stop:
                            break
                w.seq += 1
                ev = LOG_EVENT if rnd.random() < args.event_ratio else NO_EVENTS
                body = b'{"seq":%d,"acked_directive_version":%d,"metrics":%s,"events":%s}' % (
                    w.seq,
                    w.acked,
                    blobs[(w.rank + w.seq) % nblobs],
                    ev,
                )
                t_send = perf()
                try:
                    status, answer = await conn.post(w.path, w.token, w.raw_head, body)
                except ConnectionError as exc:
                    st.transport_errors += 1
                    st.error(f"transport: {exc}")
                    if self.stop:
                        break
                    conn.close()
                    conn = await self.connect()
                    continue
                t_done = perf()
                measured = self.m0 <= t_done <= self.m1
                if status != 200 or b'"duplicate":false' not in answer:
                    # Counted in warmup too: any failed or not-applied beat is an error.
                    st.statuses[status] += 1
                    st.error(f"HTTP {status}: {answer[:200]!r}")
                    continue
                if b'"directive":null' not in answer:  # a new directive: apply and ack it next beat
                    st.directives_seen += 1
                    d = orjson.loads(answer).get("directive")
                    if d:
                        w.acked = int(d["version"])
                if measured:
                    st.statuses[status] += 1
                    st.ok += 1
                    st.lat.append(t_done - t_send)
                    if paced:
                        st.e2e.append(t_done - due)
                    if ev is LOG_EVENT:
                        st.events_sent += 1
                        st.ev_lat.append(t_done - t_send)
        finally:
            conn.close()


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def machine_busy_s() -> float:
    """CPU seconds all CPUs spent busy (not idle/iowait) since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return (sum(vals[:8]) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


async def bench(args: argparse.Namespace, server: ServerProcess, pool_tokens: list[str]) -> dict[str, Any]:
    run = Run(args, server.host, server.port, pool_tokens, blobs=metric_blobs(METRIC_VARIANTS), server_pid=server.pid)
    if args.client == "httpx":
        import httpx

        run.httpx_client = httpx.AsyncClient(
            base_url=server.url,
            timeout=30.0,
            limits=httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections),
        )
    workers = [Worker(rank=i) for i in range(args.workers)]
    try:
        t_reg = time.perf_counter()
        per_conn = [workers[c :: args.connections] for c in range(args.connections)]
        await asyncio.wait_for(
            asyncio.gather(*(run.register_all(ws) for ws in per_conn if ws)), timeout=args.setup_timeout
        )
        reg_s = time.perf_counter() - t_reg
        print(f"registered {args.workers} workers in {reg_s:.2f} s", file=sys.stderr)
        single = await phase(run, workers, batched=False)
        single["register_s"] = round(reg_s, 3)
        if not args.batch:
            return single
        batched = await phase(run, workers, batched=True)
    finally:
        if run.httpx_client is not None:
            await run.httpx_client.aclose()
    return {
        "workers": args.workers,
        "batch": args.batch,
        "worker_beats_per_s": batched["heartbeats_per_s"],
        "p99_ms": batched["p99_ms"],
        "p50_ms": batched["p50_ms"],
        "single_heartbeats_per_s": single["heartbeats_per_s"],
        "single_p99_ms": single["p99_ms"],
        # The two phases share the run's machine: comparing two versions of the batch path by this ratio takes out
        # much of the machine's speed between runs (docs/benchmarks.md, 2026-12-07 late night).
        "batched_vs_single": round(batched["heartbeats_per_s"] / single["heartbeats_per_s"], 3)
        if single["heartbeats_per_s"]
        else None,
        "errors": single["errors"] + batched["errors"],
        "register_s": round(reg_s, 3),
        "single": single,
        "batched": batched,
    }


async def phase(run: Run, workers: list[Worker], batched: bool) -> dict[str, Any]:
    """One load phase on fresh connections: warmup, then the measured window; its figures."""
    args = run.args
    run.stats, run.go, run.stop = Stats(), asyncio.Event(), False
    run.m0 = run.m1 = float("inf")
    conns = args.batch_connections if batched else args.connections
    per_conn = [workers[c::conns] for c in range(conns)]
    loop = run.batch_connection if batched else run.connection
    tasks = [asyncio.create_task(loop(c, ws)) for c, ws in enumerate(per_conn) if ws]
    spy: PySpy | None = None
    server = run.server_pid
    try:
        await asyncio.sleep(0.2)  # connections open
        run.t0 = time.perf_counter()
        run.go.set()
        await asyncio.sleep(args.warmup)
        spy = PySpy(server, args.py_spy, args.duration) if args.py_spy and batched == bool(args.batch) else None
        cpu0, srv0, all0 = time.process_time(), server_cpu_s(server), machine_busy_s()
        run.m0 = time.perf_counter()
        run.m1 = run.m0 + args.duration
        await asyncio.sleep(args.duration)
        run.stop = True
        window = time.perf_counter() - run.m0
        cpu1, srv1, all1 = time.process_time(), server_cpu_s(server), machine_busy_s()
        done, pending = await asyncio.wait(tasks, timeout=10.0)
        for t in pending:
            t.cancel()
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if spy is not None:
        spy.wait()
    st = run.stats
    lat = sorted(st.lat)

    def ms(values: list[float], q: float) -> float | None:
        return round(percentile(sorted(values), q) * 1e3, 3) if values else None

    result: dict[str, Any] = {
        "workers": args.workers,
        "heartbeats_per_s": round(st.ok / args.duration, 1),
        "p50_ms": ms(lat, 50),
        "p99_ms": ms(lat, 99),
        "errors": st.errors,
        "connections": conns,
        "duration_s": args.duration,
        "p999_ms": ms(lat, 99.9),
        "max_ms": round(lat[-1] * 1e3, 3) if lat else None,
        "mode": ("batched" if batched else "single") + (f", paced {args.rate}/s" if args.rate else ", closed-loop"),
        "client": args.client,
        "beats": st.ok,
        "requests_per_s": round((st.requests if batched else st.ok) / args.duration, 1),
        "events_sent": st.events_sent,
        "event_beat_p50_ms": ms(st.ev_lat, 50),
        "event_beat_p99_ms": ms(st.ev_lat, 99),
        "transport_errors": st.transport_errors,
        "statuses": {str(k): v for k, v in sorted(st.statuses.items())},
        "server_cpu_pct": round(100 * (srv1 - srv0) / window, 1),
        # CPU cost per answered beat: comparable across runs even when the machine is shared.
        "server_cpu_us_per_beat": round(1e6 * (srv1 - srv0) / st.ok, 1) if st.ok else None,
        "client_cpu_us_per_beat": round(1e6 * (cpu1 - cpu0) / st.ok, 1) if st.ok else None,
        "client_cpu_pct": round(100 * (cpu1 - cpu0) / window, 1),
        # Everything else on the machine (other processes, kernel): a noisy neighbour shows up here.
        "other_cpu_pct": round(100 * ((all1 - all0) - (srv1 - srv0) - (cpu1 - cpu0)) / window, 1),
        "cpus": os.cpu_count(),
    }
    if batched:
        result["batch"] = args.batch
    if args.rate and not batched:
        result["e2e_p50_ms"] = ms(st.e2e, 50)
        result["e2e_p99_ms"] = ms(st.e2e, 99)
    if st.error_samples:
        result["error_samples"] = st.error_samples
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1000, help="simulated workers (default 1000)")
    ap.add_argument("--connections", type=int, default=64, help="keep-alive connections (default 64)")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds (default 20)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of load before measuring (default 5)")
    ap.add_argument(
        "--rate", type=float, default=None, help="pace to this many beats/s in total instead of closed-loop"
    )
    ap.add_argument(
        "--interval",
        type=float,
        default=5.0,
        help="heartbeat_interval_s the workers declare (liveness only; default 5)",
    )
    ap.add_argument(
        "--event-ratio", type=float, default=0.01, help="share of beats carrying one log event (default 0.01)"
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=0,
        metavar="N",
        help="after the single-beat phase, a batched phase: N workers' beats per POST /v1/heartbeats",
    )
    ap.add_argument(
        "--batch-connections",
        type=int,
        default=4,
        help="connections of the batched phase (default 4: each holds one batch in flight)",
    )
    ap.add_argument("--client", choices=("raw", "httpx"), default="raw")
    ap.add_argument(
        "--py-spy",
        default=None,
        metavar="OUT",
        help="record the server with py-spy (raw collapsed stacks) during the measured window",
    )
    ap.add_argument("--cprofile", default=None, metavar="OUT", help="run the server under cProfile, dump here")
    ap.add_argument(
        "--server-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a control-plane Settings field, e.g. flush_interval_s=5 (repeatable)",
    )
    ap.add_argument(
        "--server-wrap",
        default=None,
        metavar="MODULE:CALLABLE",
        help="wrap the app with a prototype (importable by the server, e.g. from benchmarks/)",
    )
    ap.add_argument("--setup-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    if not 1 <= args.workers <= 100_000:
        ap.error("--workers must be in 1..100000")
    if not 1 <= args.connections <= 1024:
        ap.error("--connections must be in 1..1024")
    args.connections = min(args.connections, args.workers)
    if not 0 < args.duration <= 600 or not 0 <= args.warmup <= 600:
        ap.error("--duration must be in (0, 600] and --warmup in [0, 600]")
    if args.rate is not None and not 0 < args.rate <= 1_000_000:
        ap.error("--rate must be in (0, 1000000]")
    if not 0 <= args.event_ratio <= 1:
        ap.error("--event-ratio must be in [0, 1]")
    if args.batch and not 1 <= args.batch <= 1000:
        ap.error("--batch must be in 1..1000 (MAX_BATCH_ITEMS)")
    if args.batch and (args.rate is not None or args.client != "raw"):
        ap.error("--batch runs closed loop with the raw client (no --rate, no --client httpx)")
    if not 1 <= args.batch_connections <= 1024:
        ap.error("--batch-connections must be in 1..1024")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM -> SystemExit, so the server child is stopped by the context manager below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    with ServerProcess(cprofile_out=args.cprofile, settings=args.server_setting, wrap=args.server_wrap) as server:
        with admin_client(server) as admin:
            admin.put_pool(POOL, memory_base_gb=7.0, memory_ceiling_gb=12.0)
            tokens = -(-args.workers // REGISTRATIONS_PER_TOKEN)
            pool_tokens = [admin.create_token(pool=POOL, label=f"bench {i}") for i in range(tokens)]
        result = runner(bench(args, server, pool_tokens))
        rc = server.stop()
    if rc not in (0, None):
        print(f"warning: control plane exited with {rc}", file=sys.stderr)
    for one in (result["single"], result["batched"]) if args.batch else (result,):
        if one["other_cpu_pct"] > 15:
            print(
                f"warning: other processes used {one['other_cpu_pct']}% CPU during the measured window "
                f"({one['mode']}); the numbers are not from a quiet machine",
                file=sys.stderr,
            )
        print(
            f"{one['workers']} workers, {one['connections']} conns, {one['mode']}, {args.client}: "
            f"{one['heartbeats_per_s']:.0f} beats/s, p50 {one['p50_ms']:.2f} ms, "
            f"p99 {one['p99_ms']:.2f} ms, errors {one['errors']}, "
            f"server CPU {one['server_cpu_pct']}%, client CPU {one['client_cpu_pct']}%"
        )
    print(json.dumps(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the server child was already stopped on the way out
        print("interrupted", file=sys.stderr)
        sys.exit(130)
