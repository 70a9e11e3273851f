"""The stand-in for a shared card's memory (dsec.probe.fake_card): allocations fail in the allocating process only,
at its allocator limit or at the card's memory; a dead process's memory is released; the probe raises the failure
into the training code at an optimizer step, as CUDA's allocator would."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dsec.probe.fake_card import CardSpec, FakeCard, FakeCardError
from dsec.probe.runtime import Probe


def card(tmp_path: Path, pid: int, limits: str = "obey", memory_gb: float = 80.0) -> FakeCard:
    return FakeCard(CardSpec.parse(f"path={tmp_path / 'card0'},memory_gb={memory_gb},limits={limits}"), pid=pid)


def test_growth_past_the_allocator_limit_fails_and_changes_nothing(tmp_path: Path) -> None:
    me = card(tmp_path, os.getpid())
    me.hold(14.0, limit_gb=20.0)
    with pytest.raises(torch.OutOfMemoryError, match=r"allocator limit is 20\.00 GiB"):
        me.hold(21.0, limit_gb=20.0)
    assert me.held_gb == 14.0 and me.used_gb() == 14.0 and me.ooms == 1
    me.hold(20.0, limit_gb=20.0)  # up to the limit is fine
    assert me.used_gb() == 20.0


def test_an_allocator_nobody_caps_grows_into_the_card(tmp_path: Path) -> None:
    me = card(tmp_path, os.getpid(), limits="ignore")
    me.hold(60.0, limit_gb=20.0)
    assert me.used_gb() == 60.0
    with pytest.raises(torch.OutOfMemoryError, match="the card has 80 GiB"):
        me.hold(81.0, limit_gb=None)


def test_a_full_card_fails_the_process_that_allocates_and_only_it(tmp_path: Path) -> None:
    neighbour = card(tmp_path, os.getppid())  # a live process other than this one
    me = card(tmp_path, os.getpid())
    neighbour.hold(60.0, limit_gb=None)
    me.hold(14.0, limit_gb=None)
    with pytest.raises(torch.OutOfMemoryError, match=r"74\.00 GiB held"):
        me.hold(24.0, limit_gb=None)  # 60 + 24 > 80, though well under any limit
    assert me.held_gb == 14.0
    assert neighbour.held_gb == 60.0 and me.used_gb() == 74.0  # the neighbour keeps what it holds


def test_shrinking_always_works_even_above_a_lowered_limit(tmp_path: Path) -> None:
    me = card(tmp_path, os.getpid())
    me.hold(30.0, limit_gb=None)
    me.hold(25.0, limit_gb=10.0)  # a lower limit frees nothing and fails nothing that does not grow
    assert me.used_gb() == 25.0
    with pytest.raises(torch.OutOfMemoryError):
        me.hold(26.0, limit_gb=10.0)


def test_a_dead_process_memory_is_released(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = card(tmp_path, child.pid)
    dead.hold(70.0, limit_gb=None)
    me = card(tmp_path, os.getpid())
    me.hold(70.0, limit_gb=None)  # the row of the dead pid is dropped on this allocation
    assert me.used_gb() == 70.0


def test_processes_share_the_card_through_the_file(tmp_path: Path) -> None:
    spec = f"path={tmp_path / 'card0'},memory_gb=10"
    code = (
        "import sys, time\n"
        "from dsec.probe.fake_card import FakeCard\n"
        f"c = FakeCard.from_env({spec!r})\n"
        "c.hold(8.0, None)\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        me = FakeCard.from_env(spec)
        assert me is not None
        with pytest.raises(torch.OutOfMemoryError):
            me.hold(3.0, None)
        me.hold(2.0, None)
    finally:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()
    deadline = time.time() + 5
    while True:  # the child is gone: its 8 GB are free again
        try:
            me.hold(9.0, None)
            break
        except torch.OutOfMemoryError:
            assert time.time() < deadline
            time.sleep(0.05)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("memory_gb=80", "path is required"),
        ("path=/tmp/x", "memory_gb is required"),
        ("path=/tmp/x,memory_gb=0", "memory_gb='0' must be a finite number > 0"),
        ("path=/tmp/x,memory_gb=nan", "memory_gb='nan' must be a finite number"),
        ("path=/tmp/x,memory_gb=8,base_gb=9", "base_gb=9 exceeds memory_gb=8"),
        ("path=/tmp/x,memory_gb=8,limits=maybe", "limits='maybe' must be 'obey' or 'ignore'"),
        ("path=/tmp/x,memory_gb=8,size=3", "'size=3': expected key=value"),
        ("path=/tmp/x,memory_gb=8,memory_gb=9", "'memory_gb' given twice"),
    ],
)
def test_a_malformed_spec_names_the_key(spec: str, fragment: str) -> None:
    with pytest.raises(FakeCardError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        CardSpec.parse(spec)


# -- in the probe: an optimizer step of the training code ---------------------------------------------------
@pytest.fixture
def make_probe(tmp_path: Path, torch_probe: Callable[[dict[str, str | None]], Probe]) -> Callable[[int], Probe]:
    """A probe on a 16 GB card (base 4 GB) whose injected memory growth saturates at ``max_mb`` within ~0.2 s."""

    def make(max_mb: int) -> Probe:
        return torch_probe({"DSEC_FAKE_CARD": f"path={tmp_path / 'card0'},memory_gb=16,base_gb=4",
                            "DSEC_CHAOS": f"memory_growth_mb_per_s=100000,max_mb={max_mb}"})  # fmt: skip

    return make


def _step(opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


def _grow_to_max(p: Probe) -> None:
    assert p.chaos is not None
    p.chaos.poll(lambda _: None)  # the growth starts
    time.sleep(0.3)
    p.chaos.poll(lambda _: None)  # 100 GB/s for 0.3 s: at max_mb


def test_growth_is_held_on_the_card_and_reported_not_touched_in_host_memory(make_probe: Callable[[int], Probe]) -> None:
    probe = make_probe(4096)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(opt, model)
    assert probe.memory_source() == {"memory_used_gb": 4.0}  # the base, held from the first step on
    assert probe.chaos is not None and probe.chaos.touch_pages is False
    _grow_to_max(probe)
    assert probe.chaos.ballast_mb == 4096 and probe.chaos._ballast == []  # no host pages
    _step(opt, model)
    assert probe.memory_source() == {"memory_used_gb": 8.0}


def test_the_training_code_sees_an_oom_at_the_step_that_outgrows_the_card(make_probe: Callable[[int], Probe]) -> None:
    probe = make_probe(20480)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(opt, model)
    _grow_to_max(probe)
    before = model.weight.detach().clone()
    with pytest.raises(torch.OutOfMemoryError, match="the card has 16 GiB"):
        _step(opt, model)  # 4 + 20 GB > 16
    assert torch.equal(model.weight, before)  # the failed step changed nothing
    assert probe.memory_source() == {"memory_used_gb": 4.0}


def test_the_allocator_limit_of_the_directive_is_the_process_cap(make_probe: Callable[[int], Probe]) -> None:
    probe = make_probe(1)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe.actuators.memory_quota_gb = 3.0  # a grant below the base: the first step already fails
    with pytest.raises(torch.OutOfMemoryError, match=r"allocator limit is 3\.00 GiB"):
        _step(opt, model)
    probe.actuators.memory_limit_gb = 8.0  # the limit above the grant is what the allocator may take
    _step(opt, model)
    assert probe.memory_source() == {"memory_used_gb": 4.0}


def test_a_new_worker_may_fill_its_working_set_past_its_grant_before_the_first_quota_plan(
    tmp_path: Path, torch_probe: Callable[[dict[str, str | None]], Probe]
) -> None:
    # The directive registration hands out (DirectiveFields.for_pool), applied before the first step: a process whose
    # working set (9 GB) is above the pool's base grant (7) but under its ceiling (12) trains on. Its allocator limit
    # was the grant until the first quota plan before 2026-12-06, and such a process failed at once (the demo's
    # restarted learner, one run in three).
    from dsec.model import Directive, DirectiveFields, Pool

    probe = torch_probe({"DSEC_FAKE_CARD": f"path={tmp_path / 'card0'},memory_gb=80,base_gb=9",
                         "DSEC_CHAOS": "memory_growth_mb_per_s=100000,max_mb=1024"})  # fmt: skip
    fields = DirectiveFields.for_pool(Pool("p", memory_base_gb=7.0, memory_ceiling_gb=12.0))
    probe.actuators.handle(Directive("w", 1, fields, 0.0).to_dict())
    assert probe.actuators.allocator_limit_gb() == 12.0
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(opt, model)
    _grow_to_max(probe)
    _step(opt, model)  # 9 + 1 GB, still under the ceiling
    assert probe.memory_source() == {"memory_used_gb": 10.0}
