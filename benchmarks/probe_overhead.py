"""Probe overhead resolved to 0.1%: paired blocks of training steps in ONE process, the probe's hooks active vs
bypassed, interleaved; then the time inside each of the probe's components per step.

One process holds a one-rank gloo group and two copies of the same RL workload — a DDP actor-critic MLP with Adam
and gradient clipping, trained on the rollouts of a gymnasium CartPole vector env (per step: ``--env-steps``
vector-env steps with a policy forward, then one minibatch update). Copy B is built before the probe is
installed (no comm hook, no optimizer gating, no env monitor); copy A after (the probe's DDP comm hook with its
sync header, optimizer hooks, env monitor, registration with a control plane in a subprocess and a reporter
thread). Blocks of ``--steps`` steps alternate in random order within each pair;
before an A block the probe's global patches (collectives, optimizer step hooks, clip_grad_norm_, backward) are
installed, before a B block they are removed, so B runs the plain torch path.

overhead_ratio = mean over pairs of (cpu_A - cpu_B) / mean cpu_B, where cpu is the block's *process CPU time*
(every thread of this process: the comm hook's callbacks run on gloo's), plus the reporter thread's CPU time per
step / the plain step's CPU time (the thread runs during both kinds of block, so the pairs cancel it; it is added as
if every microsecond of it took the GIL from training). CPU time leaves out the time the shared machine's other
processes held the CPU, the largest noise of wall-time pairs; what it cannot see is overhead that is waiting
(a hook that makes training sleep), so the same figures from wall time are reported too (``overhead_ratio_wall``,
``overhead_ci95_wall``). CIs: normal approximation over the pairs; outlier pairs — |d| beyond 6 MADs — are dropped
and counted.

``overhead_instrumented`` (+ ``_ci95``): a second, finer figure from a separate attribution pass — per block of
``--steps`` steps, the CPU time spent inside the probe's hooks (thread_time_ns wrappers) over the block's process
CPU time, plus the reporter share; CI over the blocks. The wrappers' own cost (thread_time_ns is ~1 µs here) is
subtracted (``timer_bias_ns``: [one timed call, the env monitor's outer-minus-inner]) as measured in place: in the
workload a timer costs several times what a tight loop of no-ops calibrates (``timer_bias_tight_loop_ns``; caches
are cold after the policy's forward pass), so attribution blocks alternate with blocks where the monitor's step is
a bare pass-through under the same two timers, followed by one timed no-op.
It is a lower bound: it leaves out what the hooks cost outside their own Python (DDP calling a Python hook instead
of its C++ one, the futures' machinery, the patched functions' dispatch).

Per component (microseconds of CPU per step, same pass; wall-clock figures in ``components_wall_us``):
``comm_hook`` (the probe's Python around each DDP bucket: cycle bookkeeping, header encode/decode on the steps
that carry it, launching the collective, copy-back and the norm), ``optimizer_hook`` (step pre/post hooks and the
accumulation gate), ``env_hook`` (the episode monitor around the env's step), ``reporter_thread`` (its CPU time
per beat, ``beat_cpu_us``, measured while beating every ``--heartbeat`` s, times the beats per step at
``--share-interval`` s, by default the probe's default interval of 5 s).

Last stdout line: one JSON object {"overhead_ratio", "overhead_ci95", "overhead_instrumented", "components_us",
"step_us", ...}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

_SERVER = r"""
import sys, time
from pathlib import Path
from dsec.client import Client
from dsec.control.app import create_app
from dsec.control.server import ServerThread
from dsec.control.settings import Settings
home = Path(sys.argv[1]); cluster = sys.argv[2]
settings = Settings.from_env(home=home, admin_token="bench-admin-token", cluster_file=Path(cluster))
with ServerThread(create_app(settings)) as server, Client(server.url, token="bench-admin-token") as admin:
    print(server.url, admin.create_token("pool-0"), flush=True)
    sys.stdin.read()
