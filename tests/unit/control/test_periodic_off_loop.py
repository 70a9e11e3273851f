"""The reconcile pass's fleet and quota judgments off the event loop (``Reconciler._judge_periodic`` from
``OFF_LOOP_WORKERS`` active workers on): the same verdicts as on the loop, the loop answering while they run, and a
worker that leaves meanwhile staying forgotten. Real control planes over real SQLite files, on a virtual clock."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import dsec.control.judge as judge_mod
import dsec.control.reconcile as reconcile_mod
from conftest import ADMIN_TOKEN, make_settings
from dsec import pacing
from dsec.control.cpu_thread import FINE_SWITCH_S
from dsec.control.judge import PeriodicInputs
from dsec.control.schemas import HeartbeatRequest, RegisterRequest
from dsec.control.service import ControlPlane
from dsec.control.store import EventQuery, open_store
from dsec.model import Device, EventType, Pool

RANKS = 8
STRAGGLER = 5  # this rank's steps take twice as long as its peers'


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def make_cp(tmp_path: Path, clock: Clock) -> AsyncIterator[Any]:
    """Control planes (each on its own SQLite file) with one pool of RANKS learners that have beaten twice (a
    straggler among them, memory ramping); closed at teardown."""
    opened: list[tuple[ControlPlane, Any]] = []

    async def make(name: str) -> tuple[ControlPlane, dict[str, int]]:
        settings = make_settings(tmp_path / name)
        store = open_store(settings.database_url)
        cp = ControlPlane(settings, store, clock)
        opened.append((cp, store))
        for d in range(2):
            await cp.put_device(Device(f"gpu{d}", "node-0", memory_gb=80.0))
        await cp.put_pool(Pool("pool-a", memory_base_gb=4.0, memory_ceiling_gb=12.0, devices=("gpu0", "gpu1")))
        ranks = {}
        for rank in range(RANKS):
            reg = await cp.register(RegisterRequest(pool="pool-a", rank=rank, role="learner"), ADMIN_TOKEN)
            ranks[reg["worker_id"]] = rank
        for seq, memory in ((1, 3.0), (2, 3.9)):
            for wid, rank in ranks.items():
                step = 200.0 if rank == STRAGGLER else 100.0 + rank
                metrics = {"step_ms_mean": step, "memory_used_gb": memory + rank / 10}
                req = HeartbeatRequest(seq=seq, acked_directive_version=1, metrics=metrics)
                await cp.heartbeat(cp.state.workers[wid], req)
            clock.now += 1.0
        return cp, ranks

    yield make
    for cp, store in opened:
        cp.close()
        store.close()


def by_rank(cp: ControlPlane, ranks: dict[str, int]) -> dict[str, Any]:
    """What the pass decided, with worker ids (random per control plane) replaced by ranks."""
    j = cp.judge
    return {
        "flags": {ranks[w]: sorted(f) for w, f in j.flags.items()},
        "judged": sorted(ranks[w] for w in j.judged),
        "quota": {ranks[w.id]: w.directive.fields.memory_quota_gb for w in cp.state.workers.values()},
        "trends": {ranks[w]: t for w, t in j.memory_trends.items()},
        "accounting": j.pool_memory["pool-a"],
        "events": sorted(
            (e.type.value, ranks.get(e.worker_id or "", -1), str(e.data.get("kind")), str(e.data.get("feature")))
            for e in cp.store.query_events(EventQuery(types=(EventType.ANOMALY, EventType.ALERT, EventType.QUOTA)))
        ),
    }


async def test_judgments_off_the_loop_decide_what_they_decide_on_it(
    make_cp: Any, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_loop, ranks_a = await make_cp("a")
    off_loop, ranks_b = await make_cp("b")
    ran_on: list[str] = []
    intervals: list[float] = []
    real_run = PeriodicInputs.run

    def run(self: PeriodicInputs) -> Any:
        ran_on.append(threading.current_thread().name)
        intervals.append(sys.getswitchinterval())
        return real_run(self)

    monkeypatch.setattr(PeriodicInputs, "run", run)
    monkeypatch.setattr(reconcile_mod, "OFF_LOOP_WORKERS", 10**9)
    await on_loop.reconcile()
    monkeypatch.setattr(reconcile_mod, "OFF_LOOP_WORKERS", 1)
    await off_loop.reconcile()

    assert ran_on[0] == threading.main_thread().name and ran_on[1] != threading.main_thread().name
    # Off the loop, with finer GIL switching (control/cpu_thread.py); on it, the interval is left as it was.
    assert intervals[0] == sys.getswitchinterval() > FINE_SWITCH_S and intervals[1] <= FINE_SWITCH_S
    a, b = by_rank(on_loop, ranks_a), by_rank(off_loop, ranks_b)
    assert a == b
    assert a["flags"][STRAGGLER] == ["step_ms_mean"]  # the pass did judge: the straggler is flagged...
    assert a["quota"][0] is not None and a["quota"][0] > 4.0  # ...and the ramping workers got grants


async def set_after_a_turn(flag: asyncio.Event | threading.Event) -> None:
    """Another coroutine on the event loop: sets ``flag`` once the loop has given it a turn."""
    await asyncio.sleep(0)
    flag.set()


async def test_judgments_that_give_way_to_requests_decide_the_same(
    make_cp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass off the loop pauses at its checkpoints while a request is in progress (dsec/pacing.py): the pauses
    change when it finishes, never what it decides."""
    plain, ranks_a = await make_cp("a")
    paced, ranks_b = await make_cp("b")
    monkeypatch.setattr(reconcile_mod, "OFF_LOOP_WORKERS", 1)
    await plain.reconcile()
    pauses: list[float] = []
    real_checkpoint = pacing.checkpoint

    def checkpoint() -> float:
        paused = real_checkpoint()
        pauses.append(paused)
        return paused

    monkeypatch.setattr(pacing, "checkpoint", checkpoint)
    monkeypatch.setattr(pacing, "EVERY", 2)  # RANKS workers: a checkpoint every other one
    monkeypatch.setattr(pacing, "MIN_RUN_S", 0.0)
    monkeypatch.setattr(pacing, "MAX_PAUSE_S", 0.01)
    with pacing.request():  # a request in progress for the whole pass
        await paced.reconcile()
    assert sum(1 for p in pauses if p > 0) >= 5  # it did give way, at many points of the pass
    assert by_rank(plain, ranks_a) == by_rank(paced, ranks_b)


