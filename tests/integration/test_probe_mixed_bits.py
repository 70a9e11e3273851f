"""The DDP comm hook's averaging on a real 2-rank gloo group (two processes on 127.0.0.1): every rank at its own
level (32/16/8/4 bits), the averaged gradient within the quantization bound of the exact mean at every step, and
error feedback: over many steps the quantization errors cancel instead of adding up."""

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

from dsec.probe.ddp import HEADER_BYTES, chunk_bytes  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ddp_mixed_bits.py"
STEPS = 30
# Mixed levels (all_to_all_single), one quantized level (all_gather), all fp16 (all_reduce in float16).
PAIRS = ((32, 16), (16, 8), (8, 4), (16, 4), (4, 4), (16, 16))
# Half a quantization step relative to the block's absmax: 1/(2*qmax) for 8/4-bit; float16 rounds to 2**-11.
HALF_STEP = {32: 0.0, 16: 2.0**-11, 8: 1 / (2 * 127), 4: 1 / (2 * 7)}


def _fixture_module() -> Any:
    return load_module("ddp_mixed_bits", FIXTURE)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """Both ranks' results for every pair. The test process serves the rendezvous store on a port the OS picked,
    so no port is chosen and released before the ranks bind it."""
    tmp = tmp_path_factory.mktemp("mixed")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    pairs = [f"{a},{b}" for a, b in PAIRS]
    procs = []
    for rank in range(2):
        log = (tmp / f"rank{rank}.log").open("wb")
        cmd = [
            sys.executable,
            str(FIXTURE),
            str(rank),
            str(store.port),
            str(tmp / f"rank{rank}.pt"),
            str(STEPS),
            *pairs,
        ]
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


def _bounds(bits: tuple[int, int], grads: torch.Tensor) -> tuple[float, float]:
    """(per step, cumulative) bounds on |averaged - exact mean| per element. With error feedback rank r sends
    g + e_prev - e_new, |e| <= h_r, so one step is off by at most sum(2 h_r)/2 and the sum over steps by the last
    residuals only, sum(h_r)/2. The 1.5 covers residuals raising the block's absmax and float16 summing."""
    h = [1.5 * HALF_STEP[b] * float(grads[:, r].abs().max()) for r, b in enumerate(bits)]
    return sum(h) + 1e-5, sum(h) / 2 + 1e-4


@pytest.mark.parametrize("bits", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_every_rank_at_its_own_level_averages_within_the_quantization_bound(
    results: list[dict[str, Any]], bits: tuple[int, int]
) -> None:
    fx = _fixture_module()
    key = f"{bits[0]},{bits[1]}"
    r0, r1 = results[0][key], results[1][key]
    assert torch.equal(r0["outputs"], r1["outputs"]), "the ranks must apply the same averaged gradient"
    # The levels change together, at the second step, on both ranks (agreed through the first step's headers).
    assert r0["peer_bits"] == r1["peer_bits"] == [[32, 32]] + [list(bits)] * (STEPS - 1)
    grads = torch.stack([torch.stack([fx.gradient(r, t) for r in range(2)]) for t in range(STEPS)])
    exact = grads.mean(dim=1)
    err = r0["outputs"] - exact
    assert float(err[0].abs().max()) <= 1e-6  # the first step: float32 for everyone
    per_step, cumulative = _bounds(bits, grads)
    worst = float(err[1:].abs().max())
    assert worst <= per_step, f"step error {worst:.3g} > bound {per_step:.3g}"
    if bits != (16, 16):  # all-fp16 goes through all_reduce, which carries no error feedback
        drift = float(err[1:].sum(dim=0).abs().max())
        assert drift <= cumulative, f"errors added up over {STEPS - 1} steps: {drift:.3g} > {cumulative:.3g}"
        # Each rank uploads its own level's payload (plus the header), not its peer's.
        for rank, r in enumerate((r0, r1)):
            assert set(r["sent"][1:]) == {HEADER_BYTES + chunk_bytes(fx.NUMEL, bits[rank])}
