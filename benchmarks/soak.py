"""Soak and crash: many simulated workers beating for minutes against a real control plane, then a kill -9 of the
control plane under that load and a restart on the same store.

The control plane runs in a child process (``_common.ServerProcess``, a temporary SQLite store; with ``--postgres``
a throwaway PostgreSQL cluster on loopback, tests/pg_cluster.py, with fsync off: the crash is the control plane's,
not the database's). ``--workers``
workers register, then beat in batches (``POST /v1/heartbeats``, what ``dsec agent`` sends: ``--batch`` workers per
request over ``--connections`` connections), each worker every ``--interval`` s, paced. ``--event-ratio`` of the
beats carry a ``log`` event whose text names the worker and the beat's seq; an item answered 200 (not a duplicate)
is *acknowledged*: its event was committed before the answer. Meanwhile an operator changes a random worker's
directive every ``--directive-every`` s (each PATCH answered with the new version, committed before the answer).

1. **Soak** (``--duration`` s): the server's RSS and the batch requests' p99 per ``--window`` s. After the warm-up
   (``--warmup`` of the duration): ``rss_growth`` = (last RSS - RSS at the end of warm-up) / that RSS, and
   ``p99_stability`` = max / min of the windows' p99. A window's p99 is a p99 only when it holds enough requests:
   at the defaults (10,000 workers every 10 s, 1,250 per connection in batches of 500, 500 and 250: 2.4 requests a
   second) a 60 s window holds 144, a 10 s one 24, whose "p99" is their maximum. Each window reports its
   ``requests``; the summary adds the steady phase's p99 over all its requests (``p99_ms.steady``) and, from the
   same latencies, the stability over 10 s windows (``p99_stability_10s``, the window of the figures before
   2026-12-05).
2. **Crash**: SIGKILL of the control plane under that load, a restart on the same store and port; the workers keep
   their schedule and retry a failed request with the probe's backoff (``dsec.backoff.Backoff``, 0.5 s doubling to
   ``--backoff-cap``). ``--after-kill`` s later the load stops and the benchmark checks: every acknowledged event
   is in the store (``events_lost``), no directive version a worker saw or the operator was answered went backwards
   (``directive_regressions``: in the beats' answers, and each changed worker's directive read back), and every
   worker's beats were accepted again (``resume_s_max``: restart ready -> a worker's first accepted beat; it should
   be within one interval plus one backoff step).

The last stdout line is one JSON object. ``--latencies OUT`` also writes the soak phase's batch requests, one
``[answered at (unix time), seconds]`` per line, to line up with a trace of the server (docs/benchmarks.md,
2026-12-07).

    .venv/bin/python benchmarks/soak.py                                   # 10,000 workers, 10 min + crash
    .venv/bin/python benchmarks/soak.py --workers 1000 --duration 60 --after-kill 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ServerProcess, admin_client, percentile
from dsec.backoff import Backoff
from ingest import (
    METRIC_VARIANTS,
    NO_EVENTS,
    POOL,
    REGISTRATIONS_PER_TOKEN,
    RawConn,
    Run,
    Worker,
    batch_body,
    batch_item,
    metric_blobs,
)


@dataclass
class Soak:
    args: argparse.Namespace
    server: ServerProcess
    blobs: list[bytes]
    lat: list[tuple[float, float]] = field(default_factory=list)  # (answered at, seconds) per batch request
    beats: list[tuple[float, int]] = field(default_factory=list)  # (answered at, items) per batch request
    acked: set[str] = field(default_factory=set)  # texts of acknowledged events
    seen_version: dict[str, int] = field(default_factory=dict)  # worker -> highest directive version it saw
    regressions: list[str] = field(default_factory=list)
    answered_versions: dict[str, int] = field(default_factory=dict)  # worker -> newest version a PATCH answered
    last_ok: dict[str, float] = field(default_factory=dict)  # worker -> when its last beat was accepted
    resumed: dict[str, float] = field(default_factory=dict)  # worker -> first accepted beat after the restart
    killed_at: float = float("inf")
    restarted_at: float = float("inf")
    stop: bool = False
    errors: int = 0
    operator_errors: int = 0  # directive changes not answered (while the control plane was down)
    retries: int = 0
    behind_s: float = 0.0  # the largest lag behind the paced schedule

    def item(self, w: Worker, rnd: random.Random) -> tuple[bytes, str | None]:
        w.seq += 1
        text = None
        events = NO_EVENTS
        if rnd.random() < self.args.event_ratio:
            text = f"soak {w.id} {w.seq}"
            events = b'[{"type":"log","data":{"level":"info","msg":"%s"}}]' % text.encode()
        return batch_item(w.item_head, w.seq, w.acked, self.blobs[(w.rank + w.seq) % len(self.blobs)], events), text

    def answered(self, group: list[Worker], texts: list[str | None], answer: bytes, now: float) -> None:
        for w, text, r in zip(group, texts, orjson.loads(answer)["items"], strict=True):
            if r.get("status") != 200:
                self.errors += 1
                continue
            if text is not None and not r.get("duplicate"):
                self.acked.add(text)
            self.last_ok[w.id] = now
            if now >= self.restarted_at and w.id not in self.resumed:
                self.resumed[w.id] = now - self.restarted_at
            d = r.get("directive")
            if d:
                v = int(d["version"])
                if v < self.seen_version.get(w.id, 0):
                    self.regressions.append(f"{w.id}: saw version {v} after {self.seen_version[w.id]}")
                self.seen_version[w.id] = max(v, self.seen_version.get(w.id, 0))
                w.acked = v

    async def connection(self, cid: int, workers: list[Worker], host: str, port: int, head_for: Any) -> None:
        """Paced batches: group k of this connection every ``interval`` s, offset k * interval / groups; a failed
        request is retried (same beats) after the backoff."""
        args = self.args
        rnd = random.Random(cid)
        backoff = Backoff(0.5, max_s=args.backoff_cap)
        groups = [workers[i : i + args.batch] for i in range(0, len(workers), args.batch)]
        heads = [head_for("/v1/heartbeats", g[0].token) for g in groups]
        conn: RawConn | None = None
        t0 = time.monotonic() + rnd.uniform(0, args.interval / max(1, len(groups)))
        k = 0
        while not self.stop:
            g = k % len(groups)
            due = t0 + k * args.interval / len(groups)
            k += 1
            now = time.monotonic()
            if due > now:
                await asyncio.sleep(due - now)
            elif now < self.killed_at:  # the soak's own lag; during the crash every worker falls behind
                self.behind_s = max(self.behind_s, now - due)
            parts, texts = zip(*(self.item(w, rnd) for w in groups[g]), strict=True)
            body = batch_body(parts)
            attempt = 0
            while not self.stop:
                try:
                    if conn is None:
                        conn = await RawConn.open(host, port)
                    t_send = time.monotonic()
                    status, answer = await conn.post("/v1/heartbeats", groups[g][0].token, heads[g], body)
                    if status == 200:
                        done = time.monotonic()
                        self.lat.append((done, done - t_send))
                        self.beats.append((done, len(groups[g])))
                        self.answered(groups[g], list(texts), answer, done)
                        break
                    if status < 500:
                        self.errors += 1
                        break
                except (ConnectionError, OSError):
                    if conn is not None:
                        conn.close()
                    conn = None
                self.retries += 1
                await asyncio.sleep(backoff.delay(attempt, rnd))
                attempt += 1
        if conn is not None:
            conn.close()


async def register(args: argparse.Namespace, server: ServerProcess, tokens: list[str]) -> tuple[list[Worker], Any]:
    run = Run(args, server.host, server.port, tokens)
    workers = [Worker(rank=i) for i in range(args.workers)]
    per_conn = [workers[c :: args.connections] for c in range(args.connections)]
    await asyncio.gather(*(run.register_all(ws) for ws in per_conn if ws))
    return workers, run.head_for


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


async def soak(args: argparse.Namespace, server: ServerProcess, tokens: list[str]) -> dict[str, Any]:
    workers, head_for = await register(args, server, tokens)
    s = Soak(args, server, metric_blobs(METRIC_VARIANTS))
    per_conn = [workers[c :: args.connections] for c in range(args.connections)]
    tasks = [
        asyncio.create_task(s.connection(c, ws, server.host, server.port, head_for)) for c, ws in enumerate(per_conn)
    ]
    operator = asyncio.create_task(change_directives(s, workers))
    start = time.monotonic()
    windows: list[dict[str, Any]] = []
    try:
        while time.monotonic() - start < args.duration:
            await asyncio.sleep(args.window)
            now = time.monotonic()
            lat = sorted(x for t, x in s.lat if t > now - args.window)
            # Beats, not requests x --batch: a connection's last batch holds what is left of its workers.
            beats = sum(n for t, n in s.beats if t > now - args.window)
            windows.append({"t_s": round(now - start, 1), "rss_mb": round(rss_mb(server.pid), 1),
                            "p99_ms": round(percentile(lat, 99) * 1000, 1) if lat else None, "requests": len(lat),
                            "worker_beats_per_s": round(beats / args.window, 1)})  # fmt: skip
            print(f"soak {windows[-1]}", file=sys.stderr)
        soaked = list(s.lat)  # the soak phase's latencies, for the summary's steady-phase figures
        if args.latencies:
            wall = time.time() - time.monotonic()
            Path(args.latencies).write_text("".join(f"[{t + wall:.4f}, {x:.4f}]\n" for t, x in soaked))
        s.lat.clear()
        s.beats.clear()
        s.killed_at = time.monotonic()
        restart_s = await asyncio.to_thread(server.kill_and_restart)
        s.restarted_at = time.monotonic()
        await asyncio.sleep(args.after_kill)
    finally:
        s.stop = True
        operator.cancel()
        await asyncio.gather(*tasks, operator, return_exceptions=True)
    return summary(args, s, workers, windows, restart_s, soaked, start)


async def change_directives(s: Soak, workers: list[Worker]) -> None:
    """The operator: one random worker's compression every ``--directive-every`` s; what each PATCH answered."""
    rnd = random.Random(99)
    with admin_client(s.server) as admin:
        while True:
            await asyncio.sleep(s.args.directive_every)
            w = rnd.choice(workers)
            try:
                d = await asyncio.to_thread(admin.set_directive, w.id, compression_bits=rnd.choice([4, 8, 16, 32]))
            except Exception:  # the control plane is down (the crash): an unanswered change promises nothing
                s.operator_errors += 1
                continue
            s.answered_versions[w.id] = max(int(d["desired_version"]), s.answered_versions.get(w.id, 0))


