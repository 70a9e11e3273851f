"""Chaos on a real job: 4 CPU ranks of the PPO example under one fault mix, with DSec off and with DSec on.

The small real counterpart of the cluster simulator. The PPO example (examples/ppo_cartpole_ddp.py, DDP over
gloo on 127.0.0.1, no dsec import) runs with 4 ranks for a fixed wall-clock budget, twice, under the same fault
schedule; the benchmark reports each run's goodput and the ratio.

Fault mix (the probe's built-in ``DSEC_CHAOS``, whose ``after_s`` counts from each process's start of training,
plus one SIGKILL sent by this benchmark):

* a straggler: rank 1 arrives late at every gradient sync (``sync_delay_ms``) in windows at 8-28% and 48-68%
  (and 88%-) of the budget, each window's delay drawn from 150..250 ms with ``--seed``;
* memory growth: rank 2's resident memory grows at 16 MB/s (at most 400 MB) from 15% to 40% of the budget;
* a crash: rank 3 is SIGKILLed at 45% of the budget after training started (once per run).

The DSEC_CHAOS windows belong to a process's lifetime: a restarted rank sees them again from its own start of
training (a slow node stays slow, a leak leaks again), in both runs alike. Both runs use the same schedule and
seed; only what happens after a fault differs.

DSec OFF ("baseline", common practice): ``torchrun --standalone --nproc-per-node 4 --max-restarts 3`` (the elastic
agent restarts the whole group when a rank dies). The example has no checkpointing of its own (no torch.save, no
resume flag), so a restart starts training **from scratch**: everything before the crash is lost. Stragglers slow
every peer (nothing reacts). The probe is in the processes only because it is what injects the faults
(``DSEC_CHAOS`` lives in its DDP comm hook and heartbeat thread, and memory growth is driven by its beats): it
reports to a passive recorder in this process that answers every beat with no directive, so nothing ever acts.
Its comm hook at the default 32 bits is one all_reduce per bucket, like DDP's own. torchrun runs with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch 2.13's shared rendezvous store a restarted gloo group reads the
dead group's addresses and hangs or fails in ``init_process_group``, i.e. torchrun's restart would not work at all.

DSec ON: a real control plane (``dsec serve`` on a loopback port, temporary DSEC_HOME, SQLite; default judgment:
the circuit breaker degrades a straggler to 4-bit compression, then gradient accumulation), and the job launched by
the supervisor (the Python API behind ``dsec launch``, local launcher, cold starts unless ``--warm``) with
snapshots every ``--snapshot-interval`` s; a crash restarts the group with ``DSEC_RESTORE=latest``. The example
policies are not loaded: their rules look at 1-hour windows, far beyond a run of a minute or two.

Measurement, both runs alike: rank 0 of the example prints one line per PPO update (``--log-every 1``); the
benchmark reads them as they appear and stamps them with the wall clock. Training start (t0) is the first line's
time minus the elapsed time it reports; the budget runs from t0 to t0 + ``--duration``, then everything is stopped.
A restart shows as the update counter starting again. Work *retained* at the end is the last segment's work plus
what its start inherited: nothing for the baseline (from scratch); for DSec, the work rank 0 had completed when the
snapshot it restored was taken (last update line printed before that snapshot began, a lower bound). Counted:

* optimizer steps = PPO updates x update epochs (8) x minibatches (4): the ``optimizer.step()`` calls the script
  makes. Under the breaker's gradient accumulation the probe turns 3 of 4 into accumulation (no gradient is
  dropped); ``applied_fraction`` (rank 0's probe counters: applied / (applied + accumulated)) says how many were
  applied as parameter updates, and ``applied_updates_ratio`` weighs the goodput by it;
* environment steps = PPO updates x rollout (``--num-steps`` x 4 envs x 4 ranks);
* goodput = retained optimizer (or environment) steps / budget; ``goodput_ratio`` = DSec / baseline;
* restarts, downtime (kill -> the restarted group's training start), lost work (kill -> the time the retained state
  had been reached), time lost to recovery = downtime + lost work;
* best and last average return (the example's pooled mean of the last ~20 episodes).

``pre_crash_ratio`` compares the rates before the crash (straggler and memory growth only: the breaker's share of
the gain); the rest of ``goodput_ratio`` is the crash (from scratch vs from a snapshot).

Last stdout line: one JSON object. Exit status 1 when a run failed (its ``error`` is in the JSON), 130 when
interrupted (Ctrl-C, SIGTERM); every process and server the benchmark started is stopped either way.

    python benchmarks/chaos_real.py [--duration 75] [--seed 1] [--quick] [--warm]
    python benchmarks/chaos_real.py --scenario bandwidth [--rate-mbit 2] [--duration 60]   # a real slow link
    python benchmarks/chaos_real.py --scenario memory [--duration 150]   # quotas on/off, two ranks on one card
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from _common import wait_healthy

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "ppo_cartpole_ddp.py"
DSEC = Path(sys.executable).with_name("dsec")
ADMIN = "dsa_bench_chaos_admin_token"
POOL = "bench"
GROUP = "learners"
WORLD = 4
NUM_ENVS = 4  # the example's default, passed explicitly
UPDATE_EPOCHS = 8
MINIBATCHES = 4
OPT_STEPS_PER_UPDATE = UPDATE_EPOCHS * MINIBATCHES
STRAGGLER_RANK, MEMORY_RANK, CRASH_RANK = 1, 2, 3
START_TIMEOUT_S = 180.0  # launch -> first progress line (4 interpreters importing torch on 2 cores)

# "update    3  env_steps    1536  episodes    70  avg_return   21.3  lr ...  t    2.1s" (rank 0, --log-every 1)
LINE = re.compile(
    r"^update\s+(\d+)\s+env_steps\s+(\d+)\s+episodes\s+(\d+)\s+avg_return\s+(\S+)\s.*\bt\s+([0-9.]+)s\s*$"
)


# -- the fault schedule --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Schedule:
    duration_s: float
    crash_at_s: float
    chaos: str  # DSEC_CHAOS
    windows: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "duration_s": self.duration_s,
            "crash": {"rank": CRASH_RANK, "signal": "SIGKILL", "at_s": round(self.crash_at_s, 2)},
            "chaos_windows": self.windows,
            "dsec_chaos": self.chaos,
        }


def make_schedule(duration: float, seed: int) -> Schedule:
    rng = random.Random(seed)
    clauses: list[str] = []
    windows: list[dict[str, Any]] = []
    start = 0.08 * duration
    while start < duration - 1.0:
        delay = rng.randint(150, 250)
        length = min(0.2 * duration, duration - start)
        clauses.append(f"sync_delay_ms={delay},rank={STRAGGLER_RANK},after_s={start:.2f},for_s={length:.2f}")
        windows.append({"kind": "sync_delay_ms", "value": delay, "rank": STRAGGLER_RANK, "after_s": round(start, 2),
                        "for_s": round(length, 2)})  # fmt: skip
        start += 0.4 * duration
    mem_after, mem_for = 0.15 * duration, 0.25 * duration
    clauses.append(
        f"memory_growth_mb_per_s=16,max_mb=400,rank={MEMORY_RANK},after_s={mem_after:.2f},for_s={mem_for:.2f}"
    )
    windows.append({"kind": "memory_growth_mb_per_s", "value": 16, "max_mb": 400, "rank": MEMORY_RANK,
                    "after_s": round(mem_after, 2), "for_s": round(mem_for, 2)})  # fmt: skip
    return Schedule(duration, 0.45 * duration, ";".join(clauses), windows)


# -- rank 0's progress lines, stamped with the wall clock ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Line:
    wall: float
    update: int
    env_steps: int
    episodes: int
    avg_return: float
    t: float  # the example's own elapsed training time (mean over ranks)


class LogTail:
    """Reads new complete lines from log files (a file, or every ``*.log`` in a folder) as they grow."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def _files(self) -> list[Path]:
        if self.path.is_dir():
            return sorted(self.path.glob("*.log"))
        return [self.path] if self.path.exists() else []

    def poll(self) -> list[Line]:
        now = time.time()
        out: list[Line] = []
        for f in self._files():
            try:
                with open(f, "rb") as fh:
                    fh.seek(self._offsets.get(f, 0))
                    data = fh.read()
            except OSError:
                continue
            if not data:
                continue
            self._offsets[f] = self._offsets.get(f, 0) + len(data)
            chunks = (self._partial.pop(f, b"") + data).split(b"\n")
            if chunks[-1]:
                self._partial[f] = chunks[-1]
            for raw in chunks[:-1]:
                m = LINE.match(raw.decode(errors="replace").strip())
                if m:
                    ret = float(m.group(4)) if m.group(4) != "nan" else math.nan
                    out.append(Line(now, int(m.group(1)), int(m.group(2)), int(m.group(3)), ret, float(m.group(5))))
        return out


