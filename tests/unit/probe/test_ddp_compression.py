"""What the DDP comm hook sends for a directive's compression_bits: null is the probe's configured default,
32 is uncompressed float32 even when that default is 8 (a one-rank gloo group in this process)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from dsec.probe.actuators import Actuators  # noqa: E402
from dsec.probe.ddp import HEADER_BYTES, SyncCoordinator, chunk_bytes  # noqa: E402
from dsec.probe.telemetry import Telemetry  # noqa: E402
from dsec.probe.torch_targets import unannotated  # noqa: E402


def _ddp_with_probe(default_bits: int) -> tuple[Actuators, Callable[[], int], int]:
    """(actuators, one training step answering the bytes it handed to the backend, parameter count)."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    actuators, telemetry = Actuators(default_bits=default_bits), Telemetry()
    model.register_comm_hook(None, unannotated(SyncCoordinator(actuators, telemetry, header_every=1).hook))

    def step() -> int:
        before = telemetry.sync_bytes_total
        model(torch.randn(4, 64)).sum().backward()
        return telemetry.sync_bytes_total - before

    return actuators, step, sum(p.numel() for p in model.parameters())


def _settle(step: Callable[[], int]) -> int:
    # A change takes effect at a cycle start once the group has seen every rank's header: two steps later (with the
    # header at every step, as here; the default's later switch is test_probe_header_every's).
    for _ in range(2):
        step()
    return step()


def test_directive_32_sends_uncompressed_and_null_sends_the_default_8(one_rank_group: None) -> None:
    actuators, step, numel = _ddp_with_probe(default_bits=8)
    eight_bit = HEADER_BYTES + chunk_bytes(numel, 8)
    assert step() == eight_bit  # no directive yet: the configured default

    actuators.handle({"version": 2, "compression_bits": 32})
    uncompressed = _settle(step)
    assert uncompressed >= numel * 4  # float32 payload (plus the header's slots)
    assert actuators.effective_bits == 32

    actuators.handle({"version": 3, "compression_bits": None})
    assert _settle(step) == eight_bit
    assert actuators.effective_bits == 8
