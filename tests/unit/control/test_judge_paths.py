"""The breaker as the control plane runs it, beat by beat on a virtual clock over a real SQLite store: its level
across a restart of the control plane, a store failure on the beat that escalates, and a breaker directive whose
fields are already in force."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ADMIN_TOKEN, make_settings
from dsec.breaker import BreakerConfig
from dsec.control.errors import ApiError
from dsec.control.judge import JudgeConfig
from dsec.control.schemas import HeartbeatRequest, RegisterRequest
from dsec.control.service import ControlPlane
from dsec.control.settings import Settings
from dsec.control.store import EventQuery, StoreError, open_store
from dsec.control.store.sql import SqlStore
from dsec.model import EventType, Pool

# Three samples in a 3 s window make overload; 2 s of calm steps down one level.
BREAKER = BreakerConfig(window_s=3.0, min_samples=3, overload_fraction=0.75, margin=0.2, recovery_s=2.0,
                        max_recovery_s=2.0)  # fmt: skip
DT = 0.5
HOT, CALM = 200.0, 10.0  # ms of sync latency, against the default 85 ms cap


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Worker:
    """One registered worker of ``cp`` that beats on the virtual clock and acks every directive it is sent."""

    def __init__(self, cp: ControlPlane, clock: Clock, worker_id: str, seq: int = 0, acked: int = 1) -> None:
        self.cp, self.clock, self.id, self.seq, self.acked = cp, clock, worker_id, seq, acked

    async def beat(self, latency_ms: float, seq: int | None = None) -> dict[str, Any]:
        """One beat (a new seq unless ``seq`` is given: a retry); the next beat acks what this one was sent."""
        self.clock.now += DT
        if seq is None:
            self.seq += 1
            seq = self.seq
        req = HeartbeatRequest(seq=seq, acked_directive_version=self.acked, metrics={"sync_latency_ms_p50": latency_ms})
        answer = await self.cp.heartbeat(self.cp.state.workers[self.id], req)
        if answer["directive"] is not None:
            self.acked = answer["directive"]["version"]
        return answer

    def breaker(self) -> dict[str, Any]:
        return self.cp.worker_api(self.cp.state.workers[self.id])["breaker"]

    async def beat_until(self, latency_ms: float, done: Any, limit: int = 200) -> list[int]:
        """Beat until ``done(breaker state)``; answers the breaker level after each beat."""
        levels = []
        for _ in range(limit):
            await self.beat(latency_ms)
            levels.append(self.breaker()["level"])
            if done(self.breaker()):
                return levels
        pytest.fail(f"breaker never reached the expected state; levels {levels}")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path, judge=JudgeConfig(breaker=BREAKER))


@pytest.fixture
def stores(settings: Settings) -> Iterator[list[SqlStore]]:
    """Opened stores (one per control plane started on the file), closed at teardown."""
    opened: list[SqlStore] = []
    yield opened
    for s in opened:
        s.close()


async def start(settings: Settings, clock: Clock, stores: list[SqlStore]) -> ControlPlane:
    store = open_store(settings.database_url)
    stores.append(store)
    return ControlPlane(settings, store, clock)


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, stores: list[SqlStore]) -> AsyncIterator[tuple[ControlPlane, Worker]]:
    """A control plane on a virtual clock with one registered worker, closed on exit."""
    clock = Clock()
    cp = await start(settings, clock, stores)
    try:
        yield cp, await new_worker(cp, clock)
    finally:
        cp.close()


async def new_worker(cp: ControlPlane, clock: Clock) -> Worker:
    await cp.put_pool(Pool("pool-a"))
    reg = await cp.register(RegisterRequest(pool="pool-a"), ADMIN_TOKEN)
    return Worker(cp, clock, reg["worker_id"])


async def test_breaker_level_survives_a_control_plane_restart(settings: Settings, stores: list[SqlStore]) -> None:
    clock = Clock()
    cp = await start(settings, clock, stores)
    try:
        w = await new_worker(cp, clock)
        await w.beat_until(HOT, lambda b: b["level"] == 2 and b["phase"] == "open")
        assert cp.state.workers[w.id].directive.fields.grad_accum_steps == 4  # level 2 is in force
    finally:
        cp.close()

    clock.now += 10.0
    again = await start(settings, clock, stores)
    try:
        w2 = Worker(again, clock, w.id, seq=w.seq, acked=w.acked)
        # Before the worker's first beat (the API) and after it (the judged breaker): still level 2, OPEN.
        assert (w2.breaker()["level"], w2.breaker()["phase"]) == (2, "open")
        await w2.beat(CALM)
        assert (w2.breaker()["level"], w2.breaker()["phase"]) == (2, "open")
        levels = await w2.beat_until(CALM, lambda b: b["phase"] == "closed")
        # Calm brings it down one level per acked directive: 2, then 1, then 0, never straight to 0.
        assert [lvl for i, lvl in enumerate(levels) if i == 0 or lvl != levels[i - 1]] == [2, 1, 0]
        downs = again.store.query_events(EventQuery(worker_id=w.id, types=(EventType.BREAKER, EventType.RECOVERED)))
        steps = [(e.data["level_from"], e.data["level_to"]) for e in downs if e.data["action"] == "step_down"]
        assert steps == [(2, 1), (1, 0)]
    finally:
        again.close()


async def test_a_store_failure_on_the_escalating_beat_restores_the_breaker(
    settings: Settings, stores: list[SqlStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    cp = await start(settings, clock, stores)
    store = stores[0]
    write = store.write
    failing = {"on": False}

    def flaky_write(batch: Any) -> list[int]:
        if failing["on"]:
            raise StoreError("database is locked (injected)")
        return write(batch)

    monkeypatch.setattr(store, "write", flaky_write)
    try:
        w = await new_worker(cp, clock)
        # The first beat only starts the breaker (its sample predates the evidence); two more make two samples.
        for _ in range(3):
            await w.beat(HOT)
        assert w.breaker()["phase"] == "closed"
        failing["on"] = True
        with pytest.raises(ApiError) as err:
            await w.beat(HOT)  # the third hot sample: this beat escalates, and its commit fails
        assert err.value.status == 503
        worker = cp.state.workers[w.id]
        # Nothing of the failed beat is in force: the breaker is back where it was, the directive unchanged.
        assert (w.breaker()["phase"], w.breaker()["level"], w.breaker()["meltdowns"]) == ("closed", 0, 0)
        assert (worker.directive.version, worker.last_seq) == (1, 3)
        failing["on"] = False
        answer = await w.beat(HOT, seq=4)  # the worker retries the same beat
        assert answer["duplicate"] is False and answer["directive"]["version"] == 2
        assert answer["directive"]["compression_bits"] == 4  # level 1
        assert (w.breaker()["phase"], w.breaker()["level"], w.breaker()["meltdowns"]) == ("escalating", 1, 1)
        meltdowns = store.query_events(EventQuery(worker_id=w.id, types=(EventType.MELTDOWN,)))
        assert len(meltdowns) == 1, "the retried beat must escalate exactly once"
        (issued,) = store.query_events(EventQuery(worker_id=w.id, types=(EventType.DIRECTIVE_SET,)))
        assert issued.data["by"] == "breaker" and issued.data["version"] == 2  # who made the directive
    finally:
        cp.close()


async def test_a_breaker_directive_equal_to_the_one_in_force_gets_a_new_version(
    settings: Settings, stores: list[SqlStore]
) -> None:
    # An operator already set level 1's fields by hand: the breaker's level-1 patch changes nothing, yet it must
    # be issued as a new version, or the breaker waits forever for an ack of a directive that never existed.
    clock = Clock()
    cp = await start(settings, clock, stores)
    try:
        w = await new_worker(cp, clock)
        await cp.set_directive(cp.state.workers[w.id], {"compression_bits": 4}, actor="api")
        await w.beat(CALM)  # sent version 2
        assert w.acked == 2
        fields_before = cp.state.workers[w.id].directive.fields
        await w.beat_until(HOT, lambda b: b["phase"] == "escalating")
        directive = cp.state.workers[w.id].directive
        assert directive.version == 3 and directive.fields == fields_before
        # Acked, the breaker opens at level 1 and can go on to level 2 under the same overload.
        await w.beat_until(HOT, lambda b: b["level"] == 2)
        assert cp.state.workers[w.id].directive.fields.grad_accum_steps == 4
    finally:
        cp.close()


async def test_a_workers_decision_view_is_kept_until_a_part_of_its_record_changes(
    settings: Settings, stores: list[SqlStore]
) -> None:
    from dataclasses import replace

    from dsec.control.views import view_of
    from dsec.model import Role, WorkerState

    async with running_worker(settings, stores) as (cp, w):
        await w.beat(CALM)
        live = cp.state.workers[w.id]
        first = view_of(live)
        assert view_of(live) is first  # nothing changed: the same view
        assert first.metrics["sync_latency_ms_p50"] == CALM
        await w.beat(HOT)  # a beat swaps the metrics: a new view that sees them
        second = view_of(live)
        assert second is not first and second.metrics["sync_latency_ms_p50"] == HOT
        # A directive change swaps the directive (as directives.py does), with no beat in between.
        live.directive = replace(live.directive, fields=replace(live.directive.fields, compression_bits=4))
        third = view_of(live)
        assert third is not second and third.fields.compression_bits == 4
        live.state = WorkerState.LOST
        assert view_of(live).state is WorkerState.LOST
        live.info = replace(live.info, role=Role.ACTOR)  # role inference swaps the info
        assert view_of(live).role == "actor"


async def test_a_beats_judgment_reuses_the_kept_view_until_who_the_worker_is_or_its_directive_changes(
    settings: Settings, stores: list[SqlStore]
) -> None:
    """A beat's judgment reads the beat's own metrics, so it takes the kept view (``beat_view``) even when the
    metrics have moved on since; a new directive or state makes a new one. The periodic judgments' ``view_of`` still
    sees the latest metrics."""
    from dataclasses import replace

    from dsec.control.views import beat_view, view_of

    async with running_worker(settings, stores) as (cp, w):
        await w.beat(CALM)
        live = cp.state.workers[w.id]
        assert live.view_cache is not None  # the first beat's judgment built one and kept it
        first = live.view_cache[4]
        await w.beat(HOT)
        await w.beat(HOT)
        assert beat_view(live) is first and live.view_cache[4] is first  # metrics moved on: the same view
        now = view_of(live)  # a periodic judgment: the latest metrics
        assert now is not first and now.metrics["sync_latency_ms_p50"] == HOT and live.view_cache[4] is now
        assert beat_view(live) is now
        live.directive = replace(live.directive, fields=replace(live.directive.fields, compression_bits=8))
        changed = beat_view(live)
        assert changed is not now and changed.fields.compression_bits == 8 and changed == view_of(live)


async def test_a_workers_caps_are_kept_until_its_pool_directive_or_safety_floor_changes(
    settings: Settings, stores: list[SqlStore]
) -> None:
    from dataclasses import replace

    from dsec.model import PoolThresholds

    async with running_worker(settings, stores) as (cp, w):
        await w.beat(CALM)
        live, judge = cp.state.workers[w.id], cp.judge
        first = judge.caps_for(live)
        assert judge.caps_for(live) is first and first.latency_ms == PoolThresholds().latency_cap_ms
        # A policy or the API changes the pool: put_pool swaps the frozen Pool.
        await cp.put_pool(replace(cp.state.pools["pool-a"], thresholds=PoolThresholds(latency_cap_ms=40.0)))
        second = judge.caps_for(live)
        assert second.latency_ms == 40.0
        live.directive = replace(live.directive, fields=replace(live.directive.fields, latency_cap_ms=30.0))
        assert judge.caps_for(live).latency_ms == 30.0
        judge.latency_floors["pool-a"] = 55.0  # cap safety lifts the cap over the pool's median
        assert judge.caps_for(live).latency_ms == 55.0
        judge.latency_floors.pop("pool-a")
        assert judge.caps_for(live).latency_ms == 30.0
        # The beat's answer carries the same cap the beat was judged against.
        answer = await w.beat(CALM)
        assert answer["latency_cap_ms"] == 30.0
