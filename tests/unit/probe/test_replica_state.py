"""Shipping a replica's live state over a real 2-rank gloo group (two threads, an in-memory store): the receiver
ends bit-identical (weights, Adam state, hyper-parameters, LR scheduler); a transfer damaged on the way is refused
before anything is applied."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from dsec.probe.replica_state import TransferError, apply, capture, recv, send  # noqa: E402


def _replica(seed: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model: Any, opt: Any, sched: Any, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()


class _Corrupting:
    """A faithful stand-in around the real process group that flips one byte of the largest message it sends."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg

    def send(self, tensors: list[Any], dst: int, tag: int) -> Any:
        t = tensors[0]
        if t.numel() > 1000:
            t = t.clone()
            t[t.numel() // 2] ^= 1
        return self.pg.send([t], dst, tag)


def _pair(fn0: Any, fn1: Any) -> list[Any]:
    store = dist.HashStore()
    out: list[Any] = [None, None]

    def run(rank: int, fn: Any) -> None:
        pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
        try:
            out[rank] = fn(pg)
        except Exception as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r, f)) for r, f in ((0, fn0), (1, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_the_receiver_ends_bit_identical() -> None:
    src, dst = _replica(0), _replica(1)
    _train(*src, steps=5)
    dst[1].param_groups[0]["lr"] = 0.5  # the replacement's own (wrong) settings
    state = capture([src[0]], [src[1]], [src[2]], {"steps": 5})
    sent, got = _pair(lambda pg: send(state, pg, [1]), lambda pg: recv(pg, 0))
    assert isinstance(sent, int) and sent > 0, sent
    apply(got, [dst[0]], [dst[1]], [dst[2]])
    for a, b in zip(src[0].parameters(), dst[0].parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = src[1].state_dict(), dst[1].state_dict()
    assert sa["param_groups"][0]["lr"] == sb["param_groups"][0]["lr"]
    for k in sa["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][k][key], sb["state"][k][key])
    assert src[2].state_dict()["last_epoch"] == dst[2].state_dict()["last_epoch"]
    # Training on together from here gives the same weights on both.
    torch.manual_seed(3)
    _train(*src, steps=2)
    torch.manual_seed(3)
    _train(*dst, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(src[0].parameters(), dst[0].parameters(), strict=True))


def test_a_damaged_transfer_is_refused_and_nothing_is_applied() -> None:
    src, dst = _replica(0), _replica(1)
    _train(*src, steps=3)
    before = [p.detach().clone() for p in dst[0].parameters()]
    state = capture([src[0]], [src[1]], [src[2]], {})
    _, got = _pair(lambda pg: send(state, _Corrupting(pg), [1]), lambda pg: recv(pg, 0))
    assert isinstance(got, TransferError) and "fingerprint" in str(got)
    assert all(torch.equal(a, b) for a, b in zip(before, dst[0].parameters(), strict=True))
