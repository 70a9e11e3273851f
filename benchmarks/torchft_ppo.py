"""TorchFT baseline for the kill-and-recover benchmark: the 4-rank CPU PPO job, one replica SIGKILLed, repeatedly.

The job is ``examples/ppo_cartpole_ddp.py`` (imported, not copied: its ``Agent``, argument defaults and seeds; the
rollout, GAE and loss follow its code line for line): Adam(lr=1e-3, eps=1e-5), ``clip_grad_norm_(0.5)``, 4 envs x
128 steps per rank, 8 epochs x 4 minibatches, and a statistics all-reduce per update. Here every rank is its own
TorchFT replica group (replica_id ``ppo_<rank>``, group world size 1):

* ``torchft.Manager`` over ``torchft.ProcessGroupGloo`` (reconfigured on every quorum change; a dead peer shows up
  at once as a gloo "Connection reset/closed by peer" error, so the subprocess-based ProcessGroupBabyGloo, which
  exists to make aborting a hung collective possible, would only add 4 more processes on a 2-core machine);
* ``torchft.DistributedDataParallel``: gradients go through ``Manager.allreduce`` in DDP's comm hook. The stock hook
  of torchft 0.2.0 kills the *surviving* replicas when a peer dies mid-all-reduce (``AssertionError`` at
  ``assert fut._fut``, see ``_ft_ddp``), so by default its one-line fix is used; ``--stock-ddp-hook`` shows the crash;
* ``torchft.Optimizer``: quorum on ``zero_grad``, ``should_commit`` vote on ``step``;
* model + Adam state as the state dict a replacement heals from, over TorchFT's default HTTP checkpoint transport,
  served by a live peer; ``init_sync=False`` because every replica builds identical initial weights from the seed.

One TorchFT step is one PPO minibatch step. An update ends at the first committed step that is a multiple of 32
(epochs x minibatches), so a replica that joins mid-update falls in step with the others; lr is derived from the step
counter so every replica agrees. A replacement first takes one healing step on a dummy batch (TorchFT zeroes a
healing replica's gradient anyway), so its first rollout already runs the current policy.

The harness plays the per-replica-group supervisor (as torchrun per replica group would): it starts the lighthouse
(a subprocess on 127.0.0.1, ``min_replicas = world - 1``) and the replicas (``python benchmarks/torchft_ppo.py
--worker --replica R``), waits until all are past warm-up (3 PPO updates), and then ``--runs`` times: sleeps a random
fraction of one PPO update (so kills land in rollouts, minibatch steps and all-reduces alike), SIGKILLs one replica
(victims rotate 1, 2, 3, 0, ...), at once starts a replacement with the same replica id, waits until the replacement
has committed 5 steps and every replica is 5 steps past the replacement's first step, settles 2 s, repeats.

Measured from the per-process JSON-lines logs (``time.time()`` in every process; one line per committed step:
``{"event": "commit", "replica", "step", "t", "pid", "n": participants}``, plus start / ready / quorum / fail /
error / heal lines taken from TorchFT's own loggers):

* ``detect_s``: kill -> the first sign on any survivor: a failed collective (TorchFT logs the exception), a
  ``should_commit=False`` vote, or a quorum change.
* ``survivor_pause_s`` (per survivor): the longest gap between consecutive commits from its last commit before the
  kill up to its first commit in the first quorum formed after the kill (a survivor may still commit the step in
  flight, so the single gap spanning the kill can be short; the stall comes just after).
* ``replacement_rejoin_s``: kill -> the replacement's first committed step (the step it heals on), with a breakdown
  (``replacement_phases_s``: interpreter + torch/torchft import, gym, envs + torch._dynamo import, Manager + DDP
  init, quorum + heal + first commit).
* ``healthy_ranks_restarted``: survivors whose pid changed. ``steps_lost``: steps a survivor voted
  ``should_commit=False`` (its gradients thrown away) or redid. ``steps_degraded``: steps committed with fewer than
  ``world`` replicas contributing gradients, between the kill and the replacement's first step.
* ``replica_max_abs_diff``: max |parameter difference| across all replicas at the same TorchFT step, 5 steps after
  the replacement's first step (every replica dumps its flattened parameters for 10 commits after each quorum that
  has all replicas participating; ``diff_step_offsets`` says which step was used when that one is missing).

Last stdout line: one JSON object with p50/max summaries, ``runs``, ``world``, the TorchFT settings and the per-run
details (or ``{"error": ...}``); progress goes to stderr.

    python benchmarks/torchft_ppo.py [--runs 5] [--world 4] [--heartbeat-timeout-ms 5000] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import logging
import math
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from torchft import Manager

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "ppo_cartpole_ddp.py"

# TorchFT's own defaults (LighthouseServer / torchft_lighthouse CLI), kept unless a flag overrides them.
LH_JOIN_TIMEOUT_MS = 60_000
LH_HEARTBEAT_TIMEOUT_MS = 5_000
LH_QUORUM_TICK_MS = 100
# TorchFT's train_ddp.py example on CPU: ProcessGroupGloo(timeout=5 s), Manager(timeout=30 s). The Manager default
# quorum timeout (60 s) is kept.
GLOO_TIMEOUT_S = 5.0
MANAGER_TIMEOUT_S = 30.0
QUORUM_TIMEOUT_S = 60.0

WARMUP_UPDATES = 3
STEPS_AFTER_RECOVERY = 5
DUMP_STEPS = 10


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------------------
def _load_example() -> ModuleType:
    """Import examples/ppo_cartpole_ddp.py as a module (not a package member), so the job's code is reused."""
    spec = importlib.util.spec_from_file_location("ppo_cartpole_ddp", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _exit_with_parent(parent_pid: int) -> None:
    """Die when the harness does: a SIGKILLed harness must not leave replicas training forever."""
    if parent_pid <= 0:
        return

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class _EventLog:
    """JSON lines, each appended with one os.write, so the original and its replacement can share a file."""

    def __init__(self, path: Path, replica: int) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._replica = replica
        self._pid = os.getpid()

    def write(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "replica": self._replica, "t": time.time(), "pid": self._pid, **fields}
        os.write(self._fd, (json.dumps(rec) + "\n").encode())


# ---------------------------------------------------------------------------------------------------------------
# Lighthouse process
# ---------------------------------------------------------------------------------------------------------------
def _serve_lighthouse(a: argparse.Namespace) -> None:
    from torchft._torchft import LighthouseServer

    _exit_with_parent(a.parent_pid)
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=a.min_replicas,
        join_timeout_ms=a.join_timeout_ms,
        quorum_tick_ms=a.quorum_tick_ms,
        heartbeat_timeout_ms=a.heartbeat_timeout_ms,
    )
    # address() names the host by gethostname(); the replicas are told the loopback address instead.
    port = server.address().rsplit(":", 1)[1]
    print(f"http://127.0.0.1:{port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# Replica (worker) process
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Batch:
    obs: torch.Tensor
    act: torch.Tensor
    logp: torch.Tensor
    adv: torch.Tensor
    ret: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.obs.shape[0])


