"""PPO on gymnasium CartPole-v1, trained with DistributedDataParallel over gloo.

A plain PyTorch workload with no DSec import: DSec attaches to it from the outside.

Every rank runs its own vectorized CartPole envs, computes GAE on its own rollout, and runs
the same number of minibatch updates per rollout; each ``backward()`` goes through DDP, so the
gradients are all-reduced on every minibatch. Training stops as soon as the mean return of the
last ~20 finished episodes (pooled over all ranks) reaches ``--target-return``, or at the
``--total-steps`` / ``--max-seconds`` limits. Rank 0 prints progress lines and, last, one JSON line.

Launch:
    python examples/ppo_cartpole_ddp.py --world-size 2        # spawns the ranks itself
    torchrun --nproc-per-node 2 examples/ppo_cartpole_ddp.py  # RANK/WORLD_SIZE/MASTER_* from env
    python examples/ppo_cartpole_ddp.py --world-size 1        # one process
    python examples/ppo_cartpole_ddp.py --short               # quick smoke run (~20k env steps)

gymnasium 1.x vector envs autoreset in NEXT_STEP mode: the step that ends an episode returns the
episode's real last observation, and the *following* step call ignores its action and returns
the reset observation with reward 0. Such reset steps are kept out of the loss, and the value of
the last observation bootstraps truncated episodes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import threading
import time
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

OBS_DIM = 4
N_ACTIONS = 2


def _layer(inp: int, out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(inp, out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class Agent(nn.Module):
    """Separate actor and critic MLPs (64x64 tanh); ``forward`` returns (logits, value)."""

    def __init__(self, obs_dim: int = OBS_DIM, n_actions: int = N_ACTIONS, hidden: int = 64) -> None:
        super().__init__()
        g = math.sqrt(2.0)
        self.actor = nn.Sequential(
            _layer(obs_dim, hidden, g), nn.Tanh(), _layer(hidden, hidden, g), nn.Tanh(), _layer(hidden, n_actions, 0.01)
        )
        self.critic = nn.Sequential(
            _layer(obs_dim, hidden, g), nn.Tanh(), _layer(hidden, hidden, g), nn.Tanh(), _layer(hidden, 1, 1.0)
        )

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Both heads in one forward, so DDP sees every parameter used in each backward.
        return self.actor(obs), self.critic(obs).squeeze(-1)


def make_agent() -> nn.Module:
    return Agent()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--world-size", type=int, default=None, help="ranks to spawn (default: $WORLD_SIZE or 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--target-return", type=float, default=475.0)
    p.add_argument("--window", type=int, default=20, help="finished episodes (all ranks together) averaged")
    p.add_argument("--total-steps", type=int, default=500_000, help="env steps over all ranks")
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="train at least this long even once the target is reached (for a demo whose scenes need "
                        "running learners)")  # fmt: skip
    p.add_argument("--short", action="store_true", help="smoke run: caps --total-steps at 20000")
    p.add_argument("--num-envs", type=int, default=4, help="envs per rank")
    p.add_argument("--num-steps", type=int, default=128, help="rollout length per env")
    p.add_argument("--num-minibatches", type=int, default=4, help="minibatches per epoch (per rank)")
    p.add_argument("--update-epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--anneal-steps", type=int, default=150_000, help="linear lr decay horizon; 0 = constant lr")
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="lr floor as a fraction of --lr")
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.0)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--log-every", type=int, default=10, help="updates between progress lines (0 = none)")
    p.add_argument("--stop-file", default=None, help="stop (on every rank at the same update) once this file exists")
    args = p.parse_args(argv)
    if args.short:
        args.total_steps = min(args.total_steps, 20_000)
    return args


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _let_comm_threads_settle(min_s: float = 0.05, max_s: float = 1.0) -> None:
    """Leave the GIL free until gloo's worker threads have gone idle.

    A gloo worker thread frees each finished collective itself, and freeing a tensor that has a
    Python object takes the GIL (torch >= 2.10). If that happens after interpreter shutdown has
    begun, the thread is killed inside a C++ destructor and the process aborts with "terminate
    called without an active exception" (SIGABRT); barrier() and destroy_process_group() do not
    prevent it (with DDP the gloo group even outlives destroy_process_group()). It takes a worker
    thread delayed past the final barrier, i.e. a busy machine. Sleeping here hands such a thread
    the GIL; on Linux we also wait (up to ``max_s``) while another thread of ours is runnable.
    """
    time.sleep(min_s)
    task_dir = "/proc/self/task"
    if not os.path.isdir(task_dir):
        return
    me = str(threading.get_native_id())
    deadline = time.monotonic() + max_s - min_s
    while time.monotonic() < deadline:
        busy = False
        for tid in os.listdir(task_dir):
            if tid == me:
                continue
            try:
                with open(f"{task_dir}/{tid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue
            busy = busy or state in ("R", "D")
        if not busy:
            return
        time.sleep(0.01)


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def train(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train on this rank; every rank returns the same result dict.

    Initializes the gloo process group from MASTER_ADDR/MASTER_PORT (env://) unless one is already
    initialized, and then also tears it down at the end.
    """
    torch.set_num_threads(1)
    own_group = not dist.is_initialized()
    if own_group:
        if os.environ.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if world_size == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    t_start = time.perf_counter()
    seed = args.seed * 1000 + rank
    np.random.seed(seed)
    gen = torch.Generator().manual_seed(seed)  # minibatch shuffling
    torch.manual_seed(args.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    agent = make_agent()
    torch.manual_seed(seed)  # per-rank action sampling
    ddp_model = DistributedDataParallel(agent)
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=args.lr, eps=1e-5)

    n_envs, n_steps = args.num_envs, args.num_steps
    envs = gym.make_vec("CartPole-v1", num_envs=n_envs, vectorization_mode="sync")
    obs_np, _ = envs.reset(seed=seed * 100)

    obs_buf = torch.zeros(n_steps + 1, n_envs, OBS_DIM)
    act_buf = torch.zeros(n_steps, n_envs, dtype=torch.long)
    logp_buf = torch.zeros(n_steps, n_envs)
    val_buf = torch.zeros(n_steps + 1, n_envs)
    rew_buf = torch.zeros(n_steps, n_envs)
    term_buf = torch.zeros(n_steps, n_envs, dtype=torch.bool)
    done_buf = torch.zeros(n_steps, n_envs, dtype=torch.bool)
    valid_buf = torch.ones(n_steps, n_envs, dtype=torch.bool)

    per_rank_window = max(1, math.ceil(args.window / world_size))
    recent: deque[float] = deque(maxlen=per_rank_window)
    ep_ret = np.zeros(n_envs)
    prev_done = np.zeros(n_envs, dtype=bool)  # NEXT_STEP autoreset: next step call is a reset
    steps_per_update = n_steps * n_envs * world_size
    env_steps = updates = episodes = 0
    avg_return = float("nan")
    # The first full window's average: what the policy the run *started* with is worth (a fresh start reads ~20 on
    # CartPole; a run restored from a trained policy reads far more), before this run's own learning dominates.
    first_window_return: float | None = None
    reached = False
    obs = torch.as_tensor(obs_np, dtype=torch.float32)

    while True:
        # ---- rollout -------------------------------------------------------------------------
        with torch.no_grad():
            for t in range(n_steps):
                obs_buf[t] = obs
                valid_buf[t] = torch.from_numpy(~prev_done)
                logits, value = agent(obs)
                action = torch.distributions.Categorical(logits=logits).sample()
                act_buf[t] = action
                logp_buf[t] = torch.log_softmax(logits, -1).gather(-1, action[:, None]).squeeze(-1)
                val_buf[t] = value
                obs_np, reward, term, trunc, _ = envs.step(action.numpy())
                done = term | trunc
                rew_buf[t] = torch.as_tensor(reward, dtype=torch.float32)
                term_buf[t] = torch.from_numpy(term)
                done_buf[t] = torch.from_numpy(done)
                ep_ret += reward
                for i in np.flatnonzero(done):
                    recent.append(float(ep_ret[i]))
                    episodes += 1
                ep_ret[done | prev_done] = 0.0
                prev_done = done
                obs = torch.as_tensor(obs_np, dtype=torch.float32)
            obs_buf[n_steps] = obs
            _, val_buf[n_steps] = agent(obs)

            # ---- GAE: obs_buf[t+1] after a done step is the real last observation ------------
            adv = torch.zeros(n_steps, n_envs)
            last = torch.zeros(n_envs)
            for t in reversed(range(n_steps)):
                not_term = (~term_buf[t]).float()
                not_done = (~done_buf[t]).float()
                delta = rew_buf[t] + args.gamma * val_buf[t + 1] * not_term - val_buf[t]
                last = delta + args.gamma * args.gae_lambda * not_done * last
                last = last * valid_buf[t].float()  # reset steps carry nothing
                adv[t] = last
            ret = adv + val_buf[:n_steps]

        env_steps += steps_per_update
        updates += 1

        # ---- PPO update: same number of minibatches on every rank ----------------------------
        frac = min(1.0, env_steps / args.anneal_steps) if args.anneal_steps > 0 else 0.0
        lr = args.lr * max(args.min_lr_frac, 1.0 - frac)
        for group in optimizer.param_groups:
            group["lr"] = lr
        valid = valid_buf.reshape(-1)
        b_obs = obs_buf[:n_steps].reshape(-1, OBS_DIM)[valid]
        b_act = act_buf.reshape(-1)[valid]
        b_logp = logp_buf.reshape(-1)[valid]
        b_adv = adv.reshape(-1)[valid]
        b_ret = ret.reshape(-1)[valid]
        n = b_obs.shape[0]
        clipfrac = 0.0
        for _ in range(args.update_epochs):
            perm = torch.randperm(n, generator=gen)
            for mb in torch.tensor_split(perm, args.num_minibatches):
                logits, value = ddp_model(b_obs[mb])
                logp_all = torch.log_softmax(logits, -1)
                logp = logp_all.gather(-1, b_act[mb][:, None]).squeeze(-1)
                entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
                ratio = (logp - b_logp[mb]).exp()
                mb_adv = b_adv[mb]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std(unbiased=False) + 1e-8)
                pg_loss = torch.max(
                    -mb_adv * ratio, -mb_adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)
                ).mean()
                v_loss = 0.5 * (value - b_ret[mb]).pow(2).mean()
                loss = pg_loss + args.vf_coef * v_loss - args.ent_coef * entropy
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP all-reduces the gradients here
                nn.utils.clip_grad_norm_(ddp_model.parameters(), args.max_grad_norm)
                optimizer.step()
                clipfrac = float(((ratio - 1).abs() > args.clip_coef).float().mean())

        # ---- pooled stats and a stop decision every rank agrees on ---------------------------
        elapsed = time.perf_counter() - t_start
        stop_asked = 1.0 if args.stop_file and os.path.exists(args.stop_file) else 0.0
        stats = torch.tensor(
            [sum(recent), float(len(recent)), elapsed, float(episodes), stop_asked], dtype=torch.float64
        )
        dist.all_reduce(stats)
        count = int(stats[1])
        avg_return = float(stats[0] / count) if count else float("nan")
        if first_window_return is None and count >= args.window:
            first_window_return = avg_return
        reached = count >= args.window and avg_return >= args.target_return
        if args.log_every and (updates % args.log_every == 0 or reached):
            _log(
                rank,
                f"update {updates:4d}  env_steps {env_steps:7d}  episodes {int(stats[3]):5d}  "
                f"avg_return {avg_return:6.1f}  lr {lr:.2e}  clipfrac {clipfrac:.3f}  "
                f"v_loss {float(v_loss.detach()):8.3f}  t {stats[2] / world_size:6.1f}s",
            )
        done = reached and float(stats[2]) / world_size >= args.min_seconds
        if done or env_steps >= args.total_steps or float(stats[2]) / world_size >= args.max_seconds or stats[4] > 0:
            break

    envs.close()
    # Replicas must hold identical weights (DDP's contract): measure it across ranks.
    flat = torch.cat([q.detach().reshape(-1) for q in agent.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    replica_diff = max(float((g - gathered[0]).abs().max()) for g in gathered)
    seconds = time.perf_counter() - t_start
    result = {
        "reached": bool(reached),
        "avg_return": round(avg_return, 2) if count else None,
        "first_window_return": round(first_window_return, 2) if first_window_return is not None else None,
        "env_steps": env_steps,
        "updates": updates,
        "seconds": round(seconds, 2),
        "world_size": world_size,
        "replica_max_abs_diff": replica_diff,
    }
    del ddp_model
    dist.barrier()
    if own_group:
        dist.destroy_process_group()
    _let_comm_threads_settle()
    return result


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    result = train(rank, world_size, args)
    if rank == 0:
        print(json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun or another launcher
        world_size = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world_size:
            print(f"--world-size {args.world_size} ignored: WORLD_SIZE={world_size}", file=sys.stderr)
        _worker(int(os.environ["RANK"]), world_size, args)
        return 0
    world_size = args.world_size or 1
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    if world_size == 1:
        _worker(0, 1, args)
    else:
        mp.spawn(_worker, args=(world_size, args), nprocs=world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
