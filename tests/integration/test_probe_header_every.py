"""The sync header every Nth step (ddp.py): on a real 2-rank gloo group training a 3-bucket DDP model, directives
reaching the ranks at different steps still change the levels on both ranks at the same step, the synced gradients
stay bit-identical across ranks and equal to the mean of the ranks' local gradients, and the steps between headers
send the bare gradient (no slots) while every bucket is still counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from conftest import load_module

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from dsec.probe import sync_header as sh  # noqa: E402
from dsec.probe.ddp import HEADER_BYTES, chunk_bytes  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ddp_header_every.py"
STEPS = 14


def _fixture_module() -> Any:
    return load_module("ddp_header_every", FIXTURE)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("header_every")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(2):
        log = (tmp / f"rank{rank}.log").open("wb")
        cmd = [sys.executable, str(FIXTURE), str(rank), str(store.port), str(tmp / f"rank{rank}.pt"), str(STEPS)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    try:
        for rank, p in enumerate(procs):
            assert p.wait(timeout=90) == 0, (tmp / f"rank{rank}.log").read_text()[-3000:]
    finally:
        for p in procs:  # a rank stuck in a collective: its whole process group goes
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    yield [torch.load(tmp / f"rank{rank}.pt") for rank in range(2)]
    del store


def test_levels_change_on_both_ranks_at_the_same_step_at_a_header_step(results: list[dict[str, Any]]) -> None:
    fx = _fixture_module()
    assert fx.HEADER_EVERY == 3 and fx.ASK == (2, 7)
    r0, r1 = results
    assert r0["peer_bits"] == r1["peer_bits"]
    # Headers (32-bit all_reduce path) at steps 0 and 3: rank 0's wish (asked before step 2) rides step 3's header
    # and takes effect at step 4 on both ranks. Mixed levels go through the byte path, which carries the header at
    # every step: rank 1's wish (before step 7) rides step 7 and takes effect at step 8.
    assert r0["peer_bits"] == [[32, 32]] * 4 + [[16, 32]] * 4 + [[16, 16]] * (STEPS - 8)
    assert r0["syncs"] == r1["syncs"] == STEPS


def test_gradients_are_identical_across_ranks_and_the_mean_of_the_local_ones(results: list[dict[str, Any]]) -> None:
    r0, r1 = results
    assert torch.equal(r0["synced"], r1["synced"]), "the ranks must apply the same averaged gradient"
    mean = (r0["local"] + r1["local"]) / 2
    err = (r0["synced"] - mean).abs().amax(dim=1)
    scale = mean.abs().amax(dim=1)
    assert float(err[:4].max()) <= 1e-6  # float32 for everyone (headers at steps 0 and 3, none at 1 and 2)
    assert float((err[4:] / scale[4:]).max()) <= 2e-3  # a float16 rank: within float16 rounding


def test_steps_without_a_header_send_the_bare_gradient_and_every_bucket_counts(results: list[dict[str, Any]]) -> None:
    r0, r1 = results
    numel = r0["synced"].shape[1]
    # sync_ops_total counts every bucket. DDP's first step runs one bucket (its first-bucket cap is 1 MiB); after
    # it rebuilds the buckets with the fixture's small cap.
    buckets = r0["buckets"][1]
    assert r0["buckets"] == r1["buckets"] == [1] + [buckets] * (STEPS - 1), r0["buckets"]
    assert buckets >= 2
    slots32 = 2 * sh.slots_per_rank(32) * 4
    slots16 = 2 * sh.slots_per_rank(16) * 2
    for rank, r in enumerate(results):
        sent = r["sent"]
        assert sent[0] == sent[3] == numel * 4 + slots32  # header steps
        assert sent[1] == sent[2] == numel * 4  # between headers: the gradient alone
        # Byte path (steps 4-7): every bucket's chunk carries the 32-byte header; rank 0 sends float16, rank 1 float32.
        # (Non-last buckets between headers went through the in-place path, the last one alone carried slots.)
        assert sent[4] == buckets * HEADER_BYTES + chunk_bytes(numel, 16 if rank == 0 else 32)
        # All at 16 bits (all_reduce in float16): header at steps 10 and 13 (every 3rd since the header at step 7).
        assert [s - numel * 2 for s in sent[8:]] == [0, 0, slots16, 0, 0, slots16]
