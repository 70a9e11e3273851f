"""What a paused actor costs: time-to-target-return of an actor-learner job with some of its actors' sampling paused.

The simulator (``dsec.sim.engine``, docs/simulator.md) values a group's step as the mean of its workers'
contributions, a paused worker's being 0: pausing k of a group's n workers (learner included) costs k/n of its
progress. This benchmark measures the cost on a real workload: ``examples/actor_learner_cartpole.py`` (one learner
process, ``--actors`` actor processes, each actor paced to a fixed env-step rate as if it had a device of its own)
runs under ``dsec run`` (the zero-touch probe, registered with a control plane in a child process), roles inferred,
over the same seeds in each configuration:

=========  ==========================================================================================================
none       no directive: every actor samples
pausedK    ``async_sampling: false`` for actor ranks 1..K, set through the control plane's admin API as soon as each
           registers; the probe holds the actor's ``env.step`` from its first step as an inferred actor
           (``DSEC_ROLE_ACTOR_STEPS`` env steps, 256 here) to the end of the run
=========  ==========================================================================================================

Per run: the learner's seconds and env steps until the mean return of the last 20 finished episodes reaches the
target (the example's stop rule), updates, how many env steps each actor contributed (a paused actor's stop at the
inference threshold plus at most one rollout: ``paused_env_steps``, checked), the mean policy lag, and the share of
the learner's time spent waiting for rollouts (near 1: the actors bound the job, as the simulator's model assumes).

Per paused configuration, against ``none`` (seed by seed, then medians):
- ``progress_ratio`` = median(none seconds) / median(paused seconds): the share of the job's progress per second
  that is left while K actors are paused — the quantity the simulator's contribution model sets;
- ``sample_efficiency`` = median(none env steps) / median(paused env steps): learning per sample (fewer actors
  also means less policy lag);
- the two models it is compared with: ``model_mean_of_workers`` = (n - K) / n over the group's n = actors + 1
  workers (the simulator's), and ``model_actor_share`` = (actors - K) / actors (progress proportional to samples);
- ``paired_ratios``, ``sign_test_p``, ``ci90`` (bootstrap of the seconds ratio) as in calibrate_efficiency.py.

    python benchmarks/calibrate_paused.py [--seeds 1,2,3,4,5] [--actors 4] [--configs none,paused1,paused2]
    python benchmarks/calibrate_paused.py --quick     # smoke: 1 seed, low target
    python benchmarks/calibrate_paused.py --seeds 6,7,8,9,10 --runs-out runs.jsonl   # then, all sittings together:
    python benchmarks/calibrate_paused.py --summarize runs.jsonl

Wall time is the measure here, so run it on a quiet machine (one run at a time); the actors' pacing keeps the CPU
they need well under the machine's (4 x 1,000 env steps/s is ~10% of a core for the envs and the policy). The last
stdout line is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXAMPLE = REPO / "examples" / "actor_learner_cartpole.py"
BASELINE = "none"
ACTOR_STEPS_FOR_ROLE = 256

sys.path.insert(0, str(HERE))
from calibrate_efficiency import sign_test_p  # noqa: E402


# -- pure parts (unit-tested) ---------------------------------------------------------------------------------------
def paused_count(config: str) -> int:
    """``none`` -> 0, ``pausedK`` -> K; anything else is a ValueError naming it."""
    if config == BASELINE:
        return 0
    if config.startswith("paused") and config[6:].isdigit() and int(config[6:]) > 0:
        return int(config[6:])
    raise ValueError(f"unknown configuration {config!r}: expected 'none' or 'pausedK' (K >= 1)")


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def ratio_ci(
    base: Sequence[float], config: Sequence[float], n: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """5th-95th percentile of median(base) / median(config) over bootstrap resamples of each side."""
    if not base or not config:
        return None
    rng = random.Random(seed)
    out = sorted(
        statistics.median(rng.choices(list(base), k=len(base)))
        / statistics.median(rng.choices(list(config), k=len(config)))
        for _ in range(n)
    )
    return out[int(0.05 * (n - 1))], out[int(0.95 * (n - 1))]


def summarize(runs: Sequence[Mapping[str, Any]], actors: int) -> dict[str, dict[str, Any]]:
    """Per configuration from run records {"config", "seed", "reached", "seconds", "env_steps", ...}; only runs that
    reached the target enter the ratios (``not_reached`` counts the others)."""
    by: dict[str, dict[int, Mapping[str, Any]]] = {}
    for r in runs:
        by.setdefault(str(r["config"]), {})[int(r["seed"])] = r
    base = {s: r for s, r in by.get(BASELINE, {}).items() if r["reached"]}
    base_s = [float(r["seconds"]) for r in base.values()]
    base_steps = [float(r["env_steps"]) for r in base.values()]
    out: dict[str, dict[str, Any]] = {}
    for config, per_seed in sorted(by.items()):
        k = paused_count(config)
        ok = {s: r for s, r in per_seed.items() if r["reached"]}
        secs = [float(r["seconds"]) for r in ok.values()]
        steps = [float(r["env_steps"]) for r in ok.values()]
        row: dict[str, Any] = {
            "paused_actors": k,
            "seeds": sorted(per_seed),
            "not_reached": len(per_seed) - len(ok),
            "median_seconds": _round(_median(secs)),
            "median_env_steps": _round(_median(steps), 0),
            "median_updates": _round(_median([float(r["updates"]) for r in ok.values()]), 1),
            "median_policy_lag": _round(_median([float(r["mean_policy_lag"]) for r in ok.values()])),
            "median_learner_wait_fraction": _round(_median([float(r["learner_wait_fraction"]) for r in ok.values()])),
        }
        if k:
            paired = [round(float(base[s]["seconds"]) / float(r["seconds"]), 3) for s, r in ok.items() if s in base]
            ci = ratio_ci(base_s, secs)
            med_s, med_steps = _median(secs), _median(steps)
            row.update(
                progress_ratio=_round(statistics.median(base_s) / med_s if base_s and med_s else None),
                sample_efficiency=_round(
                    statistics.median(base_steps) / med_steps if base_steps and med_steps else None
                ),
                model_mean_of_workers=round((actors + 1 - k) / (actors + 1), 3),
                model_actor_share=round((actors - k) / actors, 3),
                paired_ratios=paired,
                sign_test_p=_round(sign_test_p(paired)),
                ci90=[round(x, 3) for x in ci] if ci else None,
                pauses_held=all(r.get("pause_held") for r in per_seed.values()),
            )
        out[config] = row
    return out


def _round(x: float | None, nd: int = 3) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


# -- running ---------------------------------------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_one(admin: Any, url: str, config: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    k = paused_count(config)
    pool = f"pause-{config}-s{seed}-{int(time.time() * 1000) % 10**8}"
    admin.put_pool(pool)
    token = admin.create_token(pool, label="calibrate_paused")
    from _common import dsec_run_env

    env = dsec_run_env(
        DSEC_HEARTBEAT_INTERVAL=str(args.heartbeat),
        DSEC_ROLE_ACTOR_STEPS=str(ACTOR_STEPS_FOR_ROLE),
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        sys.executable, "-m", "dsec.cli", "run", "--endpoint", url, "--sandbox-id", pool, "--token", token, "--",
        sys.executable, str(EXAMPLE), "--actors", str(args.actors), "--seed", str(seed),
        "--target-return", str(args.target_return), "--total-steps", str(args.total_steps),
        "--max-seconds", str(args.max_seconds), "--actor-steps-per-s", str(args.actor_steps_per_s),
        "--log-every", "0",
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    paused_ids: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60.0
        while k and len(paused_ids) < k and proc.poll() is None and time.monotonic() < deadline:
            for w in admin.workers(pool=pool):
                rank = int(w.get("rank") or 0)
                if 1 <= rank <= k and rank not in paused_ids:
                    admin.set_directive(w["id"], async_sampling=False)
                    paused_ids[rank] = w["id"]
            time.sleep(0.05)
        out, err = proc.communicate(timeout=args.max_seconds + 120)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"{config} seed {seed}: exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}")
    result = json.loads(lines[-1])
    by_actor = {int(r): int(n) for r, n in (result.get("env_steps_by_actor") or {}).items()}
    rollout = 128 * 4  # the example's default rollout (num_steps x num_envs)
    paused_steps = {r: by_actor.get(r, 0) for r in range(1, k + 1)}
    # Held: every paused actor delivered at most the rollouts it finished before its probe saw it as an actor.
    limit = (math.ceil(ACTOR_STEPS_FOR_ROLE / rollout) + 1) * rollout
    held = len(paused_ids) == k and all(n <= limit for n in paused_steps.values())
    return {
        "config": config,
        "seed": seed,
        "reached": bool(result.get("reached")),
        "seconds": result.get("seconds"),
        "env_steps": result.get("env_steps"),
        "updates": result.get("updates"),
        "mean_policy_lag": result.get("mean_policy_lag"),
        "learner_wait_fraction": result.get("learner_wait_fraction"),
        "env_steps_by_actor": by_actor,
        "paused_env_steps": paused_steps,
        "pause_held": held if k else None,
        "actors_ended_by_launcher": result.get("actors_ended_by_launcher"),
        "wall_s": round(time.monotonic() - t0, 1),
        "exit_code": proc.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--configs", default="none,paused1,paused2")
    ap.add_argument("--actors", type=int, default=4)
    ap.add_argument("--actor-steps-per-s", type=float, default=1000.0)
    ap.add_argument("--target-return", type=float, default=475.0)
    ap.add_argument("--total-steps", type=int, default=400_000)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--heartbeat", type=float, default=0.2, help="probe heartbeat interval (s): directive latency")
    ap.add_argument("--quick", action="store_true", help="smoke: seed 1, target 60")
    from _common import ServerProcess, add_run_record_options, admin_client, append_run_record, read_run_records

    add_run_record_options(ap)
    args = ap.parse_args(argv)
    if args.summarize:
        recorded = read_run_records(args.summarize)
        seeds = sorted({int(r["seed"]) for r in recorded})
        print(json.dumps(_report(args, seeds, recorded, None)))
        return 0
    if args.quick:
        args.seeds, args.target_return, args.max_seconds = "1", 60.0, 120.0
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        try:
            if paused_count(c) >= args.actors:
                ap.error(f"--configs: {c} pauses every actor (--actors {args.actors})")
        except ValueError as exc:
            ap.error(f"--configs: {exc}")
    runs: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with ServerProcess(admin_token="dsa_bench_calibrate_paused") as server:
        admin = admin_client(server)
        try:
            for seed in seeds:  # seed-major, configurations interleaved: a load change touches all of them
                for config in configs:
                    rec = run_one(admin, server.url, config, seed, args)
                    runs.append(rec)
                    append_run_record(args.runs_out, rec)
                    _log(
                        f"{config:>8} seed {seed}: reached {rec['reached']} {rec['seconds']}s "
                        f"env_steps {rec['env_steps']} by actor {rec['env_steps_by_actor']} "
                        f"lag {rec['mean_policy_lag']} wait {rec['learner_wait_fraction']} held {rec['pause_held']}"
                    )
        finally:
            admin.close()
    print(json.dumps(_report(args, seeds, runs, round(time.monotonic() - t0, 1))))
    return 0


def _report(args: argparse.Namespace, seeds: list[int], runs: list[dict[str, Any]], wall_s: float | None) -> dict:
    """The last stdout line: the settings, the per-configuration summary and every run record."""
    return {
        "benchmark": "calibrate_paused",
        "example": "examples/actor_learner_cartpole.py",
        "actors": args.actors,
        "actor_steps_per_s": args.actor_steps_per_s,
        "target_return": args.target_return,
        "seeds": seeds,
        "configs": summarize(runs, args.actors),
        "runs": runs,
        "wall_s": wall_s,
    }


if __name__ == "__main__":
    sys.exit(main())
