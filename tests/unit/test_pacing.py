"""``dsec.pacing``: a thread that gives way pauses at its checkpoints exactly while a request is in progress, never
longer than the bounds allow, and pacing never changes what the decision core decides."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dsec import pacing
from dsec.control.cpu_thread import run_cpu_bound


def _in_thread(fn: object) -> dict[str, object]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()  # type: ignore[operator]
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out


def test_a_checkpoint_costs_nothing_without_a_request() -> None:
    assert pacing.in_progress() == 0
    with pacing.giving_way():
        assert pacing.checkpoint() == 0.0


def test_a_thread_that_does_not_give_way_never_pauses() -> None:
    """The event loop's own thread, the simulator, a small fleet's pass on the loop: a request in progress must not
    make them sleep (the loop would wait for itself)."""
    with pacing.request():
        assert pacing.checkpoint() == 0.0
        assert _in_thread(pacing.checkpoint)["value"] == 0.0


def test_a_registered_thread_pauses_until_the_request_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pacing, "MAX_PAUSE_S", 20.0)  # only the request's end may end the pause here
    monkeypatch.setattr(pacing, "MIN_RUN_S", 0.0)
    in_pause = threading.Event()
    ended: dict[str, float] = {}

    def background() -> tuple[float, float]:
        with pacing.giving_way():
            in_pause.set()
            paused = pacing.checkpoint()
            return paused, time.perf_counter()

    with pacing.request():
        result: dict[str, object] = {}
        t = threading.Thread(target=lambda: result.update(value=background()))
        t.start()
        assert in_pause.wait(10)
        time.sleep(0.2)  # the background thread is in its pause now
        ended["at"] = time.perf_counter()
    t.join(20)
    paused, returned = result["value"]  # type: ignore[misc]
    assert paused >= 0.15
    assert returned >= ended["at"]  # it did not come back while the request was in progress
    assert returned - ended["at"] < 5.0  # and came back once it ended (a poll is 2 ms; slack for a loaded machine)


def test_a_pause_is_bounded_and_the_thread_then_runs_before_pausing_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that is never idle (ingest at full speed) holds a request in progress all the time: the pass still gets
    on, pausing at most MAX_PAUSE_S at once and computing at least MIN_RUN_S between two pauses."""
    monkeypatch.setattr(pacing, "MAX_PAUSE_S", 0.05)
    monkeypatch.setattr(pacing, "MIN_RUN_S", 0.5)

    def background() -> list[float]:
        with pacing.giving_way():
            first = pacing.checkpoint()  # registered "now": it has not run MIN_RUN_S yet
            time.sleep(0.6)  # stands for computing MIN_RUN_S
            second = pacing.checkpoint()
            third = pacing.checkpoint()  # right after a pause: must not pause again
            return [first, second, third]

    with pacing.request():
        first, second, third = _in_thread(background)["value"]  # type: ignore[misc]
    assert first == 0.0
    assert 0.04 <= second < 2.0  # bounded by MAX_PAUSE_S (slack for sleep overshoot on a loaded machine)
    assert third == 0.0


def test_the_request_marker_is_taken_back_when_the_request_fails() -> None:
    with pytest.raises(RuntimeError), pacing.request():
        assert pacing.in_progress() == 1
        raise RuntimeError("boom")
    assert pacing.in_progress() == 0


def test_paced_keeps_every_item_in_order_with_a_checkpoint_every_n(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    seen: list[int] = []

    def counting() -> float:
        calls.append(len(seen))
        return 0.0

    monkeypatch.setattr(pacing, "checkpoint", counting)
    for x in pacing.paced(range(1000), every=256):
        seen.append(x)
    assert seen == list(range(1000))
    assert calls == [0, 256, 512, 768]


async def test_run_cpu_bound_gives_way_and_stops_giving_way_after() -> None:
    def registered() -> bool:
        return threading.get_ident() in pacing._giving_way

    assert await run_cpu_bound(registered) is True
    assert not pacing._giving_way  # nothing left registered: the pool thread runs other work later
    await asyncio.sleep(0)


def test_a_pass_pauses_no_more_than_its_budget_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """However many checkpoints a pass reaches while requests never stop, its pauses add up to BUDGET_S at most: a
    pass is delayed by a bounded amount, then runs to its end."""
    monkeypatch.setattr(pacing, "MAX_PAUSE_S", 0.03)
    monkeypatch.setattr(pacing, "MIN_RUN_S", 0.0)
    monkeypatch.setattr(pacing, "BUDGET_S", 0.1)

    def background() -> list[float]:
        with pacing.giving_way():
            return [pacing.checkpoint() for _ in range(20)]

    with pacing.request():
        pauses = _in_thread(background)["value"]  # type: ignore[misc]
    assert sum(1 for p in pauses if p > 0) >= 3  # it gave way, more than once...
    assert pauses[-5:] == [0.0] * 5  # ...until the budget was spent, then not at all
    assert sum(pauses) < 0.1 + 0.03 + 0.5  # the last pause is cut to what is left (slack: sleep overshoot)
