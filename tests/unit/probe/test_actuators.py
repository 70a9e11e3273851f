"""Actuators: which directive fields are in force at once, which wait for a safe point, and the
sampling switch, precision and memory reporting."""

from __future__ import annotations

import threading
import time

import pytest

from dsec.probe.actuators import Actuators


def test_without_gradient_exchange_everything_is_in_force_at_once() -> None:
    a = Actuators(default_bits=8)
    assert a.handle({"version": 2, "compression_bits": 4, "grad_accum_steps": 4}) is True
    assert (a.effective_bits, a.effective_accum) == (4, 4)
    # 32 is uncompressed even though this probe's default is 8
    assert a.handle({"version": 3, "compression_bits": 32}) is True
    assert a.effective_bits == 32
    # null (or no field at all) is the configured default
    assert a.handle({"version": 4, "compression_bits": None}) is True
    assert a.effective_bits == 8
    assert a.handle({"version": 5}) is True
    assert a.effective_bits == 8


@pytest.mark.parametrize("default", [8, 4])
def test_directive_32_is_uncompressed_whatever_the_default_and_null_is_the_default(default: int) -> None:
    a = Actuators(default_bits=default)
    a.collective_users = 1  # a DDP hook exchanges gradients: the change waits for the safe point
    assert a.handle({"version": 2, "compression_bits": 32}) is False
    assert a.declare() == (32, 1)  # what the hook sends: float32, no quantization
    a.confirm(32, 1)
    assert a.handle({"version": 3, "compression_bits": None}) is False
    assert a.declare() == (default, 1)


def test_collective_fields_wait_for_the_safe_point_and_are_acked_there() -> None:
    acked: list[int] = []
    a = Actuators(ack=acked.append)
    a.collective_users = 1
    assert a.handle({"version": 5, "compression_bits": 4}) is False
    assert a.declare() == (4, 1)
    a.confirm(32, 1)  # the group has not switched yet
    assert acked == []
    a.confirm(4, 2)  # switched; the group accumulates at least what was asked
    assert acked == [5]
    assert a.state()["compression_bits"] == 4 and a.state()["grad_accum_steps"] == 2


def test_user_comm_hook_locks_collective_fields() -> None:
    a = Actuators()
    a.collective_users = 1
    a.collectives_locked = True
    assert a.handle({"version": 2, "compression_bits": 4}) is False
    assert a.declare() == (32, 1)


def test_async_sampling_pause_and_resume() -> None:
    a = Actuators()
    changes: list[bool] = []
    a.on_sampling_change(changes.append)
    a.handle({"version": 2, "async_sampling": False})
    assert not a.sampling_allowed() and changes == [False]
    resumed = threading.Event()

    def sampler() -> None:
        a.wait_for_sampling()
        resumed.set()

    t = threading.Thread(target=sampler)
    t.start()
    time.sleep(0.1)
    assert not resumed.is_set(), "a paused sampler waits"
    a.handle({"version": 3, "async_sampling": True})
    t.join(timeout=5)
    assert resumed.is_set() and changes == [False, True]
    assert a.state()["async_sampling"] == 1.0


def test_precision_autocast_and_memory_quota_reporting() -> None:
    torch = pytest.importorskip("torch")
    a = Actuators()
    a.handle({"version": 2, "precision": "bf16", "memory_quota_gb": 7.0, "memory_ceiling_gb": 12.0})
    with a.autocast("cpu"):
        y = torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3))
    assert y.dtype == torch.bfloat16
    a.handle({"version": 3, "precision": "fp32", "memory_quota_gb": 7.0})
    with a.autocast("cpu"):
        assert torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.float32
    assert a.state()["memory_quota_gb"] == 7.0
    assert a.memory_fraction_applied is None  # no CUDA here: the quota is reported, not enforced
