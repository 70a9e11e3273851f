"""Details of the worker protocol that test_beats_contract.py leaves open: the directive version 1 registration
writes, who a judgment's directive names as its author, a beat's row (committed by the beat, or flushed by the writer),
the answer to each beat, the log line of a judgment that cannot become a directive, and the codes and texts of
refusals.

Written against the survivors of the second and third mutation runs on control/beats.py and control/directives.py
(docs/testing.md); same in-process control plane over SQLite on a virtual clock, no server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_beats_contract import T0, Clock, _beat, _events, _plane, _raises, _worker

from conftest import ADMIN_TOKEN
from dsec.control.directives import directive_from
from dsec.control.schemas import RegisterRequest
from dsec.control.service import ControlPlane
from dsec.decide import Verdict
from dsec.model import Device, EventType, Pool, WorkerState


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def cp(tmp_path: Path, clock: Clock) -> AsyncIterator[ControlPlane]:
    async for plane in _plane(tmp_path, clock, max_metrics_per_worker=3):
        yield plane


# -- what registration, a beat and a judgment write -------------------------------------------------------------
async def test_registration_writes_version_1_with_the_pools_fields(cp: ControlPlane) -> None:
    # Durable with the worker: a restart finds the pool's fields, not the defaults it falls back to without a row.
    await cp.put_pool(Pool("pool-c", memory_base_gb=3.0, memory_ceiling_gb=5.0, snapshot_interval_s=30.0))
    answer = await cp.register(RegisterRequest(pool="pool-c"), ADMIN_TOKEN)
    (stored,) = [d for d in cp.store.list_directives() if d.worker_id == answer["worker_id"]]
    assert (stored.version, stored.updated_at) == (1, T0)
    fields = stored.fields
    assert (fields.memory_quota_gb, fields.memory_ceiling_gb, fields.snapshot_interval_s) == (3.0, 5.0, 30.0)


async def test_a_directive_two_decisions_made_names_both(cp: ControlPlane) -> None:
    w = await _worker(cp)
    await cp.set_directive(w, {"precision": "fp16"}, actor="ops")  # fp16 falls back to fp32
    stuck = {"type": "anomaly", "data": {"kind": "episode_stuck", "reason": "oom", "count": 3}}
    nan = {"type": "anomaly", "data": {"kind": "non_finite_gradient", "grad_norm": "nan"}}
    answer = await _beat(cp, w, 1, acked_directive_version=2, events=[stuck, nan])
    assert answer["directive"]["version"] == 3
    judged = _events(cp, w, EventType.DIRECTIVE_SET)[-1]
    assert judged.data["by"] == "stuck_episode+precision_fallback"
    assert judged.data["version"] == 3 and judged.data["changes"]["precision"] == "fp32"


async def test_a_beat_with_events_commits_its_own_row(cp: ControlPlane, clock: Clock) -> None:
    # Read from the store right after the beat: a restart would give the worker a fresh last_beat_at anyway.
    w = await _worker(cp)
    clock.now += 7
    await _beat(cp, w, 3, metrics={"a": 1.5}, events=[{"type": "log", "data": {}}])
    (row,) = [r for r in cp.store.list_workers() if r.id == w.id]
    assert (row.last_beat_at, row.last_seq, row.beats, row.state) == (T0 + 7, 3, 1, "active")


async def test_a_beat_without_events_reaches_the_store_with_the_next_flush(cp: ControlPlane, clock: Clock) -> None:
    # Not committed by the beat (the hot path): the writer thread writes the worker's row on its timer (50 ms).
    w = await _worker(cp)
    clock.now += 2
    await _beat(cp, w, 1, metrics={"a": 1.0})
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        (row,) = [r for r in cp.store.list_workers() if r.id == w.id]
        if row.last_seq == 1:
            break
        await asyncio.sleep(0.02)
    assert (row.last_seq, row.last_beat_at, row.beats, row.metrics) == (1, T0 + 2, 1, {"a": 1.0})


async def test_the_answer_to_each_applied_beat(cp: ControlPlane, clock: Clock) -> None:
    w = await _worker(cp)
    for seq in (1, 2):
        clock.now += 1
        answer = await _beat(cp, w, seq, acked_directive_version=1)
        assert (answer["seq"], answer["duplicate"], answer["server_time"], answer["directive"]) == (
            seq, False, clock.now, None)  # fmt: skip
    assert (cp.heartbeats, cp.duplicates) == (2, 0)


async def test_a_judgment_that_cannot_be_a_directive_is_logged(
    cp: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    w = await _worker(cp)
    with caplog.at_level(logging.ERROR, logger="dsec.control.directives"):
        assert directive_from(w, Verdict(patch={"compression_bits": 5}), T0) is None
    (record,) = caplog.records
    assert record.getMessage() == f"judgment produced an invalid directive for {w.id}: {{'compression_bits': 5}}"
    assert record.exc_info is not None  # with the validation error's traceback


# -- the texts of refusals ------------------------------------------------------------------------------------
async def test_a_deregistered_worker_is_told_to_register_again(cp: ControlPlane) -> None:
    w = await _worker(cp)
    await cp.deregister(w, "bye")
    err = await _raises(_beat(cp, w, 1), 409, "worker_id")
    assert err.code == "conflict"
    assert err.message == f"worker_id {w.id!r} has deregistered; register again to report"


async def test_an_unissued_ack_and_too_many_metric_names_are_invalid_input(cp: ControlPlane) -> None:
    w = await _worker(cp)  # max_metrics_per_worker = 3
    err = await _raises(_beat(cp, w, 1, acked_directive_version=2), 422, "acked_directive_version")
    assert err.code == "invalid"
    err = await _raises(_beat(cp, w, 1, metrics=dict.fromkeys("abcd", 1.0)), 422, "metrics")
    assert err.code == "invalid"


async def test_who_may_not_register_is_told_why(cp: ControlPlane) -> None:
    err = await _raises(cp.register(RegisterRequest(pool="pool-a"), "dsp_not-a-token"), 403, "Authorization")
    assert (err.code, err.message) == ("forbidden", "unknown or revoked token")
    err = await _raises(cp.register(RegisterRequest(pool="nowhere"), ADMIN_TOKEN), 404, "pool")
    assert (err.code, err.message) == ("not_found", "pool 'nowhere': no such pool")
    token = await cp.create_token("pool", "pool-a", "t")
    await cp.put_device(Device("gpu-b", "n1"))
    err = await _raises(cp.register(RegisterRequest(pool="pool-a", device="gpu-b"), token), 403, "device")
    assert err.message == "device 'gpu-b' is not a device of pool 'pool-a'"  # not whose it is


# -- the events a beat records, as recorded -------------------------------------------------------------------
async def test_rejoin_ack_and_role_events_are_the_workers_and_dated_now(cp: ControlPlane, clock: Clock) -> None:
    w = await _worker(cp)
    await _beat(cp, w, 1)
    w.state = WorkerState.LOST
    clock.now += 4
    await _beat(cp, w, 2, acked_directive_version=1, inferred_role={"role": "learner", "evidence": {}})
    kinds = (EventType.REJOINED, EventType.DIRECTIVE_ACKED, EventType.ROLE_INFERRED)
    recorded = {e.type: (e.ts, e.worker_id, e.pool) for e in _events(cp, w, *kinds)}
    assert recorded == dict.fromkeys(kinds, (T0 + 4, w.id, "pool-a"))


# -- the common beat's shortcuts (beats.py skips two calls for it) ------------------------------------------------
@pytest.mark.parametrize("lost", [False, True])
@pytest.mark.parametrize("acked", [0, 1])
@pytest.mark.parametrize("events", [[], [{"type": "log", "data": {"msg": "x"}}]])
async def test_the_calls_a_common_beat_skips_answer_nothing_for_it(
    cp: ControlPlane, lost: bool, acked: int, events: list[dict[str, object]]
) -> None:
    """A beat without events, not back from lost and acking nothing new skips ``_beat_events`` (it would answer []),
    and one without an inferred role skips ``_role_change`` (None): what each answers there, and only there."""
    from dsec.control.schemas import HeartbeatRequest

    w = await _worker(cp)  # directive version 1, nothing acked yet
    if lost:
        w.state = WorkerState.LOST
    req = HeartbeatRequest.model_validate({"seq": 1, "acked_directive_version": acked, "events": events})
    newly_acked = acked > w.acked_version
    recorded = cp.beats._beat_events(w, req, T0, lost, newly_acked)
    assert (recorded == []) is not (bool(req.events) or lost or newly_acked)
    assert cp.beats._role_change(w, req, T0) is None
    inferred = HeartbeatRequest.model_validate({"seq": 1, "inferred_role": {"role": "actor"}})
    assert cp.beats._role_change(w, inferred, T0) is not None


async def test_a_retry_sent_while_the_original_commits_waits_for_it_and_is_its_duplicate(cp: ControlPlane) -> None:
    """The worker's lock around a beat: a retry that arrives while the original waits for its commit is answered
    once that commit is applied, as its duplicate (nothing recorded twice); a refused beat leaves the lock free."""
    w = await _worker(cp)
    log = {"type": "log", "data": {"msg": "x"}}
    first = asyncio.ensure_future(_beat(cp, w, 1, events=[log]))
    await asyncio.sleep(0)  # the original runs up to its commit, holding the lock
    assert w.lock.locked()
    retry = asyncio.ensure_future(_beat(cp, w, 1, events=[log]))
    original, duplicate = await asyncio.gather(first, retry)
    assert (original["duplicate"], duplicate["duplicate"]) == (False, True)
    assert len(_events(cp, w, EventType.LOG)) == 1 and w.last_seq == 1 and w.beats == 1
    assert not w.lock.locked()
    await _raises(_beat(cp, w, 2, acked_directive_version=99), 422, "acked_directive_version")
    assert not w.lock.locked()