def steady_latency(
    soaked: list[tuple[float, float]], since: float, until: float, window_s: float
) -> tuple[float | None, float | None]:
    """The p99 (ms) of every request answered in [since, until), and max / min of its ``window_s`` windows' p99."""
    lat = sorted(x for t, x in soaked if since <= t < until)
    p99s = []
    k = since
    while k + window_s <= until + 1e-9:
        part = sorted(x for t, x in soaked if k <= t < k + window_s)
        if part:
            p99s.append(percentile(part, 99))
        k += window_s
    overall = round(percentile(lat, 99) * 1000, 1) if lat else None
    return overall, (round(max(p99s) / min(p99s), 2) if p99s and min(p99s) > 0 else None)


def summary(
    args: argparse.Namespace,
    s: Soak,
    workers: list[Worker],
    windows: list[dict[str, Any]],
    restart_s: float,
    soaked: list[tuple[float, float]] | None = None,
    start: float = 0.0,
) -> dict[str, Any]:
    first = int(len(windows) * args.warmup)
    steady = windows[first:] or windows
    p99s = [w["p99_ms"] for w in steady if w["p99_ms"]]
    # The steady phase starts where its first window starts (t_s is a window's end).
    since = start + (windows[first]["t_s"] - args.window if windows[first:] else 0.0)
    until = start + (windows[-1]["t_s"] if windows else 0.0)
    steady_p99, stability_10s = steady_latency(soaked or [], since, until, 10.0)
    with admin_client(s.server) as admin:
        stored = {str(e["data"].get("msg")) for e in admin.all_events(types=["log"])}
        for wid, version in s.answered_versions.items():
            now = int(admin.directive(wid)["desired_version"])
            if now < version:
                s.regressions.append(f"{wid}: directive version {now} after the operator was answered {version}")
    lost = s.acked - stored
    resumed = sorted(s.resumed.values())
    return {
        "workers": args.workers,
        "interval_s": args.interval,
        "duration_s": args.duration,
        "rss_mb": {"after_warmup": steady[0]["rss_mb"], "end": steady[-1]["rss_mb"]},
        "rss_growth": round(steady[-1]["rss_mb"] / steady[0]["rss_mb"] - 1, 4),
        "p99_ms": {"min": min(p99s, default=None), "max": max(p99s, default=None), "steady": steady_p99},
        "p99_stability": round(max(p99s) / min(p99s), 2) if p99s else None,
        "p99_stability_10s": stability_10s,
        "window_requests_min": min((w["requests"] for w in steady), default=None),
        "worker_beats_per_s": round(statistics.fmean([w["worker_beats_per_s"] for w in steady]), 1),
        "behind_schedule_s_max": round(s.behind_s, 2),
        "restart_s": round(restart_s, 2),
        "events_acknowledged": len(s.acked),
        "events_lost": len(lost),
        "lost_samples": sorted(lost)[:5],
        "directive_changes": len(s.answered_versions),
        "directive_changes_unanswered": s.operator_errors,
        "directive_regressions": len(s.regressions),
        "regression_samples": s.regressions[:5],
        "workers_resumed": len(resumed),
        "resume_s_p50": round(percentile(resumed, 50), 2) if resumed else None,
        "resume_s_max": round(resumed[-1], 2) if resumed else None,
        "resume_bound_s": args.interval + args.backoff_cap,
        "retries": s.retries,
        "errors": s.errors,
        "windows": windows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=10_000)
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between one worker's beats")
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of soak before the crash")
    ap.add_argument("--warmup", type=float, default=0.25, help="share of the soak before RSS and p99 are judged")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per p99 window (see the module's docstring)")
    ap.add_argument("--after-kill", type=float, default=60.0, help="seconds of load after the restart")
    ap.add_argument("--event-ratio", type=float, default=0.01)
    ap.add_argument("--directive-every", type=float, default=1.0)
    ap.add_argument("--backoff-cap", type=float, default=5.0)
    ap.add_argument(
        "--latencies",
        default=None,
        metavar="OUT",
        help="write every batch request's (answered at, seconds) here, one JSON pair per line (wall-clock time, to "
        "line up with the server's own logs)",
    )
    ap.add_argument(
        "--postgres",
        action="store_true",
        help="the store in a throwaway PostgreSQL cluster on loopback (tests/pg_cluster.py; fsync off) instead of "
        "a temporary SQLite file",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    with contextlib.ExitStack() as stack:
        url = None
        if args.postgres:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from pg_cluster import throwaway_postgres

            url = stack.enter_context(throwaway_postgres())
        server = stack.enter_context(ServerProcess(database_url=url))
        with admin_client(server) as admin:
            admin.put_pool(POOL, memory_base_gb=7.0, memory_ceiling_gb=12.0)
            n = -(-args.workers // REGISTRATIONS_PER_TOKEN)
            tokens = [admin.create_token(pool=POOL, label=f"soak {i}") for i in range(n)]
        result = runner(soak(args, server, tokens))
        result["store"] = "postgresql" if args.postgres else "sqlite"
    print(
        f"{result['workers']} workers every {args.interval:g} s for {args.duration:g} s: RSS growth "
        f"{result['rss_growth']:.1%}, p99 {result['p99_ms']} ms (x{result['p99_stability']}); kill -9 + restart "
        f"{result['restart_s']} s: {result['events_lost']} of {result['events_acknowledged']} acknowledged events "
        f"lost, {result['directive_regressions']} directive regressions, {result['workers_resumed']} workers resumed "
        f"(max {result['resume_s_max']} s)",
        file=sys.stderr,
    )
    print(json.dumps(result))
    ok = result["events_lost"] == 0 and result["directive_regressions"] == 0
    return 0 if ok and result["workers_resumed"] == args.workers else 1


if __name__ == "__main__":
    sys.exit(main())
