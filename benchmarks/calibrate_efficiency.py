"""Efficiency discounts from real runs: time-to-target-return of the PPO example under the probe's gradient settings.

The simulator (``dsec.sim.scenario.Efficiency``) discounts the progress of a worker whose gradients travel at 4 bits
(``compressed_4bit``) or are accumulated x4 (``accumulated``). This benchmark measures what those settings cost per
sample on a real workload: ``examples/ppo_cartpole_ddp.py`` (plain PyTorch DDP over gloo on 127.0.0.1, 2 ranks)
runs under ``dsec run`` (the zero-touch probe, registered with a control plane in a child process) in each
configuration, over the same seeds:

============  =========================================================================================
uncompressed  DSEC_COMPRESSION_BITS=32 (the product default)
8bit          DSEC_COMPRESSION_BITS=8: blockwise 8-bit, error feedback on (the probe's DDP comm hook)
4bit          DSEC_COMPRESSION_BITS=4: blockwise 4-bit, error feedback on
accum4        grad_accum_steps=4, uncompressed: a directive set through the control plane's admin API as soon
              as both ranks have registered (every worker gets directive version 1 with grad_accum_steps=1 when
              it registers, so an environment default would be overridden at once). The benchmark checks after
              the run that the probe's optimizer-step count is the one accumulation from the first update gives
              (``accum_from_start``); a run where the directive arrived late is flagged, not hidden.
============  =========================================================================================

Per run: env steps (over both ranks) until the mean return of the last 20 finished episodes reaches the target
(the example's own stop rule), PPO updates (rollouts), optimizer steps (the probe's ``updates_total`` of rank 0),
wall seconds (secondary: the machine is shared). Per configuration: median, min and max env steps to target over
the seeds; runs that did not reach the target within ``--total-steps`` count as needing more than the limit (they
sort last for the median) and are reported in ``not_reached``; ``efficiency`` = median(uncompressed steps) /
median(config steps) (< 1: less learning per sample). How far to trust it, against the seed-to-seed spread:
``paired_ratios`` (uncompressed steps / config steps, seed by seed), ``sign_test_p`` (two-sided exact sign test of
those ratios against 1: under "the setting makes no difference" either run of a seed is as likely to be faster),
``efficiency_ci90`` (5th-95th percentile of the efficiency over 2,000 bootstrap resamples of each configuration's
seeds, fixed RNG seed) and ``separated`` (the two ranges of steps do not overlap). ``resolved`` = sign_test_p < 0.05
and the 90% interval excludes 1: only then is the measured efficiency different from 1 beyond the spread.

Not calibrated here: the paused-actor fraction. The example has no separate actor processes: each rank collects its
own rollouts and learns from them in the same process, so there is no actor whose sampling the breaker could pause
while the learner goes on; pausing sampling would stop the learner too. It needs a workload with separate actors.

    python benchmarks/calibrate_efficiency.py [--seeds 1,2,3,4,5] [--target-return 475] [--total-steps 400000]
    python benchmarks/calibrate_efficiency.py --quick     # smoke: 1 seed, low target, tiny step limit

Run it under ``nice -n 19`` on a shared machine: one run (two ranks) at a time. The last stdout line is one JSON
object; progress goes to stderr.
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
EXAMPLE = REPO / "examples" / "ppo_cartpole_ddp.py"
BASELINE = "uncompressed"
# name -> (DSEC_COMPRESSION_BITS, grad_accum_steps)
CONFIGS: dict[str, tuple[int, int]] = {
    "uncompressed": (32, 1),
    "8bit": (8, 1),
    "4bit": (4, 1),
    "accum4": (32, 4),
}
WORLD_SIZE = 2


# -- pure parts (unit-tested) ---------------------------------------------------------------------------------------
def median_steps(steps: Sequence[int | None]) -> float:
    """Median env steps to target; a run that never reached it (None) counts as +inf (it needed more than the
    limit), so the median is finite only while fewer than half the runs failed. NaN when empty."""
    if not steps:
        return float("nan")
    return float(statistics.median(math.inf if s is None else float(s) for s in steps))


def efficiency(base_median: float, config_median: float) -> float | None:
    """median(uncompressed) / median(config): 1 = as much learning per sample; None when either is not finite."""
    if not (math.isfinite(base_median) and math.isfinite(config_median)) or config_median <= 0:
        return None
    return base_median / config_median


def sign_test_p(ratios: Sequence[float]) -> float | None:
    """Two-sided exact sign test of paired ratios against 1 (ties dropped); None without a pair."""
    above = sum(1 for r in ratios if r > 1.0)
    below = sum(1 for r in ratios if r < 1.0)
    n = above + below
    if n == 0:
        return None
    k = min(above, below)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def bootstrap_ci(
    base: Sequence[int | None], config: Sequence[int | None], n: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """5th and 95th percentile of ``efficiency`` over resamples (with replacement) of each configuration's runs; a
    resample whose config median is not finite counts as efficiency 0 (and one whose baseline median is not finite
    as +inf). None when either side is empty."""
    if not base or not config:
        return None
    rng = random.Random(seed)
    effs: list[float] = []
    for _ in range(n):
        b = median_steps(rng.choices(list(base), k=len(base)))
        c = median_steps(rng.choices(list(config), k=len(config)))
        effs.append(0.0 if not math.isfinite(c) else (math.inf if not math.isfinite(b) else b / c))
    effs.sort()
    return effs[int(0.05 * (n - 1))], effs[int(0.95 * (n - 1))]


def summarize(runs: Sequence[Mapping[str, Any]], baseline: str = BASELINE) -> dict[str, dict[str, Any]]:
    """Per configuration, from run records {"config", "seed", "reached", "env_steps", ...}.

    ``steps_to_target`` per seed (None: not reached); ``median``/``min``/``max`` over the reached runs' steps
    (``median`` treats unreached runs as +inf, see ``median_steps``; None where it is not finite); ``not_reached``;
    ``efficiency`` against ``baseline``; ``paired_ratios`` (baseline steps / config steps for each seed both reached,
    an unreached config run counting as ratio 0); ``sign_test_p``; ``efficiency_ci90``; ``separated`` (the reached
    ranges do not overlap, and no run of either failed); ``resolved`` (sign_test_p < 0.05 and the interval
    excludes 1)."""
    by_config: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        by_config.setdefault(str(r["config"]), []).append(r)
    steps_of = {
        c: {int(r["seed"]): (int(r["env_steps"]) if r["reached"] else None) for r in rs} for c, rs in by_config.items()
    }
    base = steps_of.get(baseline, {})
    base_med = median_steps(list(base.values()))
    out: dict[str, dict[str, Any]] = {}
    for c, per_seed in steps_of.items():
        seeds = sorted(per_seed)
        steps = [per_seed[s] for s in seeds]
        reached = [s for s in steps if s is not None]
        med = median_steps(steps)
        eff = efficiency(base_med, med)
        paired = [
            round(base[s] / per_seed[s], 3) if per_seed[s] is not None else 0.0  # type: ignore[operator]
            for s in seeds
            if base.get(s) is not None
        ]
        base_reached = [s for s in base.values() if s is not None]
        p = sign_test_p(paired) if c != baseline else None
        ci = bootstrap_ci(list(base.values()), steps) if c != baseline else None
        separated = (
            c != baseline
            and bool(reached)
            and bool(base_reached)
            and len(reached) == len(steps)
            and len(base_reached) == len(base)
            and (min(reached) > max(base_reached) or max(reached) < min(base_reached))
        )
        rs = by_config[c]
        out[c] = {
            "seeds": seeds,
            "steps_to_target": steps,
            "median": med if math.isfinite(med) else None,
            "min": min(reached) if reached else None,
            "max": max(reached) if reached else None,
            "not_reached": len(steps) - len(reached),
            "efficiency": round(eff, 3) if eff is not None else None,
            "paired_ratios": paired,
            "sign_test_p": round(p, 4) if p is not None else None,
            "efficiency_ci90": [round(x, 3) for x in ci] if ci is not None else None,
            "separated": separated,
            "resolved": p is not None and p < 0.05 and ci is not None and (ci[0] > 1.0 or ci[1] < 1.0),
            "median_updates": _median_of(rs, "updates"),
            "median_optimizer_steps": _median_of(rs, "optimizer_steps"),
            "median_seconds": _median_of(rs, "seconds"),
        }
    return out


def _median_of(runs: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Median of ``key`` over the runs that reached the target and report it."""
    vals = [float(r[key]) for r in runs if r.get("reached") and r.get(key) is not None]
    return round(float(statistics.median(vals)), 2) if vals else None


