"""Actor-learner PPO on gymnasium CartPole-v1: separate actor processes sample, one learner process trains.

A plain PyTorch workload with no DSec import (DSec attaches from the outside, ``dsec run``), in the shape of
IMPALA / APPO on one machine (torchbeast's monobeast, RLlib's env runners): ``--actors`` processes each step their
own vectorized CartPole with a copy of the policy and put finished rollouts on a queue; the learner takes rollouts
as they arrive, in any order, and runs a PPO update on each (clipped against the policy that sampled it, so a
rollout a few updates old is still used correctly), then publishes its weights in shared memory, which every actor
loads before its next rollout. No actor waits for another, and the learner waits for whichever actor is next: an
actor that stops sampling (DSec pauses an actor's sampling by holding its ``env.step``) slows the job by its share
of the samples and stalls nobody.

``--actor-steps-per-s`` paces each actor to a fixed env-step rate, standing in for actors that each have a device
of their own: on a small shared machine unpaced actors compete for the same cores, so pausing one would speed the
others up, which no cluster would show. 0 = unpaced.

Training stops when the mean return of the last ``--window`` finished episodes (all actors) reaches
``--target-return``, or at ``--total-steps`` / ``--max-seconds``; the learner then tells the actors to stop. An actor
whose sampling is held cannot hear it: the launching process ends actors that are still running ``--stop-grace-s``
after the learner, as any launcher ends a job's remaining processes. The last stdout line is one JSON object.

    python examples/actor_learner_cartpole.py --actors 4
    dsec run --endpoint URL --sandbox-id POOL -- python examples/actor_learner_cartpole.py --actors 4

gymnasium 1.x vector envs autoreset in NEXT_STEP mode, handled as in examples/ppo_cartpole_ddp.py: the step after an
episode ends is a reset (kept out of the loss), and the last observation's value bootstraps truncated episodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_cartpole_ddp import OBS_DIM, make_agent  # the same 64x64 actor-critic

LEARNER_RANK = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--actors", type=int, default=4, help="actor processes (ranks 1..N; the learner is rank 0)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--target-return", type=float, default=475.0)
    p.add_argument("--window", type=int, default=20, help="finished episodes (all actors together) averaged")
    p.add_argument("--total-steps", type=int, default=400_000, help="env steps over all actors")
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.add_argument("--actor-steps-per-s", type=float, default=1000.0, help="env steps/s per actor; 0 = unpaced")
    p.add_argument("--num-envs", type=int, default=4, help="envs per actor")
    p.add_argument("--num-steps", type=int, default=128, help="rollout length per env")
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--anneal-steps", type=int, default=150_000, help="linear lr decay horizon; 0 = constant lr")
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--stop-grace-s", type=float, default=5.0, help="then actors still running are ended")
    p.add_argument("--log-every", type=int, default=20, help="updates between progress lines (0 = none)")
    args = p.parse_args(argv)
    if args.actors < 1:
        p.error("--actors must be at least 1")
    return args


# -- actor ------------------------------------------------------------------------------------------------------------
def _load(local: nn.Module, shared: nn.Module, lock: Any) -> None:
    with lock, torch.no_grad():
        for dst, src in zip(local.parameters(), shared.parameters(), strict=True):
            dst.copy_(src)


def actor(rank: int, args: argparse.Namespace, shared: nn.Module, version: Any, lock: Any, rollouts: Any,
          stop: Any, go: Any) -> None:  # fmt: skip
    """Sample rollouts with the newest published policy until ``stop`` (from ``go``: the learner is ready, so every
    actor's schedule and the learner's clock start together); each goes on ``rollouts`` as a dict of numpy arrays
    (obs, actions, the sampling policy's log-probs, rewards, terminations, dones, valid steps) with the returns of
    the episodes it finished."""
    torch.set_num_threads(1)
    seed = args.seed * 1000 + rank
    torch.manual_seed(seed)
    local = make_agent()
    loaded = -1
    n_envs, n_steps = args.num_envs, args.num_steps
    envs = gym.make_vec("CartPole-v1", num_envs=n_envs, vectorization_mode="sync")
    obs_np, _ = envs.reset(seed=seed * 100)
    ep_ret = np.zeros(n_envs)
    prev_done = np.zeros(n_envs, dtype=bool)
    # Pacing: one vector step (n_envs env steps) per period, on a schedule that does not drift.
    period = n_envs / args.actor_steps_per_s if args.actor_steps_per_s > 0 else 0.0
    while not go.wait(timeout=0.5):
        if stop.is_set():
            return
    next_at = time.monotonic()
    while not stop.is_set():
        if version.value != loaded:
            loaded = int(version.value)
            _load(local, shared, lock)
        obs_b = np.zeros((n_steps + 1, n_envs, OBS_DIM), dtype=np.float32)
        act_b = np.zeros((n_steps, n_envs), dtype=np.int64)
        logp_b = np.zeros((n_steps, n_envs), dtype=np.float32)
        rew_b = np.zeros((n_steps, n_envs), dtype=np.float32)
        term_b = np.zeros((n_steps, n_envs), dtype=bool)
        done_b = np.zeros((n_steps, n_envs), dtype=bool)
        valid_b = np.ones((n_steps, n_envs), dtype=bool)
        finished: list[float] = []
        with torch.no_grad():
            for t in range(n_steps):
                obs_b[t] = obs_np
                valid_b[t] = ~prev_done
                logits, _ = local(torch.as_tensor(obs_np, dtype=torch.float32))
                action = torch.distributions.Categorical(logits=logits).sample()
                act_b[t] = action.numpy()
                logp_b[t] = torch.log_softmax(logits, -1).gather(-1, action[:, None]).squeeze(-1).numpy()
                if period:
                    next_at += period
                    delay = next_at - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    else:
                        next_at = time.monotonic()  # behind (e.g. sampling was held): no catch-up burst
                obs_np, reward, term, trunc, _ = envs.step(action.numpy())
                done = term | trunc
                rew_b[t], term_b[t], done_b[t] = reward, term, done
                ep_ret += reward
                finished += [float(ep_ret[i]) for i in np.flatnonzero(done)]
                ep_ret[done | prev_done] = 0.0
                prev_done = done
        obs_b[n_steps] = obs_np
        item = {"rank": rank, "version": loaded, "obs": obs_b, "act": act_b, "logp": logp_b, "rew": rew_b,
                "term": term_b, "done": done_b, "valid": valid_b, "returns": finished}  # fmt: skip
        while not stop.is_set():
            try:
                rollouts.put(item, timeout=0.2)
                break
            except queue.Full:
                continue
    # Items this actor queued that nobody will read must not hold its exit (the learner may be gone).
    rollouts.cancel_join_thread()
    envs.close()


# -- learner ----------------------------------------------------------------------------------------------------------
def learner(args: argparse.Namespace, shared: nn.Module, version: Any, lock: Any, rollouts: Any, stop: Any,
            go: Any, results: Any) -> None:  # fmt: skip
    """PPO updates on rollouts as they arrive; publishes the weights after each; sets ``stop`` at the end and puts
    the result dict on ``results``."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    agent = make_agent()
    _load(agent, shared, lock)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    recent: deque[float] = deque(maxlen=args.window)
    env_steps = updates = episodes = 0
    per_actor: dict[int, int] = {}
    lags: list[int] = []
    waited_s = 0.0
    reached = False
    avg_return = float("nan")
    go.set()
    t_start = time.perf_counter()
    while True:
        t_wait = time.perf_counter()
        try:
            item = rollouts.get(timeout=1.0)
        except queue.Empty:
            item = None
        waited_s += time.perf_counter() - t_wait
        elapsed = time.perf_counter() - t_start
        if item is None:
            if elapsed >= args.max_seconds:
                break
            continue
        n_steps, n_envs = item["act"].shape
        env_steps += n_steps * n_envs
        per_actor[item["rank"]] = per_actor.get(item["rank"], 0) + n_steps * n_envs
        lags.append(updates - int(item["version"]))
        for r in item["returns"]:
            recent.append(r)
            episodes += 1
        v_loss = _update(agent, optimizer, gen, item, args, env_steps)
        updates += 1
        with lock, torch.no_grad():
            for dst, src in zip(shared.parameters(), agent.parameters(), strict=True):
                dst.copy_(src)
        version.value = updates
        avg_return = sum(recent) / len(recent) if recent else float("nan")
        reached = len(recent) >= args.window and avg_return >= args.target_return
        elapsed = time.perf_counter() - t_start
        if args.log_every and (updates % args.log_every == 0 or reached):
            print(
                f"update {updates:4d}  env_steps {env_steps:7d}  episodes {episodes:5d}  avg_return "
                f"{avg_return:6.1f}  v_loss {v_loss:8.3f}  lag {lags[-1]}  t {elapsed:6.1f}s",
                flush=True,
            )
        if reached or env_steps >= args.total_steps or elapsed >= args.max_seconds:
            break
    stop.set()
    seconds = time.perf_counter() - t_start
    results.put(
        {
            "reached": bool(reached),
            "avg_return": round(avg_return, 2) if not math.isnan(avg_return) else None,
            "env_steps": env_steps,
            "updates": updates,
            "episodes": episodes,
            "seconds": round(seconds, 2),
            "actors": args.actors,
            "env_steps_by_actor": {str(k): v for k, v in sorted(per_actor.items())},
            "mean_policy_lag": round(sum(lags) / len(lags), 2) if lags else None,
            # Share of the learner's time spent waiting for a rollout: near 1 means the actors bound the job.
            "learner_wait_fraction": round(waited_s / seconds, 3) if seconds > 0 else None,
        }
    )


def _update(agent: nn.Module, optimizer: torch.optim.Optimizer, gen: torch.Generator, item: dict[str, Any],
            args: argparse.Namespace, env_steps: int) -> float:  # fmt: skip
    """GAE with the learner's current critic, then PPO epochs clipped against the sampling policy's log-probs."""
    obs = torch.from_numpy(item["obs"])
    n_steps, n_envs = item["act"].shape
    rew, term = torch.from_numpy(item["rew"]), torch.from_numpy(item["term"])
    done, valid = torch.from_numpy(item["done"]), torch.from_numpy(item["valid"])
    with torch.no_grad():
        _, values = agent(obs.reshape(-1, OBS_DIM))
        values = values.reshape(n_steps + 1, n_envs)
        adv = torch.zeros(n_steps, n_envs)
        last = torch.zeros(n_envs)
        for t in reversed(range(n_steps)):
            delta = rew[t] + args.gamma * values[t + 1] * (~term[t]).float() - values[t]
            last = delta + args.gamma * args.gae_lambda * (~done[t]).float() * last
            last = last * valid[t].float()  # reset steps carry nothing
            adv[t] = last
        ret = adv + values[:n_steps]
    frac = min(1.0, env_steps / args.anneal_steps) if args.anneal_steps > 0 else 0.0
    for group in optimizer.param_groups:
        group["lr"] = args.lr * max(args.min_lr_frac, 1.0 - frac)
    keep = valid.reshape(-1)
    b_obs = obs[:n_steps].reshape(-1, OBS_DIM)[keep]
    b_act = torch.from_numpy(item["act"]).reshape(-1)[keep]
    b_logp = torch.from_numpy(item["logp"]).reshape(-1)[keep]
    b_adv, b_ret = adv.reshape(-1)[keep], ret.reshape(-1)[keep]
    v_loss = torch.zeros(())
    for _ in range(args.update_epochs):
        for mb in torch.tensor_split(torch.randperm(len(b_obs), generator=gen), args.num_minibatches):
            logits, value = agent(b_obs[mb])
            logp = torch.log_softmax(logits, -1).gather(-1, b_act[mb][:, None]).squeeze(-1)
            ratio = (logp - b_logp[mb]).exp()
            mb_adv = (b_adv[mb] - b_adv[mb].mean()) / (b_adv[mb].std(unbiased=False) + 1e-8)
            clipped = ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(-mb_adv * ratio, -mb_adv * clipped).mean()
            v_loss = 0.5 * (value - b_ret[mb]).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            (pg_loss + args.vf_coef * v_loss).backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
    return float(v_loss.detach())


# -- launching --------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = mp.get_context("spawn")
    torch.manual_seed(args.seed)
    shared = make_agent()  # the published weights: the learner's initial ones, in shared memory
    shared.share_memory()
    version, lock = ctx.Value("i", 0), ctx.Lock()
    rollouts = ctx.Queue(maxsize=2 * args.actors)
    results, stop, go = ctx.Queue(), ctx.Event(), ctx.Event()
    procs: list[Any] = []
    world = args.actors + 1
    # RANK/WORLD_SIZE in each child's environment: what a launcher gives its processes (DSec's probe reads them).
    for rank in range(world):
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        if rank == LEARNER_RANK:
            target, extra = learner, (results,)
        else:
            target, extra = actor, ()
        head = (args,) if rank == LEARNER_RANK else (rank, args)
        proc = ctx.Process(
            target=target, args=(*head, shared, version, lock, rollouts, stop, go, *extra), name=f"r{rank}"
        )
        proc.start()
        procs.append(proc)
    for name in ("RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    result: dict[str, Any] | None = None
    try:
        while result is None and procs[LEARNER_RANK].is_alive():
            try:
                result = results.get(timeout=0.5)
            except queue.Empty:
                continue
        if result is None:  # the learner died before reporting
            with contextlib.suppress(queue.Empty):
                result = results.get(timeout=1.0)
    finally:
        stop.set()
        procs[LEARNER_RANK].join(timeout=args.stop_grace_s + 5.0)
        deadline = time.monotonic() + args.stop_grace_s
        ended = []
        for rank, proc in enumerate(procs[1:], start=1):
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():  # e.g. an actor whose sampling is held: it cannot see stop
                proc.terminate()
                proc.join(timeout=5.0)
                ended.append(rank)
        _drain(rollouts)
    if result is None:
        print(json.dumps({"reached": False, "error": f"learner exited {procs[LEARNER_RANK].exitcode}"}), flush=True)
        return 1
    result["actors_ended_by_launcher"] = ended
    print(json.dumps(result), flush=True)
    return 0


def _drain(q: Any) -> None:
    """Empty the rollout queue so its feeder threads can exit (a queue with buffered items blocks interpreter exit)."""
    try:
        while True:
            q.get_nowait()
    except (queue.Empty, OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
