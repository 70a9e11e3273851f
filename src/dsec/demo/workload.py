"""The demo's training processes: real PyTorch on gymnasium CartPole-v1.

- ``learner`` ranks train one policy with REINFORCE under DistributedDataParallel over gloo
  (every backward all-reduces the gradients across ranks);
- an ``actor`` samples episodes with its own copy of the policy (no collectives), so it can be
  killed without taking the DDP group down.

Both report through ``dsec.attach()`` (configured from DSEC_* environment variables). The full
zero-touch probe — hooks instead of explicit calls — replaces these calls in a later step.

Run: ``python -m dsec.demo.workload learner|actor`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import gymnasium as gym
import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dsec


def _policy() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))


def _episode(env: gym.Env[Any, Any], policy: nn.Module, gamma: float = 0.99) -> tuple[torch.Tensor, float, int]:
    """One episode; returns (policy-gradient loss, return, length)."""
    obs, _ = env.reset()
    logps, rewards = [], []
    done = False
    while not done:
        logits = policy(torch.as_tensor(obs, dtype=torch.float32))
        dist_ = torch.distributions.Categorical(logits=logits)
        action = dist_.sample()
        logps.append(dist_.log_prob(action))
        obs, reward, terminated, truncated, _ = env.step(int(action))
        rewards.append(float(reward))
        done = terminated or truncated
    returns, g = [], 0.0
    for r in reversed(rewards):
        g = r + gamma * g
        returns.append(g)
    ret = torch.tensor(list(reversed(returns)))
    ret = (ret - ret.mean()) / (ret.std() + 1e-8) if len(ret) > 1 else ret
    loss = -(torch.stack(logps) * ret).sum()
    return loss, sum(rewards), len(rewards)


def _memory_gb() -> float:
    return float(psutil.Process().memory_info().rss) / 2**30


def learner(seconds: float) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234 + rank)
    model = DistributedDataParallel(_policy())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    env = gym.make("CartPole-v1")
    env.reset(seed=rank)
    rep = dsec.attach(role="learner")
    deadline = torch.tensor([time.time() + seconds], dtype=torch.float64)
    dist.broadcast(deadline, src=0)  # every rank stops after the same number of updates
    steps = 0
    try:
        while True:
            t0 = time.perf_counter()
            loss, ret, length = _episode(env, model)
            opt.zero_grad()
            loss.backward()  # DDP all-reduces gradients here
            opt.step()
            t1 = time.perf_counter()
            # An explicit collective, timed: agree on whether to stop, and measure sync latency.
            flag = torch.tensor([1.0 if time.time() < deadline.item() else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            sync_ms = (time.perf_counter() - t1) * 1000
            steps += 1
            if rep is not None:
                rep.observe("step_ms", (t1 - t0) * 1000)
                rep.observe("sync_ms", sync_ms)
                rep.observe("loss", float(loss))
                rep.observe("episode_return", ret)
                rep.observe("episode_length", length)
                rep.inc("steps_total")
                rep.inc("sync_ops_total")
                rep.inc("sync_ok_total")
                rep.gauge("memory_used_gb", _memory_gb())
            if flag.item() == 0.0:
                break
    finally:
        dsec.detach()
        # Teardown order that avoids gloo's rare abort at exit (see NOTES-machine.md).
        del model
        dist.barrier()
        dist.destroy_process_group()
    print(f"learner rank {rank}: {steps} updates", flush=True)
    return 0


def actor(seconds: float) -> int:
    torch.manual_seed(99)
    policy = _policy()
    env = gym.make("CartPole-v1")
    env.reset(seed=99)
    rep = dsec.attach(role="actor")
    end = time.time() + seconds
    with torch.no_grad():
        while time.time() < end:
            _, ret, length = _episode(env, policy)
            if rep is not None:
                rep.observe("episode_return", ret)
                rep.observe("episode_length", length)
                rep.inc("steps_total", length)
                rep.gauge("memory_used_gb", _memory_gb())
            time.sleep(0.01)
    dsec.detach()
    return 0


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    seconds = float(os.environ.get("DSEC_DEMO_SECONDS", "20"))
    role = argv[1] if len(argv) > 1 else "learner"
    if role == "learner":
        return learner(seconds)
    if role == "actor":
        return actor(seconds)
    print(f"unknown role {role!r}: expected learner or actor", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