class _Rollout:
    """The example's rollout + GAE, per replica (same buffers, NEXT_STEP autoreset handling and statistics)."""

    def __init__(self, ex: argparse.Namespace, obs_dim: int, seed: int, world: int) -> None:
        import gymnasium as gym

        self.ex = ex
        self.n_envs, self.n_steps = ex.num_envs, ex.num_steps
        self.envs = gym.make_vec("CartPole-v1", num_envs=self.n_envs, vectorization_mode="sync")
        obs_np, _ = self.envs.reset(seed=seed * 100)
        self.obs = torch.as_tensor(obs_np, dtype=torch.float32)
        n_steps, n_envs = self.n_steps, self.n_envs
        self.obs_buf = torch.zeros(n_steps + 1, n_envs, obs_dim)
        self.act_buf = torch.zeros(n_steps, n_envs, dtype=torch.long)
        self.logp_buf = torch.zeros(n_steps, n_envs)
        self.val_buf = torch.zeros(n_steps + 1, n_envs)
        self.rew_buf = torch.zeros(n_steps, n_envs)
        self.term_buf = torch.zeros(n_steps, n_envs, dtype=torch.bool)
        self.done_buf = torch.zeros(n_steps, n_envs, dtype=torch.bool)
        self.valid_buf = torch.ones(n_steps, n_envs, dtype=torch.bool)
        self.recent: deque[float] = deque(maxlen=max(1, math.ceil(ex.window / world)))
        self.ep_ret = np.zeros(n_envs)
        self.prev_done = np.zeros(n_envs, dtype=bool)
        self.episodes = 0
        self.obs_dim = obs_dim

    @torch.no_grad()
    def collect(self, agent: nn.Module) -> _Batch:
        ex, n_steps, n_envs = self.ex, self.n_steps, self.n_envs
        obs = self.obs
        for t in range(n_steps):
            self.obs_buf[t] = obs
            self.valid_buf[t] = torch.from_numpy(~self.prev_done)
            logits, value = agent(obs)
            action = torch.distributions.Categorical(logits=logits).sample()
            self.act_buf[t] = action
            self.logp_buf[t] = torch.log_softmax(logits, -1).gather(-1, action[:, None]).squeeze(-1)
            self.val_buf[t] = value
            obs_np, reward, term, trunc, _ = self.envs.step(action.numpy())
            done = term | trunc
            self.rew_buf[t] = torch.as_tensor(reward, dtype=torch.float32)
            self.term_buf[t] = torch.from_numpy(term)
            self.done_buf[t] = torch.from_numpy(done)
            self.ep_ret += reward
            for i in np.flatnonzero(done):
                self.recent.append(float(self.ep_ret[i]))
                self.episodes += 1
            self.ep_ret[done | self.prev_done] = 0.0
            self.prev_done = done
            obs = torch.as_tensor(obs_np, dtype=torch.float32)
        self.obs = obs
        self.obs_buf[n_steps] = obs
        _, self.val_buf[n_steps] = agent(obs)

        adv = torch.zeros(n_steps, n_envs)
        last = torch.zeros(n_envs)
        for t in reversed(range(n_steps)):
            not_term = (~self.term_buf[t]).float()
            not_done = (~self.done_buf[t]).float()
            delta = self.rew_buf[t] + ex.gamma * self.val_buf[t + 1] * not_term - self.val_buf[t]
            last = delta + ex.gamma * ex.gae_lambda * not_done * last
            last = last * self.valid_buf[t].float()
            adv[t] = last
        ret = adv + self.val_buf[:n_steps]
        valid = self.valid_buf.reshape(-1)
        return _Batch(
            obs=self.obs_buf[:n_steps].reshape(-1, self.obs_dim)[valid],
            act=self.act_buf.reshape(-1)[valid],
            logp=self.logp_buf.reshape(-1)[valid],
            adv=adv.reshape(-1)[valid],
            ret=ret.reshape(-1)[valid],
        )


