"""A2C on gymnasium CartPole-v1 whose ranks average their gradients themselves: no DistributedDataParallel.

A plain PyTorch workload with no DSec import: DSec attaches to it from the outside (``dsec run``).

Every rank runs its own vectorized CartPole envs, computes n-step advantages on its own rollout and one loss;
after ``backward()`` the gradients are averaged across ranks by hand, in one of two ways (``--sync``):

* ``param`` — one ``dist.all_reduce(p.grad, async_op=True)`` per parameter, then ``wait()`` and divide by the
  world size (a hand-written A2C learner);
* ``flat`` — the gradients flattened into one buffer, one ``all_reduce``, divided and copied back (CleanRL's
  multi-GPU PPO).

Then gradient clipping and one Adam step. The initial weights are broadcast from rank 0, so the replicas stay
identical as long as every rank applies the same averaged gradient; the script checks that at the end.
Training stops at ``--target-return`` (mean of the last ~20 episodes over all ranks), ``--total-steps``,
``--max-seconds`` or once ``--stop-file`` exists. Rank 0 prints progress lines and, last, one JSON line
(``--out FILE`` also writes it to a file).

Launch:
    python examples/a2c_cartpole_allreduce.py --world-size 2 --sync param   # spawns the ranks itself
    torchrun --nproc-per-node 2 examples/a2c_cartpole_allreduce.py --sync flat
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

OBS_DIM = 4
N_ACTIONS = 2


class ActorCritic(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(OBS_DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.pi = nn.Linear(hidden, N_ACTIONS)
        self.v = nn.Linear(hidden, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--world-size", type=int, default=None, help="ranks to spawn (default: $WORLD_SIZE or 1)")
    p.add_argument("--sync", choices=("param", "flat"), default="param", help="how gradients are averaged")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--target-return", type=float, default=400.0)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--total-steps", type=int, default=1_000_000, help="env steps over all ranks")
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.add_argument("--num-envs", type=int, default=8, help="envs per rank")
    p.add_argument("--num-steps", type=int, default=16, help="rollout length (n-step returns)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep per update (tests: slower pace)")
    p.add_argument("--log-every", type=int, default=100, help="updates between progress lines (0 = none)")
    p.add_argument("--stop-file", default=None, help="stop (on every rank at the same update) once this file exists")
    p.add_argument("--out", default=None, help="also write the final JSON line to this file")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def average_gradients(model: nn.Module, world_size: int, how: str) -> None:
    """The hand-written gradient all-reduce this example is about."""
    params = [p for p in model.parameters() if p.grad is not None]
    if how == "param":
        works = [dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True) for p in params]
        for work, p in zip(works, params, strict=True):
            work.wait()
            p.grad.div_(world_size)
    else:
        flat = torch.cat([p.grad.view(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world_size)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


def train(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    own_group = not dist.is_initialized()
    if own_group:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t_start = time.perf_counter()
    seed = args.seed * 1000 + rank
    torch.manual_seed(seed)
    model = ActorCritic()
    for q in model.parameters():  # identical initial weights on every rank
        dist.broadcast(q.data, src=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    envs = gym.make_vec("CartPole-v1", num_envs=args.num_envs, vectorization_mode="sync")
    obs_np, _ = envs.reset(seed=seed)
    obs = torch.as_tensor(obs_np, dtype=torch.float32)
    n_envs, n_steps = args.num_envs, args.num_steps
    recent: deque[float] = deque(maxlen=max(1, math.ceil(args.window / world_size)))
    ep_ret = np.zeros(n_envs)
    prev_done = np.zeros(n_envs, dtype=bool)  # NEXT_STEP autoreset: the next step is a reset
    env_steps = updates = 0
    avg_return = float("nan")
    reached = False
    count = 0
    while True:
        logps, values, ents, rews, masks, valid = [], [], [], [], [], []
        for _ in range(n_steps):
            logits, value = model(obs)
            dist_a = torch.distributions.Categorical(logits=logits)
            action = dist_a.sample()
            obs_np, reward, term, trunc, _ = envs.step(action.numpy())
            done = term | trunc
            logps.append(dist_a.log_prob(action))
            values.append(value)
            ents.append(dist_a.entropy())
            rews.append(torch.as_tensor(reward, dtype=torch.float32))
            masks.append(torch.as_tensor(~term, dtype=torch.float32))
            valid.append(torch.as_tensor(~prev_done, dtype=torch.float32))
            ep_ret += reward
            for i in np.flatnonzero(done):
                recent.append(float(ep_ret[i]))
            ep_ret[done | prev_done] = 0.0
            prev_done = done
            obs = torch.as_tensor(obs_np, dtype=torch.float32)
        with torch.no_grad():
            _, ret = model(obs)
        returns = []
        for t in reversed(range(n_steps)):
            ret = rews[t] + args.gamma * ret * masks[t]
            # A reset step's input is the last observation of the episode before it: its value bootstraps a
            # truncated episode; the step itself carries nothing.
            ret = ret * valid[t] + (1 - valid[t]) * values[t].detach()
            returns.append(ret)
        returns.reverse()
        v = torch.stack(values)
        adv = (torch.stack(returns) - v).detach()
        w = torch.stack(valid)
        pg_loss = -(torch.stack(logps) * adv * w).sum() / w.sum()
        v_loss = 0.5 * ((torch.stack(returns) - v).pow(2) * w).sum() / w.sum()
        entropy = (torch.stack(ents) * w).sum() / w.sum()
        loss = pg_loss + args.vf_coef * v_loss - args.ent_coef * entropy
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(model, world_size, args.sync)
        nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        env_steps += n_steps * n_envs * world_size
        updates += 1
        if args.sleep:
            time.sleep(args.sleep)

        if updates % 10 == 0:  # pooled stats and a stop decision every rank agrees on
            stop_asked = 1.0 if args.stop_file and os.path.exists(args.stop_file) else 0.0
            stats = torch.tensor([sum(recent), float(len(recent)), time.perf_counter() - t_start, stop_asked])
            dist.all_reduce(stats)
            count = int(stats[1])
            avg_return = float(stats[0] / count) if count else float("nan")
            reached = count >= args.window and avg_return >= args.target_return
            if args.log_every and updates % args.log_every == 0 and rank == 0:
                print(f"update {updates:5d}  env_steps {env_steps:8d}  avg_return {avg_return:6.1f}", flush=True)
            over = env_steps >= args.total_steps or float(stats[2]) / world_size >= args.max_seconds
            if reached or over or stats[3] > 0:
                break
    envs.close()
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    result = {
        "reached": bool(reached),
        "avg_return": round(avg_return, 2) if count else None,
        "env_steps": env_steps,
        "updates": updates,
        "seconds": round(time.perf_counter() - t_start, 2),
        "world_size": world_size,
        "sync": args.sync,
        "replica_max_abs_diff": max(float((g - gathered[0]).abs().max()) for g in gathered),
        "finite": bool(torch.isfinite(flat).all()),
    }
    dist.barrier()
    if own_group:
        dist.destroy_process_group()
    return result


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    result = train(rank, world_size, args)
    if rank == 0:
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun or another launcher
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
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
