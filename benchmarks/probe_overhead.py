"""Probe overhead resolved to 0.1%: paired blocks of training steps in ONE process, the probe's hooks active vs
bypassed, interleaved; then the time inside each of the probe's components per step.

One process holds a one-rank gloo group and two copies of the same RL workload — a DDP actor-critic MLP with Adam
and gradient clipping, trained on the rollouts of a gymnasium CartPole vector env (per step: ``--env-steps``
vector-env steps with a policy forward, then one minibatch update). Copy B is built before the probe is
installed (no comm hook, no optimizer gating, no env monitor); copy A after (the probe's DDP comm hook with its
sync header, optimizer hooks, env monitor, registration with a control plane in a subprocess and a reporter
thread beating every ``--heartbeat`` s). Blocks of ``--steps`` steps alternate in random order within each pair;
before an A block the probe's global patches (collectives, optimizer step hooks, clip_grad_norm_, backward) are
installed, before a B block they are removed, so B runs the plain torch path.

overhead_ratio = mean over pairs of (t_A - t_B) / mean t_B, plus the reporter thread's CPU time per step / the
plain step time (the thread runs during both kinds of block, so the pairs cancel it; it is added as if every
microsecond of it took the GIL from training). overhead_ci95: a 95% interval for the paired part (normal
approximation over the pairs; outlier pairs — |d| beyond 6 MADs, the shared machine's hiccups — are dropped
and counted), shifted by the reporter share.

Per component (microseconds per step, from perf_counter_ns wrappers in a separate attribution pass; the
wrappers' own cost, ~0.2 µs per call, is included): ``comm_hook`` (the probe's Python around each DDP bucket:
cycle bookkeeping, header encode/decode, launching the collective, copy-back and the norm), ``optimizer_hook``
(step pre/post hooks and the accumulation gate), ``env_hook`` (the episode monitor around the env's step),
``reporter_thread`` (its CPU time per step).

Last stdout line: one JSON object {"overhead_ratio", "overhead_ci95", "components_us", "step_us", ...}.
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


class Workload:
    """One copy of the RL workload (built under whatever instrumentation is installed at the time)."""

    def __init__(self, torch: Any, gym: Any, env_steps: int, seed: int = 0) -> None:
        from torch import nn

        self.torch = torch
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
        self.model = nn.parallel.DistributedDataParallel(net)
        self.net = net
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4, eps=1e-5)
        self.envs = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync")
        obs, _ = self.envs.reset(seed=seed)
        self.obs = torch.as_tensor(obs, dtype=torch.float32)
        self.env_steps = env_steps
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        torch = self.torch
        batch = []
        with torch.no_grad():
            for _ in range(self.env_steps):
                out = self.net(self.obs)
                action = torch.multinomial(torch.softmax(out[:, :2], -1), 1, generator=self.gen).squeeze(-1)
                obs, _, _, _, _ = self.envs.step(action.numpy())
                batch.append(self.obs)
                self.obs = torch.as_tensor(obs, dtype=torch.float32)
        x = torch.cat(batch)
        out = self.model(x)
        loss = out[:, 2].pow(2).mean() - torch.log_softmax(out[:, :2], -1).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
        self.opt.step()


def _block(w: Workload, steps: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        w.step()
    return (time.perf_counter_ns() - t0) / 1e3  # µs


class Timer:
    """Time inside wrapped functions; nested calls of the same timer (a completion callback that runs inside the
    call that launched the collective) count once."""

    def __init__(self) -> None:
        self.ns = 0
        self._depth = 0

    def wrap(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            self._depth += 1
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.ns += time.perf_counter_ns() - t0

        return timed


def _thread_cpu_s(thread: threading.Thread | None) -> float:
    if thread is None or thread.ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError):
        return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=400, help="paired blocks (A and B each)")
    ap.add_argument("--steps", type=int, default=8, help="training steps per block")
    ap.add_argument("--env-steps", type=int, default=16, help="vector-env steps per training step")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="the probe's heartbeat interval (s)")
    ap.add_argument("--attribution-steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
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
    plain = Workload(torch, gym, args.env_steps)  # built before the probe: the bypassed copy

    from dsec.probe.config import ProbeConfig
    from dsec.probe.runtime import Probe

    config = ProbeConfig.from_env(
        {
            "DSEC_ENDPOINT": url,
            "DSEC_SANDBOX_ID": "pool-0",
            "DSEC_TOKEN": token,
            "DSEC_ROLE": "learner",
            "DSEC_HEARTBEAT_INTERVAL": str(args.heartbeat),
        }
    )
    assert config is not None
    probe = Probe(config)
    probe._install_torch(torch)
    probe._install_gym(gym)
    inst = probe.torch
    probed = Workload(torch, gym, args.env_steps)  # the probe's comm hook, optimizer gating, env monitor
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
    a_us, b_us = [], []
    for _ in range(args.pairs):
        order = [True, False]
        rng.shuffle(order)
        t: dict[bool, float] = {}
        for on in order:
            active(on)
            t[on] = _block(probed if on else plain, args.steps)
        a_us.append(t[True])
        b_us.append(t[False])
    cpu_s, wall_s = _thread_cpu_s(thread) - cpu0, time.perf_counter() - wall0
    steps_total = 2 * args.pairs * args.steps
    beats = rep.beats_sent if rep is not None and hasattr(rep, "beats_sent") else None

    # Paired differences, robust to the shared machine's hiccups.
    d = [a - b for a, b in zip(a_us, b_us, strict=True)]
    med = statistics.median(d)
    mad = statistics.median(abs(x - med) for x in d) or 1e-9
    kept = [x for x in d if abs(x - med) <= 6 * 1.4826 * mad]
    mean_b = statistics.mean(b_us)
    paired = statistics.mean(kept) / mean_b
    half = 1.96 * statistics.stdev(kept) / len(kept) ** 0.5 / mean_b
    step_us = mean_b / args.steps
    reporter_us = cpu_s * 1e6 / steps_total
    reporter_share = reporter_us / step_us
    overhead = paired + reporter_share

    # Attribution pass: time inside each component's code (probe active throughout).
    active(True)
    comm, optim, env_outer, env_inner = Timer(), Timer(), Timer(), Timer()
    for coord in inst.coordinators:
        for name in ("_prelude", "_all_reduce", "_exchange", "_headers_seen", "_finish"):
            setattr(coord, name, comm.wrap(getattr(coord, name)))
    inst.uninstall()
    for name in ("_pre_step", "_post_step", "accumulating"):
        setattr(inst, name, optim.wrap(getattr(inst, name)))
    inst.install(torch)
    monitor = probed.envs
    inner = monitor.env
    inner.step = env_inner.wrap(inner.step)
    monitor.step = env_outer.wrap(monitor.step)
    for _ in range(args.attribution_steps):
        probed.step()
    n = args.attribution_steps
    components = {
        "comm_hook": round(comm.ns / 1e3 / n, 2),
        "optimizer_hook": round(optim.ns / 1e3 / n, 2),
        "env_hook": round((env_outer.ns - env_inner.ns) / 1e3 / n, 2),
        "reporter_thread": round(reporter_us, 2),
    }
    registered = bool(rep is not None and rep.registered)
    probe.close()
    inst.uninstall()
    dist.destroy_process_group()

    result = {
        "overhead_ratio": round(overhead, 5),
        "overhead_ci95": [round(overhead - half, 5), round(overhead + half, 5)],
        "ci_width": round(2 * half, 5),
        "paired_ratio": round(paired, 5),
        "reporter_share": round(reporter_share, 5),
        "components_us": components,
        "components_sum_ratio": round(sum(components.values()) / step_us, 5),
        "step_us": round(step_us, 1),
        "pairs": args.pairs,
        "pairs_dropped_as_outliers": len(d) - len(kept),
        "steps_per_block": args.steps,
        "env_steps_per_step": args.env_steps,
        "heartbeat_s": args.heartbeat,
        "reporter_cpu_s": round(cpu_s, 4),
        "measured_wall_s": round(wall_s, 1),
        "registered": registered,
        "beats": beats,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
