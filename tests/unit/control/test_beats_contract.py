"""The worker protocol's decisions as the control plane makes them (control/beats.py, control/directives.py), in
process over a real SQLite store on a virtual clock: who may register where, what a beat that must not be applied
gets, what a beat records (rejoin, ack, role, the worker's own events), the answer, and directive versions.

Written against mutation testing's survivors (docs/testing.md): each test pins a decision that a one-token change of
those modules would alter; no server is started, so a mutant runs in about a second."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ADMIN_TOKEN, make_settings
from dsec.control.directives import directive_from
from dsec.control.errors import ApiError
from dsec.control.schemas import HeartbeatRequest, RegisterRequest
from dsec.control.service import ControlPlane
from dsec.control.state import LiveWorker
from dsec.control.store import EventQuery, WriteBatch, open_store
from dsec.decide import Verdict
from dsec.model import Device, Event, EventType, Pool, Role, WorkerState

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


async def _plane(tmp_path: Path, clock: Clock, **overrides: Any) -> AsyncIterator[ControlPlane]:
    settings = make_settings(tmp_path, **overrides)
    store = open_store(settings.database_url)
    cp = ControlPlane(settings, store, clock)
    try:
        await cp.put_pool(Pool("pool-a"))
        await cp.put_pool(Pool("pool-b", devices=("gpu-b",)))
        yield cp
    finally:
        cp.close()
        store.close()


@pytest.fixture
async def cp(tmp_path: Path, clock: Clock) -> AsyncIterator[ControlPlane]:
    async for plane in _plane(tmp_path, clock, max_metrics_per_worker=3, worker_events_burst=4,
                              worker_events_per_s=0.001, max_workers_per_token=2):  # fmt: skip
        yield plane


async def _worker(cp: ControlPlane, **req: Any) -> LiveWorker:
    answer = await cp.register(RegisterRequest(pool="pool-a", **req), ADMIN_TOKEN)
    return cp.state.workers[answer["worker_id"]]


async def _beat(cp: ControlPlane, w: LiveWorker, seq: int, **body: Any) -> dict[str, Any]:
    return await cp.heartbeat(w, HeartbeatRequest(seq=seq, **body))


def _events(cp: ControlPlane, w: LiveWorker, *types: EventType) -> list[Any]:
    return cp.store.query_events(EventQuery(worker_id=w.id, types=types))


async def _raises(coro: Any, status: int, field: str | None) -> ApiError:
    with pytest.raises(ApiError) as err:
        await coro
    assert (err.value.status, err.value.field) == (status, field), err.value.message
    return err.value


# -- registration ---------------------------------------------------------------------------------------------
async def test_register_answers_the_interval_the_loss_window_and_version_1(cp: ControlPlane) -> None:
    answer = await cp.register(
        RegisterRequest(pool="pool-a", role=Role.LEARNER, group="g1", rank=3, host="h", pid=42,
                        heartbeat_interval_s=2.5),
        ADMIN_TOKEN,
    )  # fmt: skip
    assert answer["worker_id"].startswith("w-") and len(answer["worker_id"]) == 14
    assert answer["worker_token"] and answer["heartbeat_interval_s"] == 2.5
    assert answer["lost_after_beats"] == cp.settings.lost_after_beats
    assert answer["directive"]["version"] == 1
    w = cp.state.workers[answer["worker_id"]]
    assert (w.state, w.last_seq, w.acked_version, w.beats, w.registered_at, w.last_beat_at) == (
        WorkerState.ACTIVE, 0, 0, 0, T0, T0)  # fmt: skip
    assert cp.state.worker_token_hashes[w.token_hash] == w.id and w.token_id is None
    (ev,) = _events(cp, w, EventType.REGISTERED)
    assert ev.pool == "pool-a" and ev.ts == T0
    assert ev.data == {"role": "learner", "group": "g1", "rank": 3, "host": "h", "pid": 42}


async def test_who_may_register_where(cp: ControlPlane) -> None:
    await _raises(cp.register(RegisterRequest(pool="pool-a"), None), 401, "Authorization")
    await _raises(cp.register(RegisterRequest(pool="pool-a"), "dsp_not-a-token"), 403, "Authorization")
    await _raises(cp.register(RegisterRequest(pool="nowhere"), ADMIN_TOKEN), 404, "pool")
    token = await cp.create_token("pool", "pool-a", "t")
    err = await _raises(cp.register(RegisterRequest(pool="pool-b"), token), 403, "pool")
    assert "'pool-a'" in err.message and "'pool-b'" in err.message
    # Another pool's device is refused to a pool token; the admin registers anywhere.
    await cp.put_device(Device("gpu-b", "n1"))
    await _raises(cp.register(RegisterRequest(pool="pool-a", device="gpu-b"), token), 403, "device")
    assert (await cp.register(RegisterRequest(pool="pool-a", device="gpu-b"), ADMIN_TOKEN))["worker_id"]
    # A device no pool claims, and one the inventory does not know, are fine for the token.
    await cp.put_device(Device("gpu-free", "n1"))
    first = await cp.register(RegisterRequest(pool="pool-a", device="gpu-free"), token)
    second = await cp.register(RegisterRequest(pool="pool-a", device="gpu-unknown"), token)
    assert cp.state.workers[first["worker_id"]].token_id is not None
    # max_workers_per_token = 2: the third is refused, and a deregistration frees a place.
    err = await _raises(cp.register(RegisterRequest(pool="pool-a"), token), 429, "Authorization")
    assert err.code == "quota_exceeded" and "has 2 registered workers" in err.message
    await cp.deregister(cp.state.workers[second["worker_id"]], "done")
    await cp.deregister(cp.state.workers[second["worker_id"]], "again")  # idempotent: counted once
    assert (await cp.register(RegisterRequest(pool="pool-a"), token))["worker_id"]
    await _raises(cp.register(RegisterRequest(pool="pool-a"), token), 429, "Authorization")


# -- beats that are not applied -------------------------------------------------------------------------------
async def test_a_retry_is_answered_as_a_duplicate_and_applies_nothing(cp: ControlPlane, clock: Clock) -> None:
    w = await _worker(cp)
    await _beat(cp, w, 1, metrics={"a": 1.0})
    clock.now += 1
    again = await _beat(cp, w, 1, metrics={"a": 2.0, "b": 1.0})
    assert again["duplicate"] is True and again["seq"] == 1 and again["server_time"] == T0 + 1
    assert (cp.heartbeats, cp.duplicates, w.beats, w.last_beat_at, dict(w.metrics)) == (1, 1, 1, T0, {"a": 1.0})


async def test_older_seq_unissued_ack_and_deregistered_worker_are_refused(cp: ControlPlane) -> None:
    w = await _worker(cp)
    await _beat(cp, w, 5)
    err = await _raises(_beat(cp, w, 4), 409, "seq")
    assert "seq 4 is older than the last accepted seq 5" in err.message
    err = await _raises(_beat(cp, w, 6, acked_directive_version=2), 422, "acked_directive_version")
    assert "acked_directive_version 2 was never issued (latest is 1)" in err.message
    assert w.last_seq == 5
    await _beat(cp, w, 6, acked_directive_version=1)  # the version in force may be acked
    await cp.deregister(w, "bye")
    await _raises(_beat(cp, w, 7), 409, "worker_id")
    await _raises(_beat(cp, w, 6), 409, "worker_id")  # even a retry: the worker has left


async def test_metric_names_are_budgeted_across_beats(cp: ControlPlane) -> None:
    w = await _worker(cp)  # max_metrics_per_worker = 3
    await _beat(cp, w, 1, metrics={"a": 1.0, "b": 1.0})
    await _beat(cp, w, 2, metrics={"a": 2.0, "b": 2.0, "c": 2.0})  # exactly the cap
    await _beat(cp, w, 3, metrics={"a": 3.0, "c": 3.0})  # names already held cost nothing
    err = await _raises(_beat(cp, w, 4, metrics={"a": 4.0, "d": 4.0}), 422, "metrics")
    assert "1 new metric name(s)" in err.message and "4 distinct names" in err.message and "at most 3" in err.message
    assert dict(w.metrics) == {"a": 3.0, "b": 2.0, "c": 3.0} and w.last_seq == 3


async def test_events_are_budgeted_and_an_overdrawn_beat_applies_nothing(cp: ControlPlane) -> None:
    w = await _worker(cp)  # burst 4, refilled at 0.001/s
    log = [{"type": "log", "data": {"i": i}} for i in range(3)]
    await _beat(cp, w, 1, events=log)
    err = await _raises(_beat(cp, w, 2, events=log[:2], metrics={"m": 1.0}), 429, "events")
    assert err.code == "rate_limited" and "burst 4" in err.message
    assert w.last_seq == 1 and "m" not in w.metrics
    await _beat(cp, w, 2, events=log[:1])  # the one event left
    assert len(_events(cp, w, EventType.LOG)) == 4


async def test_a_pass_that_woke_late_does_not_blame_its_own_stall_on_the_workers(
    cp: ControlPlane, clock: Clock
) -> None:
    """A reconcile pass that wakes ``stall_s`` late ran behind a stalled loop: beats may still wait unread. Silence
    is judged as of that much earlier, so only a worker silent for longer than the window plus the stall is lost."""
    w = await _worker(cp)
    await _beat(cp, w, 1)
    window = cp.settings.lost_after_beats * w.interval_s
    clock.now += window + 0.5
    assert await cp.reconcile(stall_s=0.6) == []
    assert w.state is WorkerState.ACTIVE and _events(cp, w, EventType.LOST) == []
    assert await cp.reconcile(stall_s=0.4) == [w.id]
    (ev,) = _events(cp, w, EventType.LOST)
    assert ev.data == {"silent_s": round(window + 0.5, 3), "missed_beats": cp.settings.lost_after_beats}


@pytest.mark.parametrize("meanwhile", ["deregister", "beat"])
async def test_what_arrives_while_a_loss_is_committed_is_applied_after_it(
    cp: ControlPlane, clock: Clock, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """The liveness scan holds the lost workers from its check to its apply. A deregistration that arrived during
    its commit was overwritten by ``lost`` (the store said deregistered, the control plane lost); a beat applied
    then left the store saying ``lost`` of an active worker, with no rejoin recorded. Now either waits, and finds
    the worker lost: deregistered from lost, or rejoined."""
    w = await _worker(cp)
    await _beat(cp, w, 1)
    real = cp.log.commit
    arrivals: list[asyncio.Future[Any]] = []

    async def commit_then_let_a_request_in(batch: WriteBatch) -> list[int]:
        ids = await real(batch)
        if not arrivals and any(r.id == w.id and r.state == "lost" for r in batch.workers):
            request = cp.deregister(w, "done") if meanwhile == "deregister" else _beat(cp, w, 2)
            arrivals.append(asyncio.ensure_future(request))
            await asyncio.wait(arrivals, timeout=1.0)  # what it does if nothing holds it back
        return ids

    monkeypatch.setattr(cp.log, "commit", commit_then_let_a_request_in)
    clock.now += 3600.0
    assert await cp.reconcile() == [w.id]
    await arrivals[0]
    assert _events(cp, w, EventType.LOST)
    expected = WorkerState.DEREGISTERED if meanwhile == "deregister" else WorkerState.ACTIVE
    assert w.state is expected
    if meanwhile == "beat":
        (rejoined,) = _events(cp, w, EventType.REJOINED)
        assert rejoined.data == {"silent_s": 3600.0}
    (row,) = [r for r in cp.store.list_workers() if r.id == w.id]
    assert row.state == expected.value


# -- what a beat records --------------------------------------------------------------------------------------
async def test_a_lost_worker_that_beats_rejoins(cp: ControlPlane, clock: Clock) -> None:
    w = await _worker(cp)
    await _beat(cp, w, 1)
    w.state = WorkerState.LOST  # as the liveness scan leaves it
    clock.now += 12.3456
    await _beat(cp, w, 2)
    (ev,) = _events(cp, w, EventType.REJOINED)
    assert ev.data == {"silent_s": 12.346} and ev.ts == clock.now
    assert w.state is WorkerState.ACTIVE and w.beats == 2 and w.last_beat_at == clock.now
    await _beat(cp, w, 3)
    assert len(_events(cp, w, EventType.REJOINED)) == 1  # an active worker's beat is no rejoin


async def test_acks_are_recorded_once_and_only_for_the_latest_version(cp: ControlPlane) -> None:
    w = await _worker(cp)
    answer = await _beat(cp, w, 1)
    assert answer["directive"]["version"] == 1  # not acked yet: sent again
    await cp.set_directive(w, {"compression_bits": 8}, actor="api")
    await cp.set_directive(w, {"compression_bits": 4}, actor="api")
    answer = await _beat(cp, w, 2, acked_directive_version=2)  # an older version: no acked event
    assert w.acked_version == 2 and answer["directive"]["version"] == 3
    assert _events(cp, w, EventType.DIRECTIVE_ACKED) == []
    answer = await _beat(cp, w, 3, acked_directive_version=3)
    assert answer["directive"] is None and w.acked_version == 3
    (ev,) = _events(cp, w, EventType.DIRECTIVE_ACKED)
    assert ev.data == {"version": 3}
    await _beat(cp, w, 4, acked_directive_version=3)  # the same ack again is not news
    await _beat(cp, w, 5, acked_directive_version=2)  # nor is an older one, which never lowers the record
    assert len(_events(cp, w, EventType.DIRECTIVE_ACKED)) == 1 and w.acked_version == 3
    assert answer["latency_cap_ms"] == cp.judge.caps_for(w).latency_ms > 0


async def test_the_worker_events_are_attributed_and_dated(cp: ControlPlane, clock: Clock) -> None:
    w = await _worker(cp)
    far_past = clock.now - 10 * cp.settings.event_retention_s
    events = [
        {"type": "log", "ts": clock.now - 5, "data": {"k": 1, "source": "forged"}},
        {"type": "log", "ts": far_past, "data": {"k": 2}},
        {"type": "log", "data": {"k": 3}},
    ]
    await _beat(cp, w, 1, events=events)
    got = sorted(_events(cp, w, EventType.LOG), key=lambda e: e.data["k"])
    assert [e.ts for e in got] == [clock.now - 5, clock.now, clock.now]
    assert [e.data for e in got] == [
        {"k": 1, "source": "worker"},
        {"k": 2, "source": "worker", "worker_ts": far_past},
        {"k": 3, "source": "worker"},
    ]
    assert all(e.pool == "pool-a" for e in got)


async def test_an_inferred_role_changes_the_record_once(cp: ControlPlane) -> None:
    w = await _worker(cp)
    await _beat(cp, w, 1, inferred_role={"role": "other", "evidence": {}})  # the role it has: nothing
    assert _events(cp, w, EventType.ROLE_INFERRED) == []
    await _beat(cp, w, 2, inferred_role={"role": "learner", "evidence": {"optimizer_steps": 3}})
    (ev,) = _events(cp, w, EventType.ROLE_INFERRED)
    assert ev.data == {"from": "other", "to": "learner", "evidence": {"optimizer_steps": 3}, "source": "worker"}
    assert w.info.role is Role.LEARNER


async def test_unappliable_fields_are_remembered_when_they_name_a_field_and_a_version(
    cp: ControlPlane, clock: Clock
) -> None:
    w = await _worker(cp)
    data = {"field": "compression_bits", "version": 1, "requested": 4, "reason": "x" * 300}
    bad = [{"field": "nonsense", "version": 1}, {"field": "precision", "version": "1"}]
    events = [{"type": "directive_unappliable", "data": d} for d in (data, *bad)]
    await _beat(cp, w, 1, events=events)
    assert w.unappliable == {"compression_bits": {"version": 1, "requested": 4, "reason": "x" * 200}}
    await _beat(cp, w, 2, events=[{"type": "directive_unappliable", "data": {"field": "precision", "version": 1,
                                                                             "requested": [1]}}])  # fmt: skip
    assert w.unappliable["precision"] == {"version": 1, "requested": None, "reason": ""}
    clock.now += 1000  # one more event in the budget
    await _beat(cp, w, 3, events=[{"type": "log", "data": {"field": "precision", "version": 2}}])
    assert w.unappliable["precision"]["version"] == 1  # only directive_unappliable events count


async def test_deregistration_records_the_reason_once(cp: ControlPlane, clock: Clock) -> None:
    w = await _worker(cp)
    clock.now += 3
    api = await cp.deregister(w, "finished")
    assert w.state is WorkerState.DEREGISTERED and w.ended_at == T0 + 3 and api["state"] == "deregistered"
    again = await cp.deregister(w, "twice")
    assert again == api
    (ev,) = _events(cp, w, EventType.DEREGISTERED)
    assert ev.data == {"reason": "finished"} and ev.ts == T0 + 3


# -- directives -----------------------------------------------------------------------------------------------
async def test_set_directive_makes_a_new_version_with_its_event(cp: ControlPlane, clock: Clock) -> None:
    w = await _worker(cp)
    clock.now += 2
    d = await cp.set_directive(w, {"compression_bits": 8}, actor="ops")
    assert (d.version, d.updated_at, d.fields.compression_bits, w.directive) == (2, T0 + 2, 8, d)
    (ev,) = _events(cp, w, EventType.DIRECTIVE_SET)
    assert ev.data == {"version": 2, "changes": {"compression_bits": 8}, "by": "ops"} and ev.pool == "pool-a"
    err = await _raises(cp.set_directive(w, {"compression_bits": 5}, actor="ops"), 422, "compression_bits")
    assert err.code == "invalid" and w.directive.version == 2
    await cp.deregister(w, "bye")
    await _raises(cp.set_directive(w, {"compression_bits": 4}, actor="ops"), 409, "worker_id")


async def test_directive_from_a_verdict(cp: ControlPlane) -> None:
    w = await _worker(cp)
    assert directive_from(w, Verdict(), 5.0) is None
    assert directive_from(w, Verdict(patch={"compression_bits": 5}), 5.0) is None  # invalid: logged, dropped
    same = {"compression_bits": w.directive.fields.compression_bits}
    assert directive_from(w, Verdict(patch=same), 5.0) is None
    d = directive_from(w, Verdict(patch=same, breaker_issued=True), 5.0)
    assert d is not None and (d.version, d.fields, d.updated_at, d.worker_id) == (2, w.directive.fields, 5.0, w.id)
    d = directive_from(w, Verdict(patch={"compression_bits": 8}), 6.0)
    assert d is not None and d.version == 2 and d.fields.compression_bits == 8


# -- what a restart of the control plane finds, budgets per worker, leaving ---------------------------------
async def _reopened(cp: ControlPlane) -> tuple[ControlPlane, Any]:
    store = open_store(cp.settings.database_url)
    return ControlPlane(cp.settings, store, cp.clock), store


async def test_a_restart_finds_the_directive_and_the_departure(cp: ControlPlane) -> None:
    w = await _worker(cp)
    other = await _worker(cp)
    await cp.set_directive(w, {"compression_bits": 8}, actor="ops")
    await cp.deregister(other, "done")
    again, store = await _reopened(cp)
    try:
        assert again.state.workers[w.id].directive.version == 2
        assert again.state.workers[w.id].directive.fields.compression_bits == 8
        assert again.state.workers[other.id].state is WorkerState.DEREGISTERED
    finally:
        again.close()
        store.close()


async def test_leaving_records_the_run_on_a_known_device_and_forgets_the_judgment(cp: ControlPlane) -> None:
    await cp.put_device(Device("gpu-free", "n1"))
    w = await _worker(cp, device="gpu-free")
    for seq in (1, 2):
        await _beat(cp, w, seq, metrics={"sync_latency_ms_p50": 10.0})
    assert w.id in cp.judge.breakers
    await cp.deregister(w, "done")
    assert w.id not in cp.judge.breakers
    (dereg,) = _events(cp, w, EventType.DEREGISTERED)
    assert dereg.pool == "pool-a"
    runs = [e for e in _events(cp, w, EventType.DEVICE) if e.data.get("kind") == "run"]
    assert len(runs) == 1 and runs[0].data["device"] == "gpu-free" and runs[0].data["record"]["failed"] is False


async def test_a_token_count_goes_back_to_zero(cp: ControlPlane) -> None:
    token = await cp.create_token("pool", "pool-a", "t")
    first = await cp.register(RegisterRequest(pool="pool-a"), token)
    second = await cp.register(RegisterRequest(pool="pool-a"), token)
    for answer in (first, second):
        await cp.deregister(cp.state.workers[answer["worker_id"]], "done")
    for _ in range(2):  # max_workers_per_token = 2 places, both free again
        await cp.register(RegisterRequest(pool="pool-a"), token)


async def test_retries_are_counted_and_budgets_are_per_worker(cp: ControlPlane) -> None:
    a, b = await _worker(cp), await _worker(cp)
    await _beat(cp, a, 1)
    await _beat(cp, a, 1)
    await _beat(cp, a, 1)
    assert (cp.heartbeats, cp.duplicates) == (1, 2)
    log = [{"type": "log", "data": {"i": i}} for i in range(3)]
    await _beat(cp, a, 2, events=log)  # burst 4 each: three from a leave b its own four
    await _beat(cp, b, 1, events=log)


async def test_a_short_wait_for_event_budget_is_still_a_refusal(tmp_path: Path, clock: Clock) -> None:
    async for cp in _plane(tmp_path, clock, worker_events_per_s=10.0, worker_events_burst=4):
        w = await _worker(cp)
        log = [{"type": "log", "data": {"i": i}} for i in range(3)]
        await _beat(cp, w, 1, events=log)  # one of the burst left
        await _raises(_beat(cp, w, 2, events=log[:2]), 429, "events")  # 0.1 s short of the second
        clock.now += 0.2  # (0.1 s would be 1.99999... tokens in floats)
        await _beat(cp, w, 2, events=log[:2])


async def test_set_directive_carries_extra_events_and_names_the_field(cp: ControlPlane) -> None:
    w = await _worker(cp)
    extra = Event(ts=T0, type=EventType.LOG, worker_id=w.id, pool="pool-a", data={"why": "policy"})
    await cp.set_directive(w, {"compression_bits": 8}, actor="policy", extra_events=[extra])
    assert [e.data for e in _events(cp, w, EventType.LOG)] == [{"why": "policy"}]
    err = await _raises(cp.set_directive(w, {"nonsense": 1}, actor="ops"), 422, "unknown")
    assert err.message.startswith("unknown directive field(s) ['nonsense']")
    await _raises(cp.set_directive(w, {"precision": "a=b"}, actor="ops"), 422, "precision")
    await cp.deregister(w, "bye")
    err = await _raises(cp.set_directive(w, {"compression_bits": 4}, actor="ops"), 409, "worker_id")
    assert err.message == f"worker_id {w.id!r} has deregistered; directives no longer apply"


async def test_a_beat_with_events_is_written_whole(cp: ControlPlane, clock: Clock) -> None:
    # The only beat, and it carries an event: its row reaches the store through the beat's own commit (a beat
    # without events is written later by the writer thread), state active again although the worker was lost.
    w = await _worker(cp)
    w.state = WorkerState.LOST
    clock.now += 7
    await _beat(cp, w, 5, acked_directive_version=1, metrics={"a": 1.5}, events=[{"type": "log", "data": {}}])
    again, store = await _reopened(cp)
    try:
        row = again.state.workers[w.id]
        assert (row.state, row.last_seq, row.last_beat_at, row.beats, row.acked_version) == (
            WorkerState.ACTIVE, 5, T0 + 7, 1, 1)  # fmt: skip
        assert dict(row.metrics) == {"a": 1.5}
    finally:
        again.close()
        store.close()


async def test_a_failed_judgment_leaves_the_role_as_it_was(cp: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    w = await _worker(cp)

    def failing(*args: Any) -> Any:
        raise RuntimeError("judge failed (injected)")

    monkeypatch.setattr(cp.judge, "on_beat", failing)
    with pytest.raises(RuntimeError):
        await _beat(cp, w, 1, inferred_role={"role": "learner", "evidence": {}})
    assert w.info.role is Role.OTHER and w.last_seq == 0


@pytest.fixture
async def cp_retaining(tmp_path: Path, clock: Clock) -> AsyncIterator[ControlPlane]:
    async for plane in _plane(tmp_path, clock, event_retention_s=3600.0):
        yield plane


async def test_event_retention_prunes_on_the_writer_thread(
    cp_retaining: ControlPlane, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    cp = cp_retaining
    w = await _worker(cp)
    await cp.log.record_events([Event(ts=clock.now, type=EventType.LOG, worker_id=w.id, data={"k": 1})])
    threads: list[str] = []
    prune = cp.store.prune_events

    def recording(before: float, keep: Any = ()) -> int:
        threads.append(threading.current_thread().name)
        return prune(before, keep)

    monkeypatch.setattr(cp.store, "prune_events", recording)
    clock.now += 2 * 3600.0
    _, pruned = await cp.retain(force=True)
    assert threads == ["dsec-writer"]  # not a thread of its own beside the group commit
    assert pruned >= 1 and _events(cp, w, EventType.LOG) == []


@pytest.mark.parametrize("how", ["deregister", "lost"])
async def test_a_flush_between_a_commit_and_its_apply_does_not_write_the_older_row_over_it(
    cp: ControlPlane, clock: Clock, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The writer flushes dirty rows on its own timer. A worker whose deregistration (or loss) was just committed,
    but not yet applied to the hot state, still reads ``active`` there: a flush in that window wrote that older copy
    over the committed row, and nothing rewrote it (the store said ``active`` for good). Here the window is held
    open for several flushes."""
    w = await _worker(cp)
    await _beat(cp, w, 1)  # a plain beat: the worker's row is dirty
    real = cp.log.commit

    async def commit_then_wait(batch: WriteBatch) -> list[int]:
        ids = await real(batch)
        if any(r.id == w.id and r.state != "active" for r in batch.workers):
            cp.state.mark_dirty(w.id)  # as a plain beat arriving meanwhile would
            await asyncio.to_thread(time.sleep, 5 * cp.settings.flush_interval_s)  # the writer's timer runs
        return ids

    monkeypatch.setattr(cp.log, "commit", commit_then_wait)
    if how == "deregister":
        await cp.deregister(w, "done")
    else:
        clock.now += 3600.0
        await cp.reconcile()
    await asyncio.to_thread(time.sleep, 5 * cp.settings.flush_interval_s)
    (row,) = [r for r in cp.store.list_workers() if r.id == w.id]
    assert row.state == ("deregistered" if how == "deregister" else "lost") == w.state.value