def split_segments(lines: list[Line]) -> list[list[Line]]:
    """One segment per process lifetime of the group: the update counter starts again after a restart."""
    segs: list[list[Line]] = []
    for ln in lines:
        if not segs or ln.update <= segs[-1][-1].update:
            segs.append([])
        segs[-1].append(ln)
    return segs


# -- the baseline's passive recorder (what the probe reports to when DSec is off) ----------------------------
class Recorder:
    """Answers the probe's register / heartbeat / deregister with no directive, ever; keeps what it is told.

    The probe needs somewhere to beat for DSEC_CHAOS to run (memory growth and the windows' start/stop events are
    driven by its beats); this is that somewhere, with no judgment behind it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.workers: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        rec = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"{}")
                except ValueError:
                    body = {}
                status, answer = rec.handle(self.path.split("?", 1)[0], body if isinstance(body, dict) else {})
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a killed worker resets its connection: expected here

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="chaos-recorder", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        parts = path.strip("/").split("/")
        with self.lock:
            if parts == ["v1", "workers", "register"]:
                wid = f"w{len(self.workers) + 1}"
                self.workers[wid] = {"id": wid, "rank": int(body.get("rank") or 0), "pid": body.get("pid"),
                                     "registered_at": time.time(), "metrics": {}, "peak_memory_gb": 0.0}  # fmt: skip
                return 200, {"worker_id": wid, "worker_token": "recorder", "directive": None}
            if len(parts) == 4 and parts[:2] == ["v1", "workers"] and parts[2] in self.workers:
                w = self.workers[parts[2]]
                if parts[3] == "heartbeat":
                    metrics = body.get("metrics") or {}
                    if isinstance(metrics, dict):
                        w["metrics"] = metrics
                        mem = metrics.get("memory_used_gb")
                        if isinstance(mem, (int, float)):
                            w["peak_memory_gb"] = max(w["peak_memory_gb"], float(mem))
                    for ev in body.get("events") or []:
                        if isinstance(ev, dict):
                            self.events.append({**ev, "worker_id": w["id"]})
                    return 200, {"directive": None}
                if parts[3] == "deregister":
                    return 200, {}
        return 404, {"error": "not_found", "message": path}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


# -- a real control plane: `dsec serve` in its own process group ---------------------------------------------
class ControlPlane:
    def __init__(self, home: Path, log_path: Path, startup_timeout_s: float = 60.0, host: str = "127.0.0.1") -> None:
        from dsec.control.server import free_port

        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
        env["DSEC_ADMIN_TOKEN"] = ADMIN
        cmd = [str(DSEC), "serve", "--host", host, "--port", str(self.port), "--home", str(home),
               "--log-level", "warning"]  # fmt: skip
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.proc is not None
        wait_healthy(self.proc, self.url, timeout_s, "dsec serve", lambda: f": {tail(self.log_path)}", poll_s=0.1)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, signal.SIGINT, grace_s=15.0)


def stop_group(proc: subprocess.Popen[bytes], sig: signal.Signals, grace_s: float) -> None:
    """Signal a child started with ``start_new_session`` and its process group; SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