def expected_optimizer_steps(updates: int, update_epochs: int, num_minibatches: int, accum: int) -> int:
    """Optimizer steps of a run whose accumulation was in force from its first backward pass."""
    return updates * (update_epochs * num_minibatches // accum)


# -- running ---------------------------------------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_one(admin: Any, url: str, config: str, seed: int, args: argparse.Namespace, timeout_s: float) -> dict[str, Any]:
    bits, accum = CONFIGS[config]
    pool = f"cal-{config}-s{seed}-{int(time.time() * 1000) % 10**8}"
    admin.put_pool(pool)
    token = admin.create_token(pool, label="calibrate_efficiency")
    from _common import dsec_run_env

    env = dsec_run_env(
        GLOO_SOCKET_IFNAME="lo",
        DSEC_COMPRESSION_BITS=str(bits),
        DSEC_HEARTBEAT_INTERVAL=str(args.heartbeat),
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        sys.executable, "-m", "dsec.cli", "run", "--endpoint", url, "--sandbox-id", pool, "--token", token,
        "--role", "learner", "--",
        sys.executable, str(EXAMPLE), "--world-size", str(WORLD_SIZE), "--seed", str(seed),
        "--target-return", str(args.target_return), "--total-steps", str(args.total_steps),
        "--max-seconds", str(args.max_seconds), "--log-every", "0",
        "--update-epochs", str(args.update_epochs), "--num-minibatches", str(args.num_minibatches),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    directive_at_s: float | None = None
    try:
        if accum > 1:
            deadline = time.monotonic() + 60.0
            while proc.poll() is None and time.monotonic() < deadline:
                workers = admin.workers(pool=pool)
                if len(workers) >= WORLD_SIZE:
                    for w in workers:
                        admin.set_directive(w["id"], grad_accum_steps=accum)
                    directive_at_s = round(time.monotonic() - t0, 2)
                    break
                time.sleep(0.05)
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    wall = time.monotonic() - t0
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"{config} seed {seed}: exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}")
    if proc.returncode != 0:
        # The example prints its result after training ended and the ranks compared weights: the measurement
        # stands; what failed was the teardown. Kept, with the exit status in the record.
        _log(f"{config} seed {seed}: exit {proc.returncode} after its result line; kept\n{err[-2000:]}")
    result = json.loads(lines[-1])
    # The probe's own view (the last beat, sent when the worker deregisters): what was in force, optimizer steps.
    metrics = {int(w.get("rank") or 0): w.get("metrics") or {} for w in admin.workers(pool=pool)}
    m0 = metrics.get(0, {})
    opt_steps = m0.get("updates_total")
    expected = expected_optimizer_steps(int(result["updates"]), args.update_epochs, args.num_minibatches, accum)
    held = (
        all(m.get("compression_bits") == bits and m.get("grad_accum_steps") == accum for m in metrics.values())
        and len(metrics) == WORLD_SIZE
    )
    rec = {
        "config": config,
        "seed": seed,
        "compression_bits": bits,
        "grad_accum_steps": accum,
        "reached": bool(result["reached"]),
        "env_steps": int(result["env_steps"]),
        "updates": int(result["updates"]),
        "optimizer_steps": int(opt_steps) if opt_steps is not None else None,
        "expected_optimizer_steps": expected,
        "accum_from_start": opt_steps is not None and int(opt_steps) == expected,
        "settings_held": held,
        "avg_return": result.get("avg_return"),
        "seconds": result.get("seconds"),
        "wall_s": round(wall, 1),
        "directive_at_s": directive_at_s,
        "replica_max_abs_diff": result.get("replica_max_abs_diff"),
        "exit_code": proc.returncode,
    }
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated; the same seeds in every configuration")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    ap.add_argument("--target-return", type=float, default=475.0, help="the example's default")
    ap.add_argument("--total-steps", type=int, default=400_000, help="env steps limit per run (both ranks)")
    ap.add_argument("--max-seconds", type=float, default=420.0, help="the example's wall limit per run")
    ap.add_argument("--update-epochs", type=int, default=8, help="the example's default")
    ap.add_argument("--num-minibatches", type=int, default=4, help="the example's default")
    ap.add_argument("--heartbeat", type=float, default=0.2, help="probe heartbeat interval (s): directive latency")
    ap.add_argument("--quick", action="store_true", help="smoke: seed 1, target 40, 8192 steps")
    sys.path.insert(0, str(HERE))
    from _common import ServerProcess, add_run_record_options, admin_client, append_run_record, read_run_records

    add_run_record_options(ap)
    args = ap.parse_args(argv)
    if args.summarize:
        print(json.dumps(report(read_run_records(args.summarize), args, None)))
        return 0
    if args.quick:
        args.seeds, args.target_return, args.total_steps, args.max_seconds = "1", 40.0, 8192, 120.0
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}")

    runs: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with ServerProcess(admin_token="dsa_bench_calibrate_admin") as server:
        admin = admin_client(server)
        try:
            # Seed-major, configurations interleaved: a change in the machine's load touches every configuration.
            for seed in seeds:
                for config in configs:
                    rec = run_one(admin, server.url, config, seed, args, timeout_s=args.max_seconds + 120)
                    runs.append(rec)
                    _log(
                        f"{config:>12} seed {seed}: reached {rec['reached']} env_steps {rec['env_steps']} "
                        f"updates {rec['updates']} optimizer_steps {rec['optimizer_steps']} "
                        f"(expected {rec['expected_optimizer_steps']}) held {rec['settings_held']} "
                        f"{rec['seconds']}s"
                    )
                    append_run_record(args.runs_out, rec)
        finally:
            admin.close()
    print(json.dumps(report(runs, args, round(time.monotonic() - t0, 1))))
    return 0


def report(runs: Sequence[Mapping[str, Any]], args: argparse.Namespace, wall_s: float | None) -> dict[str, Any]:
    """The last stdout line: the settings, the per-configuration summary and every run record."""
    return {
        "benchmark": "calibrate_efficiency",
        "example": "examples/ppo_cartpole_ddp.py",
        "world_size": WORLD_SIZE,
        "target_return": args.target_return,
        "total_steps_limit": args.total_steps,
        "seeds": sorted({int(r["seed"]) for r in runs}),
        "baseline": BASELINE,
        "configs": summarize(runs),
        "runs": list(runs),
        "all_settings_held": all(r["settings_held"] for r in runs),
        "all_accum_from_start": all(r["accum_from_start"] for r in runs),
        "paused_actor_fraction": "not calibrated: the example has no separate actor processes",
        "wall_s": wall_s,
    }


if __name__ == "__main__":
    sys.exit(main())