def _ppo_loss(model: nn.Module, b: _Batch, mb: torch.Tensor, ex: argparse.Namespace) -> torch.Tensor:
    """The example's clipped PPO loss on one minibatch."""
    logits, value = model(b.obs[mb])
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, b.act[mb][:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
    ratio = (logp - b.logp[mb]).exp()
    mb_adv = b.adv[mb]
    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std(unbiased=False) + 1e-8)
    pg_loss = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - ex.clip_coef, 1 + ex.clip_coef)).mean()
    v_loss = 0.5 * (value - b.ret[mb]).pow(2).mean()
    return pg_loss + ex.vf_coef * v_loss - ex.ent_coef * entropy


class _TorchftSink(logging.Handler):
    """Turns TorchFT's own log records into timestamped events (the survivors' "first sign" of a failure).

    TorchFT reports commits on the ``torchft_commits`` logger, quorum changes on ``torchft_quorums``, process-group
    aborts on ``torchft_errors`` and exceptions / healing on ``torchft.manager``; it has no callback API for these.
    """

    def __init__(self, log: _EventLog) -> None:
        super().__init__(level=logging.INFO)
        self.log = log
        self.last_commit: bool | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            name = record.name
            if name == "torchft_commits":
                self.last_commit = bool(getattr(record, "commit_result", False))
                if not self.last_commit:
                    self.log.write(
                        "fail", step=getattr(record, "step", None), quorum_id=getattr(record, "quorum_id", None)
                    )
            elif name == "torchft_quorums":
                self.log.write(
                    "quorum", quorum_id=getattr(record, "quorum_id", None), max_step=getattr(record, "step", None)
                )
            elif name == "torchft_errors":
                self.log.write("pg_abort", error=str(getattr(record, "error", "")))
            elif name == "torchft.manager":
                msg = record.getMessage()
                if "healing required" in msg:
                    self.log.write("heal_start", msg=msg[:300])
                elif "Loaded state dict" in msg:
                    self.log.write("heal_done")
                elif "peers need recovery from us" in msg:
                    self.log.write("send_checkpoint", msg=msg[:200])
                elif "flight recorder" in msg:
                    pass  # logged on every reconfiguration on CPU (no NCCL): not a failure sign
                elif record.levelno >= logging.WARNING or "exception" in msg:
                    self.log.write("error", msg=msg.splitlines()[0][:400] if msg else "")
        except Exception:  # a logging handler must never raise into TorchFT's threads
            self.handleError(record)


def _install_sink(log: _EventLog) -> _TorchftSink:
    sink = _TorchftSink(log)
    for name in ("torchft_commits", "torchft_quorums", "torchft_errors", "torchft.manager"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        lg.addHandler(sink)
        lg.propagate = False  # keep TorchFT's per-step INFO lines out of stderr
    return sink


def _ft_ddp(manager: Manager, module: nn.Module, stock: bool) -> nn.Module:
    """``torchft.DistributedDataParallel``, by default with a comm hook that survives a failed all-reduce.

    The stock hook (torchft 0.2.0, ddp.py) is ``work = manager.allreduce(buf); work.wait(); assert
    work.get_future()._fut``. When a peer dies mid-all-reduce, gloo raises ("Connection reset by peer" / "Connection
    closed by peer"); ``_ManagedWork.wait()`` catches it and reports it to the Manager (so ``should_commit`` will say
    False), but it never built the future chain, so ``_fut`` is None and the assert kills the *surviving* replica with
    ``AssertionError`` inside ``loss.backward()``. The replacement hook is the same Manager all-reduce; on that path it
    hands DDP the bucket as is (the step is not committed anyway, and the next ``zero_grad`` clears the gradients).
    """
    from torchft import DistributedDataParallel

    if stock:
        return DistributedDataParallel(manager, module)

    # No annotations on the hook: DDP's _check_comm_hook compares them with the real dist.GradBucket / Future
    # objects, and with ``from __future__ import annotations`` they would be strings. (state: Manager,
    # bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor].
    class _DDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]
            work = state.allreduce(bucket.buffer())
            work.wait()  # never raises: errors are reported to the Manager
            inner = getattr(work.get_future(), "_fut", None)
            if inner is not None:
                return inner
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return _DDP(manager, module)


