"""The demo's actor process: samples CartPole-v1 episodes with a small random-initialised policy.

Plain PyTorch + gymnasium with no DSec import: the demo starts it under ``dsec run``, so the probe sees
its environment steps and episodes through gymnasium's ``make``. It can be killed at any time (it takes
part in no collective), which is how the demo shows a worker going ``lost``.

Run: ``python -m dsec.demo.workload [seconds] [--stop-file F] [--pause S] [--learn]`` (``--pause``: seconds to sleep
after each step, for actors that must leave the machine to the learners; it stops early once ``F`` exists;
``--learn``: a small learner instead — the policy fitted to fixed targets by optimizer steps, no environment — for the
scenes that need optimizer steps and snapshots without the PPO job).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gymnasium as gym
import torch
from torch import nn


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsec.demo.workload")
    ap.add_argument("seconds", nargs="?", type=float, default=20.0)
    ap.add_argument("--stop-file", type=Path, default=None)
    ap.add_argument("--pause", type=float, default=0.0)
    ap.add_argument("--learn", action="store_true")
    args = ap.parse_args(argv[1:])
    seconds = args.seconds
    torch.set_num_threads(1)
    torch.manual_seed(99)
    policy = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
    if args.learn:
        return _learn(policy, time.time() + seconds, args.pause, args.stop_file)
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=99)
    end = time.time() + seconds
    with torch.no_grad():
        while time.time() < end:
            logits = policy(torch.as_tensor(obs, dtype=torch.float32))
            action = int(torch.distributions.Categorical(logits=logits).sample())
            obs, _, terminated, truncated, _ = env.step(action)
            if args.pause:
                time.sleep(args.pause)
            if terminated or truncated:
                obs, _ = env.reset()
                time.sleep(0.01)  # an actor shares the machine with the learners
                if args.stop_file is not None and args.stop_file.exists():
                    break
    return 0


def _learn(policy: nn.Module, end: float, pause: float, stop_file: Path | None) -> int:
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    x, y = torch.randn(256, 4), torch.randn(256, 2)
    while time.time() < end and not (stop_file is not None and stop_file.exists()):
        opt.zero_grad()
        nn.functional.mse_loss(policy(x), y).backward()
        opt.step()
        time.sleep(pause)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