# -- the two runs ----------------------------------------------------------------------------------------------
def script_args(seed: int, num_steps: int) -> list[str]:
    return [
        str(EXAMPLE), "--seed", str(seed), "--num-envs", str(NUM_ENVS), "--num-steps", str(num_steps),
        "--update-epochs", str(UPDATE_EPOCHS), "--num-minibatches", str(MINIBATCHES), "--log-every", "1",
        "--target-return", "1e9", "--total-steps", "1000000000", "--max-seconds", "86400",
    ]  # fmt: skip


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    return env


class BaselineRun:
    """torchrun with --max-restarts: a dead rank restarts the whole group from scratch. No DSec decisions."""

    name = "baseline"

    def __init__(self, work: Path, sched: Schedule, args: argparse.Namespace) -> None:
        from dsec.probe.launch import probe_env

        self.recorder = Recorder()
        self.log_path = work / "torchrun.log"
        self.tail = LogTail(self.log_path)
        self.seen_pids: set[int] = set()
        env = probe_env(
            base_env(),
            {
                "DSEC_ENDPOINT": self.recorder.url,
                "DSEC_SANDBOX_ID": POOL,
                "DSEC_ROLE": "learner",
                "DSEC_GROUP": GROUP,
                "DSEC_HEARTBEAT_INTERVAL": str(args.beat),
                "DSEC_CHAOS": sched.chaos,
            },
        )
        # torch 2.13's torchrun shares its rendezvous TCPStore with the workers and does not prefix it per restart:
        # a restarted gloo group reads the dead group's addresses and hangs or fails in init_process_group (seen
        # here). With a store of their own per attempt, restarts work.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(WORLD), "--max-restarts", "3", "--monitor-interval", "0.1",
               *script_args(args.seed, args.num_steps)]  # fmt: skip
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def rank_pids(self) -> dict[int, int]:
        return {} if self.proc is None else self._scan(self.proc)

    def _scan(self, agent: subprocess.Popen[bytes]) -> dict[int, int]:
        """The agent's workers by rank (read from their environment); every worker seen is remembered."""
        import psutil

        try:
            kids = psutil.Process(agent.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return {}
        out: dict[int, int] = {}
        for p in kids:
            try:
                rank = p.environ().get("RANK", "")
                cmdline = p.cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if rank.isdigit() and str(EXAMPLE) in cmdline:
                out[int(rank)] = p.pid
                self.seen_pids.add(p.pid)
        return out

    def step(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"torchrun exited with {self.proc.returncode}: {tail(self.log_path)}")
        self.rank_pids()  # remember every worker, to stop them all at the end

    def observe(self) -> None:
        pass  # the recorder keeps peaks itself

    def report(self) -> dict[str, Any]:
        with self.recorder.lock:
            workers = [dict(w) for w in self.recorder.workers.values()]
            events = list(self.recorder.events)
        rank0 = [w for w in workers if w["rank"] == 0]
        return {
            "restarts_by_launcher": max(0, len(rank0) - 1),
            "directives_issued": 0,  # the recorder never answers with one
            "faults_seen": faults_seen(events, {w["id"]: w["rank"] for w in workers}),
            "peak_memory_gb_by_rank": peak_by_rank(workers),
            "probe_counters_rank0": probe_counters(rank0),
        }

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            # Freeze the agent so it cannot start new workers, kill every worker it has, then the agent.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGSTOP)
            self._scan(proc)
            for pid in self.seen_pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # each worker leads its own session (torchrun's Popen)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            stop_group(proc, signal.SIGKILL, grace_s=0.0)
        self.recorder.close()


class DsecRun:
    """`dsec serve` + the supervisor (local launcher) with snapshots; the breaker on (the control plane's default)."""

    name = "dsec"

    def __init__(self, work: Path, sched: Schedule, args: argparse.Namespace) -> None:
        from dsec.client import Client
        from dsec.launch.jobfile import JobFile
        from dsec.launch.local import LocalLauncher
        from dsec.launch.supervisor import Supervisor

        self.server: ControlPlane | None = ControlPlane(work / "cp", work / "dsec-serve.log")
        self.client = Client(self.server.url, token=ADMIN, timeout=30.0)
        self.peak_memory: dict[str, float] = {}
        self.sup: Supervisor | None = None
        try:
            devices = [f"gpu-{i}" for i in range(WORLD)]
            for d in devices:
                self.client.request("PUT", f"/v1/devices/{d}",
                                    json={"id": d, "node": "node-0", "model": "sim", "memory_gb": 16})  # fmt: skip
            self.client.put_pool(POOL, devices=devices)
            token = self.client.create_token(POOL)
            job = JobFile.model_validate(
                {
                    "job": "ppo-chaos",
                    "pool": POOL,
                    "snapshots": {"dir": str(work / "snapshots"), "interval_s": args.snapshot_interval},
                    "restart": {"max_restarts": 3, "resume_timeout_s": 120},
                    "groups": [
                        {
                            "name": GROUP,
                            "role": "learner",
                            "world_size": WORLD,
                            "memory_gb": 4,
                            "env": {"DSEC_HEARTBEAT_INTERVAL": str(args.beat), "DSEC_CHAOS": sched.chaos,
                                    "PYTHONUNBUFFERED": "1"},
                            "command": [sys.executable, *script_args(args.seed, args.num_steps)],
                        }
                    ],
                }
            )  # fmt: skip
            self.launcher = LocalLauncher(base_env=base_env(), log_dir=work / "logs", warm=args.warm)
            self.tail = LogTail(work / "logs")
            self.sup = Supervisor(job, self.launcher, client=self.client, endpoint=self.server.url,
                                  pool_token=token, poll_s=0.1)  # fmt: skip
            self.sup.start()
        except BaseException:
            self.stop()
            raise

    def rank_pids(self) -> dict[int, int]:
        return {int(n.rsplit("-", 1)[1]): pid for n, pid in self.launcher.pids(GROUP).items()}

    def step(self) -> None:
        assert self.sup is not None
        self.sup.step()
        if self.sup.failed:
            raise RuntimeError(f"the supervisor gave up: {self.sup.failed}")

    def observe(self) -> None:
        for w in self.client.workers(pool=POOL):
            mem = (w.get("metrics") or {}).get("memory_used_gb")
            if isinstance(mem, (int, float)):
                self.peak_memory[w["id"]] = max(self.peak_memory.get(w["id"], 0.0), float(mem))

    def report(self) -> dict[str, Any]:
        assert self.sup is not None
        self.observe()
        workers = self.client.workers(pool=POOL)
        events = self.client.all_events(pool=POOL)
        rank_of = {w["id"]: int(w["rank"]) for w in workers}
        for w in workers:
            w["peak_memory_gb"] = self.peak_memory.get(w["id"], 0.0)
        snaps = published_snapshots(events)
        restores = restore_records(events, rank_of, snaps)
        breaker = [e for e in events if e["type"] in ("meltdown", "breaker", "recovered")]
        levels = [int(e["data"].get("level_to") or 0) for e in breaker]
        meltdown_ranks = sorted(rank_of.get(e["worker_id"] or "", -1) for e in events if e["type"] == "meltdown")
        rank0 = [w for w in workers if int(w["rank"]) == 0]
        return {
            "restarts_by_launcher": sum(self.sup.restarts.values()),
            "recoveries": [r.timings() for r in self.sup.recoveries],
            "directives_issued": sum(1 for e in events if e["type"] == "directive_set"),
            "directives_acked": sum(1 for e in events if e["type"] == "directive_acked"),
            "meltdowns_by_rank": meltdown_ranks,
            "false_escalations": sum(1 for r in meltdown_ranks if r != STRAGGLER_RANK),
            "breaker_max_level": max(levels, default=0),
            "snapshots_ok": len(snaps),
            "restores": restores,
            "workers_report_device": any(w.get("device") for w in workers),
            "faults_seen": faults_seen(events, rank_of),
            "peak_memory_gb_by_rank": peak_by_rank(workers),
            "probe_counters_rank0": probe_counters(rank0),
        }

    def stop(self) -> None:
        sup, self.sup = self.sup, None
        try:
            if sup is not None:
                sup.stop()
        finally:
            self.client.close()
            server, self.server = self.server, None
            if server is not None:
                server.stop()


def faults_seen(events: list[dict[str, Any]], rank_of: dict[str, int]) -> dict[str, list[int]]:
    """Fault windows the probes announced (chaos ``start`` log events), as ranks per fault kind."""
    out: dict[str, list[int]] = {}
    for e in events:
        d = e.get("data") or {}
        if e.get("type") == "log" and d.get("chaos") == "start":
            kind = str(d.get("fault", "?")).split("=", 1)[0]
            out.setdefault(kind, []).append(rank_of.get(e.get("worker_id") or "", -1))
    return {k: sorted(v) for k, v in out.items()}


def peak_by_rank(workers: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in workers:
        r = str(w["rank"])
        out[r] = round(max(out.get(r, 0.0), float(w.get("peak_memory_gb") or 0.0)), 3)
    return dict(sorted(out.items()))


def probe_counters(rank0: list[dict[str, Any]]) -> dict[str, float]:
    """Rank 0's optimizer.step() calls the probe applied vs turned into accumulation, over all its processes
    (each process's last beat)."""
    applied = sum(float((w.get("metrics") or {}).get("updates_total") or 0.0) for w in rank0)
    skipped = sum(float((w.get("metrics") or {}).get("skipped_updates_total") or 0.0) for w in rank0)
    frac = applied / (applied + skipped) if applied + skipped else math.nan
    return {"applied": applied, "accumulated": skipped, "applied_fraction": round(frac, 4)}


# -- driving a run and accounting for it ------------------------------------------------------------------------
@dataclasses.dataclass
class Trace:
    lines: list[Line] = dataclasses.field(default_factory=list)
    t0: float | None = None
    kills: list[float] = dataclasses.field(default_factory=list)
    launched_at: float = 0.0
    end: float = 0.0


def published_snapshots(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The ``snapshot`` events of snapshots that were published, by snapshot id."""
    return {
        e["data"]["id"]: e
        for e in events
        if e["type"] == "snapshot" and e["data"].get("status") == "ok" and "id" in e["data"]
    }


def restore_records(
    events: list[dict[str, Any]], rank_of: dict[str, int], snaps: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each ``restore`` event, with its worker's rank and when the snapshot it restored was taken (its publication
    minus its total time; None when that snapshot's event is not in ``snaps``), as ``account`` reads them."""
    restores: list[dict[str, Any]] = []
    for e in events:
        if e["type"] != "restore":
            continue
        d = e["data"]
        snap = snaps.get(str(d.get("id")))
        taken = None if snap is None else float(snap["ts"]) - float(snap["data"].get("total_ms") or 0.0) / 1e3
        restores.append({"ts": float(e["ts"]), "worker_id": e["worker_id"], "rank": rank_of.get(e["worker_id"] or ""),
                         "status": d.get("status"), "id": d.get("id"), "step": d.get("step"),
                         "restore_s": d.get("restore_s"), "snapshot_taken_at": taken})  # fmt: skip
    return restores


def drive(run: BaselineRun | DsecRun, sched: Schedule, tr: Trace) -> Trace:
    tr.launched_at = time.time()
    last_observe = 0.0
    while True:
        now = time.time()
        tr.lines += run.tail.poll()
        if tr.t0 is None and tr.lines:
            tr.t0 = tr.lines[0].wall - tr.lines[0].t
            print(f"[{run.name}] training started {tr.t0 - tr.launched_at:.1f} s after launch", file=sys.stderr)
        if tr.t0 is None and now - tr.launched_at > START_TIMEOUT_S:
            raise TimeoutError(f"no progress line within {START_TIMEOUT_S:.0f} s of the launch")
        if tr.t0 is not None and not tr.kills and now >= tr.t0 + sched.crash_at_s:
            pid = run.rank_pids().get(CRASH_RANK)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                tr.kills.append(time.time())
                print(f"[{run.name}] SIGKILL rank {CRASH_RANK} (pid {pid}) at t={tr.kills[0] - tr.t0:.1f} s",
                      file=sys.stderr)  # fmt: skip
        if tr.t0 is not None and now >= tr.t0 + sched.duration_s:
            tr.end = tr.t0 + sched.duration_s
            return tr
        run.step()
        if now - last_observe >= 2.0:
            last_observe = now
            run.observe()
        time.sleep(0.1)


@dataclasses.dataclass(frozen=True)
class Progress:
    updates: int
    env_steps: int
    wall: float  # when this progress had been reached


def account(tr: Trace, sched: Schedule, report: dict[str, Any], num_steps: int) -> dict[str, Any]:
    assert tr.t0 is not None
    lines = [ln for ln in tr.lines if ln.wall <= tr.end]
    segs = split_segments(lines)
    if not segs:
        raise RuntimeError("no progress line inside the budget")
    starts = [s[0].wall - s[0].t for s in segs]
    restores = sorted((r for r in report.get("restores", []) if r["rank"] == 0 and r["status"] == "ok"),
                      key=lambda r: r["ts"])  # fmt: skip
    retained: list[Progress] = [Progress(0, 0, starts[0])]

    def effective(tau: float, upto: int) -> Progress:
        """Work (counted from the first start) the state of time ``tau`` embodies, in segments before ``upto``."""
        j = max((k for k in range(upto) if starts[k] <= tau), default=0)
        done = [ln for ln in segs[j] if ln.wall <= tau]
        if not done:
            return retained[j]
        return Progress(retained[j].updates + done[-1].update, retained[j].env_steps + done[-1].env_steps,
                        done[-1].wall)  # fmt: skip

    restarts: list[dict[str, Any]] = []
    for k in range(1, len(segs)):
        prev_end, first = segs[k - 1][-1].wall, segs[k][0].wall
        killed = [t for t in tr.kills if starts[k - 1] <= t <= first]
        kill = killed[0] if killed else prev_end  # a failure we did not cause: its last sign of life
        mine = [r for r in restores if prev_end - 1.0 <= r["ts"] <= first]
        taken = mine[-1]["snapshot_taken_at"] if mine else None
        kept = effective(taken, k) if taken is not None else Progress(0, 0, starts[k - 1])
        retained.append(kept)
        restarts.append({
            "killed_by_benchmark": bool(killed),
            "at_s": round(kill - tr.t0, 2),
            "downtime_s": round(starts[k] - kill, 2),
            "lost_work_s": round(kill - kept.wall, 2),
            "time_lost_s": round(starts[k] - kept.wall, 2),
            "resumed_from_update": kept.updates,
            "snapshot_taken_at_s": None if taken is None else round(taken - tr.t0, 2),
            "work_at_crash_updates": effective(kill, k).updates,
        })  # fmt: skip
    restored = [{"rank": r["rank"], "id": r["id"], "step": r["step"], "restore_s": r["restore_s"],
                 "at_s": round(r["ts"] - tr.t0, 2), "snapshot_taken_at_s": None if r["snapshot_taken_at"] is None
                 else round(r["snapshot_taken_at"] - tr.t0, 2)}
                for r in sorted(report.get("restores", []), key=lambda r: (r["ts"], r["rank"] or 0))]  # fmt: skip
    if restored:
        report = {**report, "restores": restored}
        # Each rank restores its own newest snapshot; DDP does not re-broadcast weights after that.
        report["restore_steps_agree"] = len({r["step"] for r in restored if r["step"] is not None}) <= 1
    last = segs[-1][-1]
    updates = retained[-1].updates + last.update
    env_steps = retained[-1].env_steps + last.env_steps
    done_updates = sum(s[-1].update for s in segs)
    pre = [ln for ln in segs[0] if not tr.kills or ln.wall <= tr.kills[0]]
    pre_s = (min(tr.kills[0], tr.end) if tr.kills else tr.end) - starts[0]
    returns = [ln.avg_return for ln in lines if math.isfinite(ln.avg_return)]
    counters = report.get("probe_counters_rank0", {})
    frac = counters.get("applied_fraction", math.nan)
    d = sched.duration_s
    out = {
        "env_steps": env_steps,
        "env_steps_per_s": round(env_steps / d, 2),
        "optimizer_steps": updates * OPT_STEPS_PER_UPDATE,
        "optimizer_steps_per_s": round(updates * OPT_STEPS_PER_UPDATE / d, 3),
        "applied_updates_per_s": round(updates * OPT_STEPS_PER_UPDATE * frac / d, 3) if math.isfinite(frac) else None,
        "ppo_updates": updates,
        "work_done_updates": done_updates,
        "work_lost_updates": done_updates - updates,
        "pre_crash_optimizer_steps_per_s": round(pre[-1].update * OPT_STEPS_PER_UPDATE / pre_s, 3) if pre else 0.0,
        "last_segment_optimizer_steps_per_s": round(last.update * OPT_STEPS_PER_UPDATE / (tr.end - starts[-1]), 3),
        "best_avg_return": round(max(returns), 2) if returns else None,
        "last_avg_return": round(last.avg_return, 2) if math.isfinite(last.avg_return) else None,
        "restarts": len(segs) - 1,
        "recovery": restarts,
        "time_lost_to_recovery_s": round(sum(r["time_lost_s"] for r in restarts), 2),
        "startup_s": round(tr.t0 - tr.launched_at, 2),
        "env_steps_per_update": num_steps * NUM_ENVS * WORLD,
        "optimizer_steps_per_update": OPT_STEPS_PER_UPDATE,
    }
    return {**out, **report}


def run_one(kind: str, work: Path, sched: Schedule, args: argparse.Namespace) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    print(f"[{kind}] starting ({args.duration:g} s budget)", file=sys.stderr)
    run: BaselineRun | DsecRun = BaselineRun(work, sched, args) if kind == "baseline" else DsecRun(work, sched, args)
    tr = Trace()
    try:
        tr = drive(run, sched, tr)
        report = run.report()
    finally:
        run.stop()
        if args.workdir is not None:  # keep the stamped progress lines next to the logs
            with open(work / "progress.jsonl", "w") as f:
                f.writelines(json.dumps(dataclasses.asdict(ln)) + "\n" for ln in tr.lines)
    return account(tr, sched, report, args.num_steps)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return None
    return round(a / b, 4)


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        ("optimizer steps/s (retained)", "optimizer_steps_per_s"),
        ("  applied as updates/s", "applied_updates_per_s"),
        ("env steps/s (retained)", "env_steps_per_s"),
        ("PPO updates retained / done", None),
        ("opt steps/s before the crash", "pre_crash_optimizer_steps_per_s"),
        ("opt steps/s, last segment", "last_segment_optimizer_steps_per_s"),
        ("best / last avg return", None),
        ("restarts", "restarts"),
        ("time lost to recovery (s)", "time_lost_to_recovery_s"),
    ]
    names = list(results)
    out = [f"{'':34s}" + "".join(f"{n:>22s}" for n in names)]
    for label, key in rows:
        cells = []
        for n in names:
            r = results[n]
            if "error" in r:
                cells.append("error")
            elif label.startswith("PPO updates"):
                cells.append(f"{r['ppo_updates']} / {r['work_done_updates']}")
            elif label.startswith("best"):
                cells.append(f"{r['best_avg_return']} / {r['last_avg_return']}")
            else:
                assert key is not None
                cells.append(str(r.get(key)))
        out.append(f"{label:34s}" + "".join(f"{c:>22s}" for c in cells))
    for n in names:
        for rec in results[n].get("recovery", []):
            out.append(f"{n}: restart at {rec['at_s']} s: downtime {rec['downtime_s']} s, lost work "
                       f"{rec['lost_work_s']} s, resumed from update {rec['resumed_from_update']} "
                       f"(of {rec['work_at_crash_updates']})")  # fmt: skip
    return "\n".join(out)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--scenario"] and argv[1:2] == ["bandwidth"]:
        # A real rate-limited link between ranks (network namespaces + tbf): its own options, see its docstring.
        from chaos_bandwidth import main as bandwidth

        return bandwidth(argv[2:])
    if argv[:1] == ["--scenario"] and argv[1:2] == ["memory"]:
        # Memory quotas on real processes sharing a (stand-in) card: its own options, see chaos_memory.py.
        from chaos_memory import main as memory

        return memory(argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=("faults", "bandwidth", "memory"), default="faults",
                    help="faults (this docstring), bandwidth (chaos_bandwidth.py) or memory (chaos_memory.py); "
                         "give it first")  # fmt: skip
    ap.add_argument("--duration", type=float, default=75.0, help="training seconds per run (from training start)")
    ap.add_argument("--seed", type=int, default=1, help="the example's seed and the straggler delays' draw")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (--duration 30)")
    ap.add_argument("--num-steps", type=int, default=32, help="rollout length per env (example's --num-steps)")
    ap.add_argument("--beat", type=float, default=0.5, help="probe heartbeat interval (s), both runs")
    ap.add_argument("--snapshot-interval", type=float, default=5.0, help="DSec snapshot period (s), >= 1")
    ap.add_argument("--warm", action="store_true", help="DSec: warm standby processes for faster restarts")
    ap.add_argument("--only", choices=("baseline", "dsec"), default=None, help="run one side only")
    ap.add_argument("--workdir", type=Path, default=None, help="keep logs and snapshots here (default: temporary)")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration = min(args.duration, 30.0)
    if args.duration < 20:
        ap.error("--duration must be at least 20 s")
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    sched = make_schedule(args.duration, args.seed)
    print(f"fault schedule: DSEC_CHAOS={sched.chaos!r}; SIGKILL rank {CRASH_RANK} at {sched.crash_at_s:.1f} s",
          file=sys.stderr)  # fmt: skip
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dsec-chaos-real-"))
    t_start = time.time()
    results: dict[str, dict[str, Any]] = {}
    interrupted = False
    try:
        for kind in ("baseline", "dsec"):
            if args.only and kind != args.only:
                continue
            try:
                results[kind] = run_one(kind, work / kind, sched, args)
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: run_one has stopped everything it started
                results[kind] = {"error": "interrupted"}
                interrupted = True
                break
            except Exception as exc:
                results[kind] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"[{kind}] failed: {results[kind]['error']}", file=sys.stderr)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    base, dsec = results.get("baseline", {}), results.get("dsec", {})
    print(table(results), file=sys.stderr)
    summary = {
        "goodput_ratio": ratio(dsec.get("optimizer_steps_per_s"), base.get("optimizer_steps_per_s")),
        "env_steps_ratio": ratio(dsec.get("env_steps_per_s"), base.get("env_steps_per_s")),
        "applied_updates_ratio": ratio(dsec.get("applied_updates_per_s"), base.get("applied_updates_per_s")),
        "pre_crash_ratio": ratio(
            dsec.get("pre_crash_optimizer_steps_per_s"), base.get("pre_crash_optimizer_steps_per_s")
        ),
        "duration_s": args.duration,
        "seed": args.seed,
        "world_size": WORLD,
        "num_steps": args.num_steps,
        "warm_standby": args.warm,
        "schedule": sched.to_dict(),
        "baseline": base,
        "dsec": dsec,
        "wall_s": round(time.time() - t_start, 1),
    }
    failed = [k for k, r in results.items() if "error" in r]
    if failed:
        summary["error"] = "; ".join(f"{k}: {results[k]['error']}" for k in failed)
    print(json.dumps(summary))
    return 130 if interrupted else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