"""


FRAMES_ENV = "DsecBench/Frames-v0"


def _register_frames_env(gym: Any) -> None:
    """A pixel environment for the ``cnn`` workload: 4 stacked 84x84 uint8 frames per observation (the Atari
    preprocessing IMPALA/PPO learners train on), random frames, episodes of 50-500 steps. Stands in for an emulator
    (none is installed here): the learner's side — the network, the batch, the probe's hooks — is what is measured."""
    import numpy as np

    class Frames(gym.Env):
        observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        action_space = gym.spaces.Discrete(6)

        def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[Any, dict[str, Any]]:
            super().reset(seed=seed)
            self._left = int(self.np_random.integers(50, 500))
            return self.np_random.integers(0, 256, (4, 84, 84), dtype=np.uint8), {}

        def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
            self._left -= 1
            frame = self.np_random.integers(0, 256, (4, 84, 84), dtype=np.uint8)
            return frame, float(self.np_random.random()), self._left <= 0, False, {}

    if FRAMES_ENV not in gym.registry:
        gym.register(FRAMES_ENV, entry_point=Frames)


def _network(workload: str) -> tuple[Any, str, int]:
    """(actor-critic network, env id, envs per vector env) of a workload: ``mlp`` a 4-64-64-3 MLP on CartPole (a
    deliberately tiny step: the probe's fixed cost per step at its largest share); ``cnn`` the Nature-CNN encoder
    (3 conv layers, 512 units) with policy and value heads on 84x84x4 frames, as an Atari PPO/IMPALA learner."""
    from torch import nn

    if workload == "mlp":
        net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
        return net, "CartPole-v1", 4
    net = nn.Sequential(
        nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, 3),
    )  # fmt: skip
    return net, FRAMES_ENV, 8


class Workload:
    """One copy of the RL workload (built under whatever instrumentation is installed at the time)."""

    def __init__(self, torch: Any, gym: Any, env_steps: int, seed: int = 0, workload: str = "mlp") -> None:
        self.torch = torch
        torch.manual_seed(seed)
        net, env_id, num_envs = _network(workload)
        self.model = torch.nn.parallel.DistributedDataParallel(net)
        self.net = net
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4, eps=1e-5)
        self.envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync")
        self.pixels = workload == "cnn"
        obs, _ = self.envs.reset(seed=seed)
        self.obs = self._tensor(obs)
        self.env_steps = env_steps
        self.gen = torch.Generator().manual_seed(seed)

    def _tensor(self, obs: Any) -> Any:
        x = self.torch.as_tensor(obs, dtype=self.torch.float32)
        return x / 255.0 if self.pixels else x

    def step(self) -> None:
        torch = self.torch
        batch = []
        with torch.no_grad():
            for _ in range(self.env_steps):
                out = self.net(self.obs)
                action = torch.multinomial(torch.softmax(out[:, :2], -1), 1, generator=self.gen).squeeze(-1)
                obs, _, _, _, _ = self.envs.step(action.numpy())
                batch.append(self.obs)
                self.obs = self._tensor(obs)
        x = torch.cat(batch)
        out = self.model(x)
        loss = out[:, 2].pow(2).mean() - torch.log_softmax(out[:, :2], -1).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
        self.opt.step()


def _block(w: Workload, steps: int) -> tuple[float, float]:
    """(wall µs, process CPU µs) of ``steps`` training steps. Process CPU time counts every thread of this process
    (the comm hook's callbacks run on gloo's thread) and none of the time the shared machine's other processes held
    the CPU — the noise that wall time pairs cannot average away at 0.1%."""
    c0, t0 = time.process_time_ns(), time.perf_counter_ns()
    for _ in range(steps):
        w.step()
    return (time.perf_counter_ns() - t0) / 1e3, (time.process_time_ns() - c0) / 1e3


class Timer:
    """Time inside wrapped functions, wall (perf_counter_ns) and the calling thread's CPU (thread_time_ns); nested
    calls on one thread (a completion callback that runs inside the call that launched the collective) count once.
    Calls on different threads (the comm hook's callbacks run on gloo's) are counted separately."""

    def __init__(self) -> None:
        self.ns = 0
        self.cpu_ns = 0
        self.calls = 0  # counted (outermost) calls
        self._local = threading.local()

    def wrap(self, fn: Any) -> Any:
        local = self._local

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            depth = getattr(local, "depth", 0)
            local.depth = depth + 1
            if depth:
                try:
                    return fn(*a, **k)
                finally:
                    local.depth = depth
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                local.depth = depth
                self.ns += time.perf_counter_ns() - t0
                self.cpu_ns += time.thread_time_ns() - c0
                self.calls += 1

        return timed


def _calibrate(calls: int = 20_000) -> tuple[float, float]:
    """What the Timer itself adds, in CPU ns per counted call: (one wrapped call, the outer-minus-inner of a wrapped
    call around a wrapped call: the env monitor's measurement) — measured on functions that do nothing, and
    subtracted from the components (thread_time_ns costs ~1 µs on this machine, which the hooks would otherwise be
    charged for)."""
    one, outer, inner = Timer(), Timer(), Timer()
    noop = one.wrap(lambda: None)
    nested = outer.wrap(inner.wrap(lambda: None))
    for _ in range(calls):
        noop()
        nested()
    return one.cpu_ns / calls, (outer.cpu_ns - inner.cpu_ns) / calls


def _paired(a: list[float], b: list[float], steps: int) -> tuple[float, float, int, float]:
    """(mean paired difference / mean B, its 95% half-width, pairs dropped as outliers, mean B per step): pairs
    whose difference lies beyond 6 MADs (the shared machine's hiccups) are dropped and counted."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    med = statistics.median(d)
    mad = statistics.median(abs(x - med) for x in d) or 1e-9
    kept = [x for x in d if abs(x - med) <= 6 * 1.4826 * mad]
    mean_b = statistics.mean(b)
    half = 1.96 * statistics.stdev(kept) / len(kept) ** 0.5 / mean_b
    return statistics.mean(kept) / mean_b, half, len(d) - len(kept), mean_b / steps


def _thread_cpu_s(thread: threading.Thread | None) -> float:
    if thread is None or thread.ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError):
        return 0.0


def main() -> int:
    from dsec.probe.sync_header import DEFAULT_EVERY as DEFAULT_HEADER_EVERY

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=400, help="paired blocks (A and B each)")
    ap.add_argument("--steps", type=int, default=8, help="training steps per block")
    ap.add_argument("--env-steps", type=int, default=16, help="vector-env steps per training step")
    ap.add_argument(
        "--heartbeat", type=float, default=1.0, help="the probe's heartbeat interval while measuring (s): often"
    )
    ap.add_argument(
        "--share-interval",
        type=float,
        default=5.0,
        help="the heartbeat interval the reporter's share is computed for (s; default: the probe's default)",
    )
    ap.add_argument("--attribution-steps", type=int, default=400)
    ap.add_argument(
        "--header-every",
        type=int,
        default=DEFAULT_HEADER_EVERY,
        help=f"the probe's DSEC_HEADER_EVERY (default {DEFAULT_HEADER_EVERY}: the product's default)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workload",
        choices=("mlp", "cnn"),
        default="mlp",
        help="mlp: a tiny CartPole MLP (a few ms per step); cnn: a Nature-CNN learner on 84x84x4 frames",
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)

    home = Path(tempfile.mkdtemp(prefix="dsec-bench-overhead-"))
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(home), str(REPO / "examples" / "cluster.yaml")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        url, token = server.stdout.readline().split()
        return _run(args, rng, url, token)
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def _run(args: argparse.Namespace, rng: random.Random, url: str, token: str) -> int:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import gymnasium as gym
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _register_frames_env(gym)
    plain = Workload(torch, gym, args.env_steps, workload=args.workload)  # built before the probe: the bypassed copy

    from dsec.probe.config import ProbeConfig
    from dsec.probe.runtime import Probe

    config = ProbeConfig.from_env(
        {
            "DSEC_ENDPOINT": url,
            "DSEC_SANDBOX_ID": "pool-0",
            "DSEC_TOKEN": token,
            "DSEC_ROLE": "learner",
            "DSEC_HEARTBEAT_INTERVAL": str(args.heartbeat),
            "DSEC_HEADER_EVERY": str(args.header_every),
        }
    )
    assert config is not None
    probe = Probe(config)
    probe._install_torch(torch)
    probe._install_gym(gym)
    inst = probe.torch
    probed = Workload(torch, gym, args.env_steps, workload=args.workload)  # comm hook, optimizer gating, env monitor
    probe.activity("benchmark")  # registers and starts the reporter thread

    def active(on: bool) -> None:
        if on and not inst._restore:
            inst.install(torch)
        elif not on and inst._restore:
            inst.uninstall()

    for _ in range(20):  # warm-up: both paths, first DDP step (hook installation), allocator
        active(True)
        probed.step()
        active(False)
        plain.step()

    rep = probe.reporter
    thread = getattr(rep, "_thread", None)
    cpu0, wall0 = _thread_cpu_s(thread), time.perf_counter()
    beats0 = rep.beats_ok if rep is not None else 0
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.pairs):
        order = [True, False]
        rng.shuffle(order)
        for on in order:
            active(on)
            w_us, c_us = _block(probed if on else plain, args.steps)
            wall[on].append(w_us)
            cpu[on].append(c_us)
    cpu_s, wall_s = _thread_cpu_s(thread) - cpu0, time.perf_counter() - wall0
    beats = (rep.beats_ok - beats0) if rep is not None else 0

    cpu_paired, cpu_half, cpu_dropped, cpu_step_us = _paired(cpu[True], cpu[False], args.steps)
    wall_paired, wall_half, wall_dropped, step_us = _paired(wall[True], wall[False], args.steps)
    # The reporter's cost is per beat, not per step: its CPU per beat (measured at --heartbeat, which beats often for a
    # sample) times the beats per step at --share-interval (the probe's default interval unless told otherwise).
    beat_cpu_us = cpu_s * 1e6 / max(beats, 1)
    reporter_us = beat_cpu_us * (step_us / 1e6) / args.share_interval
    reporter_share = reporter_us / cpu_step_us
    overhead = cpu_paired + reporter_share
    overhead_wall = wall_paired + reporter_us / step_us

    # Attribution pass: time inside each component's code (probe active throughout).
    active(True)
    comm, optim, env_outer, env_inner = Timer(), Timer(), Timer(), Timer()
    for coord in inst.coordinators:
        for name in ("_prelude", "_all_reduce", "_all_reduce_plain", "_exchange", "_headers_seen", "_finish"):
            if hasattr(coord, name):  # (_all_reduce_plain: since the header rides every Nth step only)
                setattr(coord, name, comm.wrap(getattr(coord, name)))
    inst.uninstall()
    for name in ("_pre_step", "_post_step", "accumulating"):
        setattr(inst, name, optim.wrap(getattr(inst, name)))
    inst.install(torch)
    monitor = probed.envs
    inner = monitor.env
    inner_step, monitor_step = inner.step, monitor.step
    # The env monitor is timed as outer (its step) minus inner (the env's step): the two timers' own cost lands in
    # that difference, and in the workload it is several times what a tight loop of no-ops calibrates (caches are
    # cold after the policy's forward pass: ~9 µs per vector step here against ~2). So blocks alternate with blocks
    # where the monitor's step is a bare pass-through under the same two timers, in the same place: their
    # outer-minus-inner per call is the timers' cost in situ, subtracted per env step.
    pass_outer, pass_inner = Timer(), Timer()
    # The backend's own launch of each bucket's collective (ProcessGroup.allreduce: gloo enqueues the work) is
    # work DDP's built-in hook does as well; timed on its own and taken out of the comm hook's figure
    # (``comm_backend_launch_us``). What the probe adds around it — torch's Python all_reduce wrapper, the header,
    # the future callback — stays in.
    launch = Timer()
    pg_cls = dist.ProcessGroup
    pg_allreduce = pg_cls.allreduce
    pg_cls.allreduce = launch.wrap(pg_allreduce)
    real = (env_inner.wrap(inner_step), env_outer.wrap(monitor_step))
    # The same holds for the single timer around each comm/optimizer hook call: a timed no-op after each env step
    # of the bare blocks (outside the monitor's timers) measures it in place too.
    one_timer = Timer()
    noop = one_timer.wrap(lambda: None)
    timed_bare = pass_outer.wrap(lambda actions: monitor.env.step(actions))

    def bare_step(actions: Any) -> Any:
        out = timed_bare(actions)
        noop()
        return out

    bare = (pass_inner.wrap(inner_step), bare_step)
    # Per block of --steps steps: the probe's CPU time inside its hooks against the block's process CPU time — an
    # instrumented lower bound of the overhead (it leaves out what the hooks cost outside their own Python: DDP calling
    # a Python hook, the futures' machinery, the wrappers' dispatch) with a CI from the blocks.
    timers = (comm, optim, env_outer)
    hook_cpu, step_cpu, env_calls, hook_calls = [], [], [], []
    # Totals over the measured (real) blocks only: [cpu ns, wall ns, counted calls] per timer.
    totals = {t: [0, 0, 0] for t in (comm, optim, env_outer, env_inner, launch)}
    for _ in range(args.attribution_steps // args.steps):
        for timed_inner, timed_monitor in (bare, real):
            inner.step, monitor.step = timed_inner, timed_monitor
            start = {t: (t.cpu_ns, t.ns, t.calls) for t in totals}
            c0 = time.process_time_ns()
            _block(probed, args.steps)
            if timed_monitor is bare[1]:
                continue
            step_cpu.append(time.process_time_ns() - c0)
            for t, (c, w, k) in start.items():
                totals[t][0] += t.cpu_ns - c
                totals[t][1] += t.ns - w
                totals[t][2] += t.calls - k
            inside = sum(t.cpu_ns - start[t][0] for t in timers)
            hook_cpu.append(inside - (env_inner.cpu_ns - start[env_inner][0]) - (launch.cpu_ns - start[launch][0]))
            env_calls.append(env_outer.calls - start[env_outer][2])
            # The launch timer's calls run inside the comm hook's: its own cost is the comm timer's to take out.
            hook_calls.append(sum(t.calls - start[t][2] for t in (comm, optim, launch)))
    inner.step, monitor.step = inner_step, monitor_step
    pg_cls.allreduce = pg_allreduce
    n = len(step_cpu) * args.steps
    bias_one_tight, bias_tight = _calibrate()
    bias_nested = (pass_outer.cpu_ns - pass_inner.cpu_ns) / max(pass_outer.calls, 1)  # in situ, per env step
    bias_one = one_timer.cpu_ns / max(one_timer.calls, 1)  # in situ, per timed call
    # Per block: each counted call of comm/optim carries bias_one, each env step bias_nested.
    hook_cpu = [h - kc * bias_one - ke * bias_nested for h, kc, ke in zip(hook_cpu, hook_calls, env_calls, strict=True)]
    ratios = [h / c for h, c in zip(hook_cpu, step_cpu, strict=True)]
    instrumented = statistics.mean(ratios) + reporter_us * 1e3 * args.steps / statistics.mean(step_cpu)
    inst_half = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5
    cpu_t = {t: v[0] for t, v in totals.items()}
    wall_t = {t: v[1] for t, v in totals.items()}
    calls_t = {t: v[2] for t, v in totals.items()}
    components = {
        "comm_hook": round((cpu_t[comm] - cpu_t[launch] - (calls_t[comm] + calls_t[launch]) * bias_one) / 1e3 / n, 2),
        "optimizer_hook": round((cpu_t[optim] - calls_t[optim] * bias_one) / 1e3 / n, 2),
        "env_hook": round((cpu_t[env_outer] - cpu_t[env_inner] - calls_t[env_outer] * bias_nested) / 1e3 / n, 2),
        "reporter_thread": round(reporter_us, 2),
    }
    components_wall = {
        "comm_hook": round((wall_t[comm] - wall_t[launch]) / 1e3 / n, 2),
        "optimizer_hook": round(wall_t[optim] / 1e3 / n, 2),
        "env_hook": round((wall_t[env_outer] - wall_t[env_inner]) / 1e3 / n, 2),
    }
    registered = bool(rep is not None and rep.registered)
    probe.close()
    inst.uninstall()
    dist.destroy_process_group()

    result = {
        "overhead_ratio": round(overhead, 5),
        "overhead_ci95": [round(overhead - cpu_half, 5), round(overhead + cpu_half, 5)],
        "ci_width": round(2 * cpu_half, 5),
        "paired_ratio": round(cpu_paired, 5),
        "reporter_share": round(reporter_share, 5),
        "overhead_ratio_wall": round(overhead_wall, 5),
        "overhead_ci95_wall": [round(overhead_wall - wall_half, 5), round(overhead_wall + wall_half, 5)],
        "overhead_instrumented": round(instrumented, 5),
        "overhead_instrumented_ci95": [round(instrumented - inst_half, 5), round(instrumented + inst_half, 5)],
        "components_us": components,
        "comm_backend_launch_us": round(cpu_t[launch] / 1e3 / n, 2),
        "components_wall_us": components_wall,
        "timer_bias_ns": [round(bias_one), round(bias_nested)],
        "timer_bias_tight_loop_ns": [round(bias_one_tight), round(bias_tight)],
        "beat_cpu_us": round(beat_cpu_us, 1),
        "beats_measured": beats,
        "share_interval_s": args.share_interval,
        "components_sum_ratio": round(sum(components.values()) / cpu_step_us, 5),
        "step_us": round(step_us, 1),
        "step_cpu_us": round(cpu_step_us, 1),
        "pairs": args.pairs,
        "pairs_dropped_as_outliers": cpu_dropped,
        "pairs_dropped_as_outliers_wall": wall_dropped,
        "steps_per_block": args.steps,
        "env_steps_per_step": args.env_steps,
        "workload": args.workload,
        "heartbeat_s": args.heartbeat,
        "header_every": args.header_every,
        "reporter_cpu_s": round(cpu_s, 4),
        "measured_wall_s": round(wall_s, 1),
        "registered": registered,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
