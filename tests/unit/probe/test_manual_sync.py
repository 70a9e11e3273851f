"""Recognising hand-written gradient all-reduces (probe/manual_sync.py) in a one-rank gloo group in this process:
what counts as gradient sync, what it sends at each level, and which directive fields are answered unappliable."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from dsec.probe.actuators import Actuators  # noqa: E402
from dsec.probe.ddp import HEADER_BYTES, chunk_bytes  # noqa: E402
from dsec.probe.manual_sync import ManualSync  # noqa: E402
from dsec.probe.telemetry import Telemetry  # noqa: E402


def _setup() -> tuple[ManualSync, Any, torch.nn.Module, list[tuple[Any, ...]]]:
    answered: list[tuple[Any, ...]] = []
    actuators = Actuators(unappliable=lambda *a: answered.append(a))
    probe = SimpleNamespace(
        actuators=actuators,
        telemetry=Telemetry(),
        config=SimpleNamespace(block_size=256, error_feedback=True),
        chaos=None,
        event=lambda *a, **k: None,
    )
    manual = ManualSync(probe, dist)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4))
    model.opt = torch.optim.SGD(model.parameters(), lr=0.1)  # held by the script (the probe holds it weakly)
    manual.add_optimizer(model.opt)
    return manual, probe, model, answered


def _backward(manual: ManualSync, model: torch.nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    model(torch.randn(8, 32)).pow(2).sum().backward()
    manual.on_backward()


def test_what_counts_as_gradient_sync(one_rank_group: None) -> None:
    manual, _, model, _ = _setup()
    params = list(model.parameters())
    assert manual.recognise((torch.zeros(3),), {}) is None  # before any backward
    _backward(manual, model)
    assert manual.recognise((params[0].grad,), {}) is not None
    assert manual.recognise((params[0].grad.data,), {}) is not None  # same storage
    flat = torch.cat([p.grad.view(-1) for p in params])
    assert manual.recognise((flat,), {"op": dist.ReduceOp.SUM}) is not None
    assert manual.recognise((flat,), {"op": dist.ReduceOp.MAX}) is None  # not an average
    assert manual.recognise((torch.zeros(5),), {}) is None  # a stats tensor
    assert manual.recognise((flat.long(),), {}) is None
    manual.on_step()
    assert manual.recognise((params[0].grad,), {}) is None  # after the step: a plain collective


def test_levels_bytes_and_results(one_rank_group: None) -> None:
    manual, probe, model, answered = _setup()
    tel = probe.telemetry
    numel = sum(p.numel() for p in model.parameters())

    def step(bits_expected: int | None = None) -> tuple[int, torch.Tensor, torch.Tensor]:
        _backward(manual, model)
        flat = torch.cat([p.grad.view(-1) for p in model.parameters()])
        want = flat.clone()
        before = tel.sync_bytes_total
        work = manual.all_reduce(dist.all_reduce, (flat,), {"async_op": True})
        work.wait()
        manual.on_step()
        return tel.sync_bytes_total - before, flat, want

    sent, got, want = step()
    assert sent > numel * 4 and torch.equal(got, want)  # float32 plus the header slots, sum of one rank = itself
    probe.actuators.handle({"version": 2, "compression_bits": 4})
    for _ in range(2):
        step()
    sent, got, want = step()
    assert sent == HEADER_BYTES + chunk_bytes(numel, 4)
    assert probe.actuators.effective_bits == 4
    assert float((got - want).abs().max()) < 0.2 * float(want.abs().max())
    # Per-parameter, sync form: every parameter's gradient goes through at the group's level.
    _backward(manual, model)
    before = tel.sync_ops_total
    for p in model.parameters():
        manual.all_reduce(dist.all_reduce, (p.grad,), {})
    assert tel.sync_ops_total - before == len(list(model.parameters()))
    assert answered == []

    probe.actuators.handle({"version": 3, "compression_bits": 4, "grad_accum_steps": 2})
    assert [(v, f) for v, f, _, _ in answered] == [(3, "grad_accum_steps")]
    assert probe.actuators.declare() == (4, 1)


def test_half_precision_gradients_are_measured_not_compressed(one_rank_group: None) -> None:
    manual, probe, model, answered = _setup()
    probe.actuators.handle({"version": 2, "compression_bits": 8})
    _backward(manual, model)
    flat = torch.cat([p.grad.view(-1) for p in model.parameters()]).to(torch.bfloat16)
    manual.all_reduce(dist.all_reduce, (flat,), {})
    assert probe.telemetry.sync_ops_total == 1
    assert [(v, f) for v, f, _, _ in answered] == [(2, "compression_bits")]