def _worker(a: argparse.Namespace) -> None:
    from torch.distributed import ReduceOp, TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    _exit_with_parent(a.parent_pid)
    r, world = a.replica, a.world
    log = _EventLog(Path(a.log_dir) / f"replica{r}.jsonl", r)
    log.write("start", replacement=a.replacement, t_exec=a.t_spawn)
    sink = _install_sink(log)
    dump_dir = Path(a.log_dir) / "params"
    deadline = time.time() + a.max_seconds

    marks: dict[str, float] = {}
    ppo = _load_example()
    marks["example"] = time.time()
    ex = ppo.parse_args([])  # the example's defaults: 4 envs x 128 steps, 8 epochs x 4 minibatches, lr 1e-3, ...
    torch.set_num_threads(1)

    # The example's per-rank seeds; a replacement reuses its replica's seeds, like a restarted DDP rank would.
    seed = ex.seed * 1000 + r
    np.random.seed(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(ex.seed)  # identical initial weights everywhere, hence init_sync=False below
    agent: nn.Module = ppo.make_agent()
    torch.manual_seed(seed)
    rollout = _Rollout(ex, ppo.OBS_DIM, seed, world)
    # DDP's constructor imports torch._dynamo (1-3 s here). Pay that, and the envs, before the Manager exists: once
    # its ManagerServer heartbeats, the lighthouse holds every survivor's quorum until this replica asks to join too
    # ("waiting for healthy but not participating stragglers", up to join_timeout_ms).
    importlib.import_module("torch._dynamo")
    marks["envs_dynamo"] = time.time()

    # A replica group of one: this process hosts the group's TCPStore (the Manager only connects to it), and the
    # gloo process groups across replica groups rendezvous on the quorum primary's store.
    store = TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False)
    marks["store"] = time.time()
    opt_holder: list[Optimizer] = []

    def state_dict() -> dict[str, Any]:
        return {"model": agent.state_dict(), "optim": opt_holder[0].state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        agent.load_state_dict(sd["model"])
        opt_holder[0].load_state_dict(sd["optim"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=a.gloo_timeout_s))
    manager: Manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=a.min_replica_size,
        timeout=timedelta(seconds=a.manager_timeout_s),
        quorum_timeout=timedelta(seconds=a.quorum_timeout_s),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=a.lighthouse,
        replica_id=f"ppo_{r}",
        hostname="127.0.0.1",
        init_sync=False,
    )
    marks["manager"] = time.time()
    ddp_model = _ft_ddp(manager, agent, a.stock_ddp_hook)
    optimizer = Optimizer(manager, torch.optim.Adam(ddp_model.parameters(), lr=ex.lr, eps=1e-5))
    opt_holder.append(optimizer)
    log.write("ready", marks=marks)

    steps_per_update = ex.update_epochs * ex.num_minibatches
    env_steps_per_update = ex.num_steps * ex.num_envs * world
    prev_n = 0
    dump_left = 0

    def train_step(batch: _Batch, mb: torch.Tensor, scale: float = 1.0) -> bool:
        """One TorchFT step; True when it committed and ended a PPO update."""
        nonlocal prev_n, dump_left
        sink.last_commit = None
        optimizer.zero_grad(set_to_none=True)  # starts the (async) quorum
        loss = _ppo_loss(ddp_model, batch, mb, ex) * scale
        loss.backward()  # gradients averaged over the participating replicas via Manager.allreduce
        nn.utils.clip_grad_norm_(ddp_model.parameters(), ex.max_grad_norm)
        optimizer.step()  # should_commit vote; a healing replica loads the peer's state just before stepping
        n = manager.num_participants()
        step = manager.current_step()
        if n == world and prev_n != world:
            dump_left = a.dump_steps  # a quorum with everyone in it: dump params so the harness can compare
        prev_n = n
        if not sink.last_commit:
            return False
        if dump_left > 0:
            flat = torch.cat([p.detach().reshape(-1) for p in agent.parameters()])
            tmp = dump_dir / f".r{r}_p{os.getpid()}_s{step}.tmp"
            torch.save(flat, tmp)
            tmp.rename(dump_dir / f"r{r}_p{os.getpid()}_s{step}.pt")
            dump_left -= 1
        log.write("commit", step=step, n=n)
        if step % steps_per_update:
            return False
        # End of a PPO update (the same step number on every replica): the example's statistics all-reduce, through
        # the Manager so that a dead peer turns into a reported error instead of a hang.
        stats = torch.tensor(
            [sum(rollout.recent), float(len(rollout.recent)), float(rollout.episodes)], dtype=torch.float64
        )
        if manager.allreduce(stats, reduce_op=ReduceOp.SUM).wait():
            count = int(stats[1])
            log.write("update", step=step, avg_return=round(float(stats[0] / count), 2) if count else None)
        return True

    try:
        if a.replacement:
            # Heal before collecting data, so the first rollout runs the current policy. The healing step's
            # gradient is zeroed by TorchFT anyway (a healing replica does not participate); the batch is a dummy.
            dummy = _Batch(
                obs=rollout.obs.clone(),
                act=torch.zeros(ex.num_envs, dtype=torch.long),
                logp=torch.zeros(ex.num_envs),
                adv=torch.zeros(ex.num_envs),
                ret=torch.zeros(ex.num_envs),
            )
            while not sink.last_commit:
                train_step(dummy, torch.arange(ex.num_envs), scale=0.0)
        while time.time() < deadline:
            batch = rollout.collect(agent)
            # The example's linear lr decay, from the global step counter so every replica agrees.
            env_steps = (manager.current_step() // steps_per_update + 1) * env_steps_per_update
            frac = min(1.0, env_steps / ex.anneal_steps) if ex.anneal_steps > 0 else 0.0
            for group in optimizer.param_groups:
                group["lr"] = ex.lr * max(ex.min_lr_frac, 1.0 - frac)
            done = False
            while not done:
                perm = torch.randperm(batch.n, generator=gen)
                for mb in torch.tensor_split(perm, ex.num_minibatches):
                    if train_step(batch, mb):
                        done = True
                        break
    except BaseException as e:
        log.write("crash", error=f"{type(e).__name__}: {e}"[:500])
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # Skip interpreter teardown: TorchFT's quorum / gloo threads may still be running.
    os._exit(0)


# ---------------------------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------------------------
class _Tail:
    """Incrementally parsed JSON-lines file (only complete lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.records: list[dict[str, Any]] = []

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            if line.strip():
                self.records.append(json.loads(line))


@dataclass
class _Cluster:
    workdir: Path
    world: int
    worker_args: list[str]
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    all_procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    tails: dict[int, _Tail] = field(default_factory=dict)
    errs: dict[int, Path] = field(default_factory=dict)
    n_started: int = 0

    def spawn(self, replica: int, replacement: bool) -> subprocess.Popen[bytes]:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.n_started += 1
        self.errs[replica] = self.workdir / f"replica{replica}_{self.n_started}.err"
        err = open(self.errs[replica], "wb")  # noqa: SIM115 (lives with proc)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--replica", str(replica)]
        cmd += self.worker_args + ["--t-spawn", repr(time.time())] + (["--replacement"] if replacement else [])
        p = subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
        err.close()
        self.procs[replica] = p
        self.all_procs.append(p)
        self.tails.setdefault(replica, _Tail(self.workdir / f"replica{replica}.jsonl"))
        return p

    def poll(self) -> None:
        for t in self.tails.values():
            t.poll()

    def records(self, replica: int, event: str | None = None, pid: int | None = None) -> list[dict[str, Any]]:
        return [
            rec
            for rec in self.tails[replica].records
            if (event is None or rec["event"] == event) and (pid is None or rec["pid"] == pid)
        ]

    def last_step(self, replica: int) -> int:
        pid = self.procs[replica].pid
        commits = self.records(replica, "commit", pid)
        return commits[-1]["step"] if commits else -1

    def check_alive(self) -> None:
        for r, p in self.procs.items():
            if p.poll() is not None:
                tail = _tail_text(self.errs[r], 600)
                crashes = self.records(r, "crash", p.pid)
                raise RuntimeError(f"replica {r} (pid {p.pid}) exited with {p.returncode}: {crashes} {tail}")

    def wait(self, what: str, cond: Any, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.poll()
            if cond():
                return
            self.check_alive()
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def _tail_text(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)  # its own session: takes any children of the replica with it
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)


def _start_lighthouse(workdir: Path, a: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--serve-lighthouse",
        "--parent-pid",
        str(os.getpid()),
        "--min-replicas",
        str(a.min_replicas),
        "--join-timeout-ms",
        str(a.join_timeout_ms),
        "--heartbeat-timeout-ms",
        str(a.heartbeat_timeout_ms),
        "--quorum-tick-ms",
        str(a.quorum_tick_ms),
    ]
    err = open(workdir / "lighthouse.err", "wb")  # noqa: SIM115 (lives with proc)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    err.close()
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 60.0)
    line = p.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("http://"):
        _kill_group(p)
        raise RuntimeError(f"lighthouse did not start: {_tail_text(workdir / 'lighthouse.err')}")
    return p, line


def _max_abs_diff(
    dump_dir: Path, pids: dict[int, int], first_step: int, target: int
) -> tuple[float | None, int | None]:
    """Max |param difference| across replicas at ``target``, else at the first step >= first_step all of them dumped."""
    steps: dict[int, dict[int, Path]] = {}
    for f in dump_dir.glob("r*_p*_s*.pt"):
        r_s, p_s, s_s = f.stem.split("_")
        r, pid, step = int(r_s[1:]), int(p_s[1:]), int(s_s[1:])
        if pids.get(r) == pid:
            steps.setdefault(step, {})[r] = f
    full = sorted(s for s, by_r in steps.items() if len(by_r) == len(pids) and s >= first_step)
    if not full:
        return None, None
    step = target if target in full else full[0]
    flats = torch.stack([torch.load(steps[step][r], weights_only=True) for r in sorted(pids)])
    return float((flats.max(0).values - flats.min(0).values).max()), step


def _run_metrics(c: _Cluster, victim: int, t_kill: float, old_pids: dict[int, int], new_pid: int) -> dict[str, Any]:
    survivors = [r for r in range(c.world) if r != victim]
    first = c.records(victim, "commit", new_pid)[0]
    r_step = first["step"]
    pauses: list[float] = []
    lost: list[int] = []
    detect: list[float] = []
    restarted = 0
    degraded_steps: set[int] = set()
    for s in survivors:
        recs = c.records(s)
        if any(rec["pid"] != old_pids[s] for rec in recs if rec["t"] > t_kill):
            restarted += 1
        mine = [rec for rec in recs if rec["pid"] == old_pids[s]]
        commits = [rec for rec in mine if rec["event"] == "commit"]
        before = [rec for rec in commits if rec["t"] <= t_kill]
        quorums = [rec["t"] for rec in mine if rec["event"] == "quorum" and rec["t"] > t_kill]
        # The stall ends at the first commit in the first quorum formed after the kill (the one without the dead
        # replica, or already with its replacement). A survivor can still commit a step or two right after the
        # kill (when the victim had already sent its share of that all-reduce), so the gap *spanning* the kill is
        # not enough: take the longest gap between consecutive commits from the last pre-kill commit to that one.
        t_resume = quorums[0] if quorums else t_kill
        after = [rec for rec in commits if rec["t"] > t_resume]
        if not before or not after:
            continue
        last_b, end = before[-1], after[0]
        window = [last_b["t"]] + [rec["t"] for rec in commits if last_b["t"] < rec["t"] <= end["t"]]
        pauses.append(max(b - a for a, b in itertools.pairwise(window)))
        fails = [rec for rec in mine if rec["event"] == "fail" and t_kill < rec["t"] <= end["t"]]
        post = [rec["step"] for rec in commits if rec["t"] > t_kill]
        redone = max(0, last_b["step"] - post[0] + 1)  # the step counter went back (healed from an older peer)
        lost.append(len(fails) + redone)
        signs = [
            rec["t"] for rec in mine if rec["event"] in ("error", "fail", "quorum", "pg_abort") and rec["t"] > t_kill
        ]
        if signs:
            detect.append(min(signs) - t_kill)
        degraded_steps.update(
            rec["step"] for rec in commits if rec["t"] > t_kill and rec["n"] < c.world and rec["step"] <= r_step
        )
    pids = {s: old_pids[s] for s in survivors} | {victim: new_pid}
    diff, diff_step = _max_abs_diff(c.workdir / "params", pids, r_step, r_step + STEPS_AFTER_RECOVERY)
    start = c.records(victim, "start", new_pid)
    ready = c.records(victim, "ready", new_pid)
    heal = c.records(victim, "heal_done", new_pid)
    phases: dict[str, float] = {}
    if start and ready:
        marks = ready[0]["marks"]
        phases = {
            "python_torch_torchft_import": start[0]["t"] - start[0]["t_exec"],
            "example_gym_import": marks["example"] - start[0]["t"],
            "envs_and_dynamo_import": marks["envs_dynamo"] - marks["example"],  # dynamo: DDP imports it
            "manager_ddp_init": ready[0]["t"] - marks["envs_dynamo"],
            "quorum_heal_first_commit": first["t"] - ready[0]["t"],
        }
    return {
        "victim": victim,
        "detect_s": round(min(detect), 3) if detect else None,
        "survivor_pause_s": [round(x, 3) for x in pauses],
        "replacement_rejoin_s": round(first["t"] - t_kill, 3),
        "replacement_healed_s": round(heal[0]["t"] - t_kill, 3) if heal else None,
        "replacement_phases_s": {k: round(v, 3) for k, v in phases.items()},
        "replacement_first_step": r_step,
        "healthy_ranks_restarted": restarted,
        "steps_lost": max(lost) if lost else None,
        "steps_lost_per_survivor": lost,
        "steps_degraded": len(degraded_steps),
        "replica_max_abs_diff": diff,
        "diff_step_offset": None if diff_step is None else diff_step - r_step,
    }


def _summary(values: list[Any]) -> dict[str, float] | None:
    """p50 / max / count of the values that were measured (None = not measured in that run)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"p50": round(statistics.median(vals), 3), "max": round(max(vals), 3), "n": len(vals)}


