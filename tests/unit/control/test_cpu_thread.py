"""``control/cpu_thread``: the switch interval is finer exactly while CPU-bound work runs off the loop, and is put back
however the work ends and however many such calls overlap."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from conftest import DEFAULT_SWITCH_S
from dsec.control.cpu_thread import FINE_SWITCH_S, finer_switching, run_cpu_bound

DEFAULT = DEFAULT_SWITCH_S
pytestmark = pytest.mark.usefixtures("default_switch_interval")


def test_the_interval_is_finer_inside_and_restored_after() -> None:
    with finer_switching():
        assert sys.getswitchinterval() == pytest.approx(FINE_SWITCH_S, rel=0.05)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT, rel=0.05)


def test_restored_when_the_work_raises() -> None:
    with pytest.raises(RuntimeError), finer_switching():
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == pytest.approx(DEFAULT, rel=0.05)


def test_an_interval_already_finer_is_left_alone() -> None:
    sys.setswitchinterval(FINE_SWITCH_S / 5)
    with finer_switching():
        assert sys.getswitchinterval() == pytest.approx(FINE_SWITCH_S / 5, rel=0.05)
    assert sys.getswitchinterval() == pytest.approx(FINE_SWITCH_S / 5, rel=0.05)


def test_overlapping_blocks_in_two_threads_restore_once_the_last_ends() -> None:
    """A ends before B: a save/restore per block would put A's saved value back while B still runs, or (in the other
    order) leave the fine interval behind for good."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, float] = {}

    def a() -> None:
        with finer_switching():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b() -> None:
        a_in.wait(5)
        with finer_switching():
            b_in.set()
            a_out.wait(5)
            seen["b after a left"] = sys.getswitchinterval()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["b after a left"] == pytest.approx(FINE_SWITCH_S, rel=0.05)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT, rel=0.05)


async def test_run_cpu_bound_runs_off_the_loop_with_the_finer_interval() -> None:
    def work(x: int) -> tuple[str, float, int]:
        return threading.current_thread().name, sys.getswitchinterval(), x * 2

    name, interval, out = await run_cpu_bound(work, 21)
    assert name != threading.main_thread().name
    assert interval == pytest.approx(FINE_SWITCH_S, rel=0.05)
    assert out == 42
    assert sys.getswitchinterval() == pytest.approx(DEFAULT, rel=0.05)


async def test_run_cpu_bound_passes_the_exception_on_and_restores() -> None:
    def work() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await run_cpu_bound(work)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT, rel=0.05)
    await asyncio.sleep(0)