async def test_views_built_with_turns_for_the_loop_decide_the_same(
    make_cp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At scale the pass's views are built a chunk at a time with the event loop taking a turn in between
    (``Judge.active_views``): a beat that arrives meanwhile is answered then, not after every view is built. The
    loop really runs between chunks, and the pass decides what one built in a single go decides."""
    whole, ranks_a = await make_cp("a")
    chunked, ranks_b = await make_cp("b")
    monkeypatch.setattr(reconcile_mod, "OFF_LOOP_WORKERS", 10**9)  # views in one go, the pass on the loop
    await whole.reconcile()
    ran_between = asyncio.Event()
    seen: list[bool] = []
    real_view_of = judge_mod.view_of

    def view_of(w: Any) -> Any:
        seen.append(ran_between.is_set())
        return real_view_of(w)

    monkeypatch.setattr(judge_mod, "view_of", view_of)
    monkeypatch.setattr(judge_mod, "VIEW_CHUNK", 3)
    monkeypatch.setattr(reconcile_mod, "OFF_LOOP_WORKERS", 1)
    await asyncio.gather(chunked.reconcile(), set_after_a_turn(ran_between))
    assert seen[:3] == [False] * 3 and seen[-1] is True  # the other coroutine ran after the first chunk
    assert by_rank(whole, ranks_a) == by_rank(chunked, ranks_b)


async def test_the_loop_answers_while_the_judgments_run(make_cp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cp, _ = await make_cp("a")
    answered = threading.Event()
    real_run = PeriodicInputs.run

    def run(self: PeriodicInputs) -> Any:
        # Waits for a coroutine on the event loop: on the loop itself this would wait out the timeout.
        assert answered.wait(timeout=10), "the event loop was blocked while the judgments ran"
        return real_run(self)

    monkeypatch.setattr(PeriodicInputs, "run", run)
    monkeypatch.setattr(reconcile_mod, "OFF_LOOP_WORKERS", 1)
    await asyncio.gather(cp.reconcile(), set_after_a_turn(answered))
    assert answered.is_set()


async def test_a_worker_that_leaves_during_the_judgment_stays_forgotten(make_cp: Any, clock: Clock) -> None:
    cp, ranks = await make_cp("a")
    straggler = next(w for w, r in ranks.items() if r == STRAGGLER)
    inputs = cp.judge.periodic_inputs(clock.now)
    result = inputs.run()  # as on a thread: the loop goes on meanwhile...
    await cp.deregister(cp.state.workers[straggler], "done")  # ...and the straggler leaves (forgotten)
    assert straggler not in cp.judge.flags
    cp.judge.finish_periodic(inputs, result)
    assert result.fleet["pool-a"].flags[straggler] == {"step_ms_mean"}  # it was judged a straggler...
    assert straggler not in cp.judge.flags  # ...but a worker that left is not brought back
    assert cp.judge.flags[next(w for w, r in ranks.items() if r != STRAGGLER)] == set()


@pytest.fixture(autouse=True)
def _no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    # asyncio.to_thread's executor belongs to the test's event loop, which pytest-asyncio closes (and shuts down).
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive() and "asyncio" in t.name]


async def test_a_worker_lost_for_a_moment_keeps_its_memory_trend(make_cp: Any, clock: Clock) -> None:
    """A rank that misses its beats while its memory climbs (a process stalled touching new pages) is marked lost and
    comes back: its memory trend is kept meanwhile, so the next plan sees the climb since its last reading instead of
    a newcomer with no ramp (that hid bursts from the quota plans and from room for bursts)."""
    cp, ranks = await make_cp("lost")
    await cp.reconcile()
    wid = next(w for w, r in ranks.items() if r == 0)
    before = cp.judge.memory_trends[wid]
    clock.now += 30.0  # every rank silent far past lost_after_beats: all marked lost by the next pass
    await cp.reconcile()
    assert cp.state.workers[wid].state.value == "lost" and cp.judge.memory_trends[wid] == before
    w = cp.state.workers[wid]
    req = HeartbeatRequest(seq=3, acked_directive_version=1, metrics={"memory_used_gb": 9.0})
    await cp.heartbeat(w, req)  # back, 6 GB higher
    assert cp.state.workers[wid].state.value == "active"
    clock.now += 2.0
    await cp.reconcile()
    after = cp.judge.memory_trends[wid]
    assert after.used_gb == 9.0 and after.ramp_gb_per_s > 0  # the climb since the reading before the gap
    assert after.peak_gb == 9.0
    # A rank that deregistered is forgotten, trend and all.
    other = next(w for w, r in ranks.items() if r == 1)
    await cp.deregister(cp.state.workers[other], ADMIN_TOKEN)
    clock.now += 2.0
    await cp.reconcile()
    assert other not in cp.judge.memory_trends