def run(
    runs: int = 5,
    world: int = 4,
    *,
    heartbeat_timeout_ms: int = LH_HEARTBEAT_TIMEOUT_MS,
    join_timeout_ms: int = LH_JOIN_TIMEOUT_MS,
    quorum_tick_ms: int = LH_QUORUM_TICK_MS,
    min_replicas: int | None = None,
    gloo_timeout_s: float = GLOO_TIMEOUT_S,
    manager_timeout_s: float = MANAGER_TIMEOUT_S,
    quorum_timeout_s: float = QUORUM_TIMEOUT_S,
    settle_s: float = 2.0,
    run_timeout_s: float = 120.0,
    seed: int = 0,
    stock_ddp_hook: bool = False,
    workdir: str | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Start a lighthouse and ``world`` replicas, kill/replace one replica ``runs`` times, return the summary."""
    t0 = time.time()
    min_rep = min_replicas if min_replicas is not None else max(1, world - 1)  # the survivors keep a quorum
    own_dir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="torchft-ppo-")) if workdir is None else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "params").mkdir(exist_ok=True)
    la = argparse.Namespace(
        min_replicas=min_rep,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
    )
    settings: dict[str, Any] = {
        "process_group": "torchft.ProcessGroupGloo",
        "ddp": "torchft.DistributedDataParallel"
        + (" (stock comm hook)" if stock_ddp_hook else " (comm hook tolerating a failed all-reduce, see _ft_ddp)"),
        "gloo_timeout_s": gloo_timeout_s,
        "manager_timeout_s": manager_timeout_s,
        "quorum_timeout_s": quorum_timeout_s,
        "min_replica_size": min_rep,
        "use_async_quorum": True,
        "init_sync": False,
        "checkpoint_transport": "HTTPTransport (TorchFT default)",
        "manager_heartbeat_interval_ms": 100,
        "lighthouse": {
            "min_replicas": min_rep,
            "join_timeout_ms": join_timeout_ms,
            "heartbeat_timeout_ms": heartbeat_timeout_ms,
            "quorum_tick_ms": quorum_tick_ms,
        },
    }

    def say(msg: str) -> None:
        if verbose:
            print(f"[{time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    lighthouse: subprocess.Popen[bytes] | None = None
    cluster: _Cluster | None = None
    try:
        lighthouse, lh_addr = _start_lighthouse(wd, la)
        say(f"lighthouse at {lh_addr}")
        worker_args = [
            "--world", str(world), "--lighthouse", lh_addr, "--log-dir", str(wd), "--parent-pid", str(os.getpid()),
            "--min-replica-size", str(min_rep), "--gloo-timeout-s", str(gloo_timeout_s),
            "--manager-timeout-s", str(manager_timeout_s), "--quorum-timeout-s", str(quorum_timeout_s),
        ] + (["--stock-ddp-hook"] if stock_ddp_hook else [])  # fmt: skip
        cluster = c = _Cluster(wd, world, worker_args)
        for r in range(world):
            c.spawn(r, replacement=False)
        ppo_args = _load_example().parse_args([])
        spu = ppo_args.update_epochs * ppo_args.num_minibatches
        warm = WARMUP_UPDATES * spu
        c.wait(f"every replica past step {warm}", lambda: all(c.last_step(r) >= warm for r in range(world)), 240.0)
        c.wait("5 s of steady training", lambda: time.time() - c.records(0, "commit")[0]["t"] > 5.0, 60.0)
        c.poll()
        commits0 = c.records(0, "commit")
        recent = [rec["t"] for rec in commits0 if rec["t"] > commits0[-1]["t"] - 5.0]
        rate = (len(recent) - 1) / (recent[-1] - recent[0])
        # The longest gap between commits in normal running (the rollout between two PPO updates): the floor for
        # survivor_pause_s.
        normal_gap = max(b - a for a, b in itertools.pairwise(recent))
        say(f"warm: steps {[c.last_step(r) for r in range(world)]}, {rate:.1f} steps/s, max gap {normal_gap:.2f}s")

        per_run: list[dict[str, Any]] = []
        rng = random.Random(seed)
        rotation = [*range(1, world), 0]
        for i in range(runs):
            victim = rotation[i % world]
            # Kill at a random point of a PPO update (rollout, minibatch steps or the statistics all-reduce), not
            # always right after the harness's last poll.
            time.sleep(rng.uniform(0.0, spu / rate))
            old_pids = {r: c.procs[r].pid for r in range(world)}
            victim_proc = c.procs[victim]
            t_kill = time.time()
            os.killpg(victim_proc.pid, signal.SIGKILL)
            rep = c.spawn(victim, replacement=True)  # the supervisor's restart, as soon as the exit is seen
            _kill_group(victim_proc)  # reap it
            say(f"run {i + 1}/{runs}: killed replica {victim} (pid {old_pids[victim]}), replacement pid {rep.pid}")

            def recovered(victim: int = victim, rep_pid: int = rep.pid) -> bool:
                rc = c.records(victim, "commit", rep_pid)
                if len(rc) < STEPS_AFTER_RECOVERY:
                    return False
                target = rc[0]["step"] + STEPS_AFTER_RECOVERY
                return all(c.last_step(r) >= target for r in range(world))

            c.wait(f"replacement of replica {victim} to commit {STEPS_AFTER_RECOVERY} steps", recovered, run_timeout_s)
            m = _run_metrics(c, victim, t_kill, old_pids, rep.pid)
            per_run.append(m)
            say(f"run {i + 1}: {json.dumps(m)}")
            time.sleep(settle_s)
            c.poll()

        pauses = [p for m in per_run for p in m["survivor_pause_s"]]
        result: dict[str, Any] = {
            "system": "torchft",
            "runs": runs,
            "world": world,
            "detect_s": _summary([m["detect_s"] for m in per_run]),
            "survivor_pause_s": _summary(pauses),
            "replacement_rejoin_s": _summary([m["replacement_rejoin_s"] for m in per_run]),
            "replacement_import_s": _summary(
                [m["replacement_phases_s"].get("python_torch_torchft_import") for m in per_run]
            ),
            "healthy_ranks_restarted": sum(m["healthy_ranks_restarted"] for m in per_run),
            "steps_lost": _summary([m["steps_lost"] for m in per_run]),
            "steps_degraded": _summary([m["steps_degraded"] for m in per_run]),
            "replica_max_abs_diff": max(
                (m["replica_max_abs_diff"] for m in per_run if m["replica_max_abs_diff"] is not None), default=None
            ),
            "diff_step_offsets": [m["diff_step_offset"] for m in per_run],
            "committed_steps_per_s_before_kills": round(rate, 2),
            "normal_max_commit_gap_s": round(normal_gap, 3),
            "settings": settings,
            "per_run": per_run,
            "wall_s": round(time.time() - t0, 1),
        }
        return result
    finally:
        if cluster is not None:
            for p in cluster.all_procs:
                _kill_group(p)
        if lighthouse is not None:
            _kill_group(lighthouse)
        if own_dir:
            shutil.rmtree(wd, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--world", type=int, default=4, help="replica groups (one process each)")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=LH_HEARTBEAT_TIMEOUT_MS)
    ap.add_argument("--join-timeout-ms", type=int, default=LH_JOIN_TIMEOUT_MS)
    ap.add_argument("--quorum-tick-ms", type=int, default=LH_QUORUM_TICK_MS)
    ap.add_argument("--min-replicas", type=int, default=None, help="lighthouse min_replicas (default world - 1)")
    ap.add_argument("--gloo-timeout-s", type=float, default=GLOO_TIMEOUT_S)
    ap.add_argument("--manager-timeout-s", type=float, default=MANAGER_TIMEOUT_S)
    ap.add_argument("--quorum-timeout-s", type=float, default=QUORUM_TIMEOUT_S)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0, help="for the random kill points")
    ap.add_argument(
        "--stock-ddp-hook", action="store_true", help="torchft's own DDP comm hook (crashes survivors, see _ft_ddp)"
    )
    ap.add_argument("--workdir", default=None, help="keep logs and parameter dumps here (default: a temp dir)")
    ap.add_argument("-q", "--quiet", action="store_true")
    # internal: the lighthouse and replica processes the harness starts
    ap.add_argument("--serve-lighthouse", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--replacement", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    ap.add_argument("--log-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--min-replica-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--dump-steps", type=int, default=DUMP_STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--max-seconds", type=float, default=1800.0, help=argparse.SUPPRESS)
    ap.add_argument("--t-spawn", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_lighthouse:
        a.min_replicas = a.min_replicas if a.min_replicas is not None else 1
        _serve_lighthouse(a)
        return 0
    if a.worker:
        _worker(a)
        return 0
    try:
        result = run(
            a.runs,
            a.world,
            heartbeat_timeout_ms=a.heartbeat_timeout_ms,
            join_timeout_ms=a.join_timeout_ms,
            quorum_tick_ms=a.quorum_tick_ms,
            min_replicas=a.min_replicas,
            gloo_timeout_s=a.gloo_timeout_s,
            manager_timeout_s=a.manager_timeout_s,
            quorum_timeout_s=a.quorum_timeout_s,
            settle_s=a.settle_s,
            seed=a.seed,
            stock_ddp_hook=a.stock_ddp_hook,
            workdir=a.workdir,
            verbose=not a.quiet,
        )
    except Exception as e:  # still end with one JSON line, saying what broke
        print(json.dumps({"system": "torchft", "runs": a.runs, "world": a.world, "error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
