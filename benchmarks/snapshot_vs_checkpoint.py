"""Full synchronous checkpoint (torch.save + fsync) vs a DSec snapshot, for a >= 20M-parameter model with Adam.

Same process, same model, same training steps. For each mode (the default quantized level and lossless):
- blocking: how long the training thread is held per snapshot = ``take()`` + any wait at the next optimizer step
  (the snapshot thread reads parameters while forward/backward run); for the checkpoint, the whole save + fsync;
- size: bytes on disk, for the base snapshot and for incrementals taken ``--steps-between`` optimizer steps apart;
- restore: seconds to rebuild the newest snapshot (base + deltas), verify it, and load it into a fresh model and
  optimizer (a fresh store reader; files are in the page cache, as they would be right after a failure on a node);
- step slowdown: median duration of the training step that overlaps a snapshot's read vs a step with none — the
  cost the overlap moves onto the step (two cores are shared between training and the snapshot thread).

Ratios are checkpoint / snapshot (bigger is better). The last stdout line is the JSON result.

    python benchmarks/snapshot_vs_checkpoint.py [--snapshots 10] [--steps-between 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dsec.snapshot import LocalDirStore, Snapshotter


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(512, 2048), torch.nn.Tanh()]
    for _ in range(4):
        layers += [torch.nn.Linear(2048, 2048), torch.nn.Tanh()]
    layers += [torch.nn.Linear(2048, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 512)]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.Adam(model.parameters(), lr=3e-4)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> float:
    x = torch.randn(64, 512, generator=gen)
    y = torch.randn(64, 512, generator=gen)
    t0 = time.perf_counter()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def run_mode(level: int, snapshots: int, steps_between: int, root: Path) -> dict[str, Any]:
    model, opt = build()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        train_step(model, opt, gen)
    store = LocalDirStore(root / f"level{level}")
    snap = Snapshotter(store, "bench", level=level, base_every=snapshots + 1)
    snap.register("model", model)
    snap.register("adam", opt)
    plain_steps: list[float] = []
    overlapped_steps: list[float] = []
    tickets = []
    for _ in range(snapshots):
        for i in range(steps_between):
            (overlapped_steps if i == 0 and tickets else plain_steps).append(train_step(model, opt, gen))
        # Real snapshots are tens of seconds apart: let the previous one finish so each take() starts one.
        snap.wait_idle()
        tickets.append(snap.take())
    expected = {k: v.clone() for k, v in model.state_dict().items()}  # what the last snapshot holds
    overlapped_steps.append(train_step(model, opt, gen))  # the step that overlaps the last snapshot's read
    snap.wait_idle()
    snap.close()
    # Effective cost: the same number of steps with and without a snapshot every `steps_between` steps.
    effective_ms = _effective_cost_ms(
        model,
        opt,
        gen,
        snap_factory=lambda: Snapshotter(
            LocalDirStore(root / f"level{level}-cost"), "cost", level=level, base_every=snapshots + 1
        ),
        snapshots=snapshots,
        steps_between=steps_between,
    )
    stats = [t.stats | {"blocking_ms": t.blocking_s * 1e3} for t in tickets]
    # A fresh process would build the model and optimizer, then restore: do exactly that.
    fresh_model, fresh_opt = build(seed=2)
    train_step(fresh_model, fresh_opt, torch.Generator().manual_seed(3))  # optimizer state exists, as in a job
    reader = Snapshotter(LocalDirStore(store.root), "bench", level=level)
    reader.register("model", fresh_model)
    reader.register("adam", fresh_opt)
    t0 = time.perf_counter()
    report = reader.restore_latest()
    restore_s = time.perf_counter() - t0
    reader.close()
    assert report is not None and report.seq == tickets[-1].seq
    max_err = max((expected[k].float() - v.float()).abs().max().item() for k, v in fresh_model.state_dict().items())
    return {
        "blocking_ms": [s["blocking_ms"] for s in stats],
        "base_bytes": stats[0]["stored_bytes"],
        "delta_bytes": [s["stored_bytes"] for s in stats[1:]],
        "full_bytes": stats[0]["full_bytes"],
        "total_ms": [s["total_ms"] for s in stats],
        "restore_s": restore_s,
        "max_weight_error": max_err,
        "plain_step_ms": statistics.median(plain_steps) * 1e3,
        "overlapped_step_ms": statistics.median(overlapped_steps) * 1e3,
        "effective_ms": effective_ms,
    }


def _effective_cost_ms(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    gen: torch.Generator,
    snap_factory: Any,
    snapshots: int,
    steps_between: int,
) -> float:
    """Wall time per snapshot that training loses: (steps with snapshots - the same steps without) / snapshots,
    with each snapshot allowed to finish in the background before the next is requested."""
    steps = snapshots * steps_between

    def loop(snap: Snapshotter | None) -> float:
        t0 = time.perf_counter()
        for i in range(steps):
            train_step(model, opt, gen)
            if snap is not None and (i + 1) % steps_between == 0:
                snap.take()
        if snap is not None:
            snap.wait_idle()
        return time.perf_counter() - t0

    snap = snap_factory()
    snap.register("model", model)
    snap.register("adam", opt)
    without = loop(None)
    with_snap = loop(snap)
    without = min(without, loop(None))
    snap.close()
    return max(0.0, (with_snap - without) / snapshots * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snapshots", type=int, default=8)
    ap.add_argument("--steps-between", type=int, default=3)
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--level", type=int, default=2, help="the quantized mode measured (default: 2, q8-lite)")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model, opt = build()
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        train_step(model, opt, gen)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-") as tmp:
        root = Path(tmp)
        ckpt_s = [checkpoint(model, opt, root / f"ckpt{i}.pt") for i in range(args.checkpoints)]
        ckpt_bytes = (root / "ckpt0.pt").stat().st_size
        del model, opt
        results = {lvl: run_mode(lvl, args.snapshots, args.steps_between, root) for lvl in (args.level, 0)}
    ckpt_block = statistics.median(ckpt_s)

    def ratios(r: dict[str, Any]) -> dict[str, Any]:
        block = statistics.median(r["blocking_ms"]) / 1e3
        return {
            "blocking_ratio": round(ckpt_block / block, 1),
            "blocking_ratio_worst": round(ckpt_block / (max(r["blocking_ms"]) / 1e3), 1),
            "size_ratio_base": round(ckpt_bytes / r["base_bytes"], 2),
            "size_ratio_incremental": round(ckpt_bytes / statistics.median(r["delta_bytes"]), 2),
            "restore_s": round(r["restore_s"], 3),
            "blocking_ms_median": round(block * 1e3, 2),
            "blocking_ms_max": round(max(r["blocking_ms"]), 2),
            "background_ms_median": round(statistics.median(r["total_ms"]), 1),
            "step_ms_plain": round(r["plain_step_ms"], 1),
            "step_ms_overlapped": round(r["overlapped_step_ms"], 1),
            "max_weight_error": r["max_weight_error"],
            "effective_cost_ms": round(r["effective_ms"], 1),
            "effective_ratio": round(ckpt_block / max(r["effective_ms"] / 1e3, 1e-6), 1),
        }

    quantized, lossless = ratios(results[args.level]), ratios(results[0])
    for name, r in (("quantized", quantized), ("lossless", lossless)):
        print(f"{name:9s} " + " ".join(f"{k}={v}" for k, v in r.items()))
    print(f"checkpoint: {ckpt_bytes / 2**20:.1f} MiB, blocking {ckpt_block * 1e3:.0f} ms (median of {len(ckpt_s)})")
    out = {
        "params": params,
        "level": args.level,
        "steps_between": args.steps_between,
        "checkpoint_blocking_ms": round(ckpt_block * 1e3, 1),
        "checkpoint_bytes": ckpt_bytes,
        **quantized,
        "lossless": lossless,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
