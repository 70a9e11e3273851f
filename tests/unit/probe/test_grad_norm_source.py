"""Where the reported gradient norm comes from: the training code's own clip_grad_norm_ when it clips the
synchronized gradient (the comm hook then skips its pass over the buckets), the hook's when it does not."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from dsec.probe.runtime import Probe  # noqa: E402


@pytest.fixture
def learner(offline_probe: Probe) -> Iterator[tuple[Probe, Any, Any]]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    offline_probe._install_torch(torch)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 8))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        yield offline_probe, model, opt
    finally:
        offline_probe.torch.uninstall()
        dist.destroy_process_group()


def _true_norm(model: Any) -> float:
    return float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])))


def _step(model: Any, opt: Any, clip: Any = None) -> float:
    """One step; answers the norm of the synchronized gradient the optimizer applied."""
    opt.zero_grad()
    model(torch.randn(16, 32)).pow(2).sum().backward()
    norm = _true_norm(model)
    if clip is not None:
        clip(model.parameters())
    opt.step()
    return norm


def test_a_clipping_learner_reports_the_clip_norm_and_the_hook_skips_its_own(learner: tuple[Probe, Any, Any]) -> None:
    probe, model, opt = learner
    clip = torch.nn.utils.clip_grad_norm_  # the probe's wrapper (installed before this lookup)

    want = _step(model, opt, lambda ps: clip(ps, 1e9))
    (coord,) = probe.torch.coordinators  # installed at the model's first forward
    assert probe.telemetry._grad_norm_last == pytest.approx(want, rel=1e-5)
    assert coord.norm_from_clip  # told after the first clipped step

    want = _step(model, opt, lambda ps: clip(ps, 1e9))
    assert coord.grad_norm is None  # the hook did not compute it
    assert probe.telemetry._grad_norm_last == pytest.approx(want, rel=1e-5)

    # The code stops clipping: that step's norm still comes from the gradient (the optimizer's), and the hook
    # computes it again from the next step on.
    want = _step(model, opt)
    assert probe.telemetry._grad_norm_last == pytest.approx(want, rel=1e-5)
    assert not coord.norm_from_clip
    want = _step(model, opt)
    assert coord.grad_norm == pytest.approx(want, rel=1e-5)
    assert probe.telemetry._grad_norm_last == pytest.approx(want, rel=1e-5)


def test_a_clip_by_another_norm_is_not_taken_for_the_gradient_norm(learner: tuple[Probe, Any, Any]) -> None:
    probe, model, opt = learner
    clip = torch.nn.utils.clip_grad_norm_
    for _ in range(2):
        want = _step(model, opt, lambda ps: clip(ps, 1e9, norm_type=float("inf")))
        (coord,) = probe.torch.coordinators
        assert not coord.norm_from_clip
        assert probe.telemetry._grad_norm_last == pytest.approx(want, rel=1e-5)  # the hook's Euclidean norm
