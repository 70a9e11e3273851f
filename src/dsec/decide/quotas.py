"""Periodic per-worker directive changes: elastic memory quotas of a pool, and precision restores."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dsec import pacing
from dsec.decide.caps import finite
from dsec.decide.verdicts import Change
from dsec.decide.views import WorkerView
from dsec.health.interventions import PrecisionGuard
from dsec.model import Event, EventType, Pool
from dsec.quota import MemoryTrend, PoolMemory, QuotaConfig, QuotaPlan, WorkerMemory, plan
from dsec.quota.room import CardMate, make_room, projected_gb
from dsec.quota.trend import BURST_HOLD_S, BURST_RAMP_GB_PER_S, PEAK_HOLD_S, observe_arrays

#: How far ahead a card's usage is projected for room (dsec.quota.room): until the next chance to act — the next quota
#: pass (2 s) — plus the time the move takes to free the card (the supervisor's poll, the actor's stop): ~5 s, the
#: simulator's sample interval, which is what its figures were measured with.
ROOM_HORIZON_S = 5.0


@dataclass(frozen=True)
class RoomRequest:
    """Room made on ``card`` for a burst: ``worker_id`` (an actor, on ``device``) is to move off it alone; the card
    takes no new worker until ``until``. ``event`` records it (a ``room`` event), and the
    launcher's supervisor acts on that event."""

    card: str
    worker_id: str
    device: str
    until: float
    event: Event


@dataclass
class QuotaVerdict:
    accounting: PoolMemory
    changes: list[Change] = field(default_factory=list)
    rooms: list[RoomRequest] = field(default_factory=list)


def observe_memory(
    trends: Mapping[str, MemoryTrend], workers: Sequence[WorkerView], now: float
) -> dict[str, MemoryTrend]:
    """Each reporting worker's memory trend after its latest ``memory_used_gb`` (the planner's ramp and recent
    peak); workers that are gone are dropped.

    The same as ``old.observe(used, now)`` per worker (tests/unit/decide/test_decide.py checks it), computed for
    every worker in one numpy call: per worker, numpy's scalar operations cost ~50 us, which at 10,000 workers made
    this a third of the control plane's reconcile pass."""
    out: dict[str, MemoryTrend | None] = {}
    ids: list[str] = []
    olds: list[MemoryTrend] = []
    readings: list[float] = []
    for w in pacing.paced(workers):
        used = finite(w.metrics, "memory_used_gb")
        old = trends.get(w.id)
        if used is None:
            if old is not None:
                out[w.id] = old
        elif old is None:
            out[w.id] = MemoryTrend.first(used, now)
        else:
            out[w.id] = None  # its place in the order; filled below
            ids.append(w.id)
            olds.append(old)
            readings.append(used)
    if olds:
        columns = np.array([(o.t, o.used_gb, o.ramp_gb_per_s, o.peak_gb, o.peak_t, o.burst_t) for o in olds]).T
        t, used_gb, ramp, peak, peak_t, burst_t = columns
        after = observe_arrays(t, used_gb, ramp, peak, peak_t, np.array(readings), now, PEAK_HOLD_S, burst_t)
        rows = zip(*(np.asarray(a, dtype=float).tolist() for a in after), strict=True)
        for wid, values in zip(ids, rows, strict=True):
            out[wid] = MemoryTrend(*values)
    return {wid: trend for wid, trend in out.items() if trend is not None}


#: What a card's last plan read and gave (:func:`plan_pool_quotas`'s ``memo``): the plan's inputs, then its result.
CardMemo = dict[str | None, tuple[tuple[object, ...], QuotaPlan]]


def plan_pool_quotas(
    pool: Pool,
    capacity_gb: float | None,
    workers: Sequence[WorkerView],
    config: QuotaConfig,
    now: float,
    trends: Mapping[str, MemoryTrend] | None = None,
    device_gb: float | None = None,
    cards: Mapping[str, tuple[str, float]] | None = None,
    memo: CardMemo | None = None,
    room_held: Mapping[str, float] | None = None,
) -> QuotaVerdict:
    """Grow/reclaim the memory grants of ``pool``'s active ``workers`` and issue their allocator limits; one
    ``quota`` event per worker whose grant or limit changes, with the pool's accounting after it. ``trends``: each
    worker's memory trend (:func:`observe_memory`) for growth by ramp and idle reclaim; None: neither.

    Memory is shared by the processes on one card, not by a pool. ``cards``: device id -> (the card it is a slot
    of, that card's memory in GB), for the devices of known memory (``Device.card_id``). The workers on such a device
    are planned per card, against the card's memory, so a burst's limit is what its card-mates leave free and usage on
    other cards does not shrink it. The others (no device reported, or one of unknown memory) are planned together
    against ``capacity_gb`` (the memory of the pool's cards) less the pool's cards planned on their own, or all of it
    when that leaves nothing, as every worker was before (``device_gb``: one card's memory, the bound of their
    limits).

    ``memo``: the pool's cards' last plans (the caller keeps it between calls; this call replaces its contents with
    this pass's). A card whose inputs are those of its last plan, and whose last plan changed nothing, is not planned
    again: ``quota.plan`` is pure, so it would change nothing again. At 10,000 workers one per card, planning every
    card took ~200 ms a pass in-process.

    ``room_held``: card -> until when room made on it is held (None: room for bursts is not made). A card of known
    memory that holds no such room and that a burst will fill within ``ROOM_HORIZON_S`` gets a :class:`RoomRequest`
    (``dsec.quota.room``: the largest actor not bursting itself moves off a card that holds a learner)."""
    trends = trends or {}
    cards = cards or {}
    by_card: dict[str, list[WorkerView]] = {}
    card_gb: dict[str, float] = {}
    rest: list[WorkerView] = []
    for w in workers:
        where = cards.get(w.device) if w.device is not None else None
        if where is None:
            rest.append(w)
        else:
            card_gb[where[0]] = where[1]
            by_card.setdefault(where[0], []).append(w)
    last = dict(memo) if memo is not None else {}
    kept: CardMemo = {}

    def planned(key: str | None, ws: list[WorkerView], capacity: float | None, one: float | None) -> QuotaPlan:
        # The plan's inputs as plain tuples first (cheap to compare); WorkerMemory (validated) only to plan.
        rows = [_member_row(pool, w, trends, now) for w in pacing.paced(ws)]
        inputs = (capacity, one, pool.memory_base_gb, pool.memory_ceiling_gb, config, rows)
        before = last.get(key)
        if before is not None and before[0] == inputs and not (before[1].changes or before[1].limit_changes):
            result = before[1]
        else:
            members = [WorkerMemory(*row) for row in pacing.paced(rows)]
            pacing.checkpoint()
            result = plan(capacity, pool.memory_base_gb, pool.memory_ceiling_gb, members, config, device_gb=one)
        kept[key] = (inputs, result)
        return result

    parts: list[tuple[list[WorkerView], QuotaPlan, str | None]] = [
        (ws, planned(c, ws, card_gb[c], card_gb[c]), c) for c, ws in by_card.items()
    ]
    if rest or not parts:
        pool_cards = {cards[d][0]: cards[d][1] for d in pool.devices if d in cards}
        own = math.fsum(gb for c, gb in pool_cards.items() if c in by_card)
        left = None if capacity_gb is None else capacity_gb - own
        capacity = left if left is not None and left > 0 else capacity_gb
        parts.append((rest, planned(None, rest, capacity, device_gb), None))
    if memo is not None:
        memo.clear()
        memo.update(kept)
    accounting = _pool_accounting(capacity_gb, [p for _, p, _ in parts]) if by_card else parts[0][1].accounting
    verdict = QuotaVerdict(accounting)
    pool_memory = accounting.to_dict()
    if room_held is not None:
        for c, ws in by_card.items():
            if room_held.get(c, -math.inf) <= now and (room := _room(pool, c, card_gb[c], ws, trends, now)):
                verdict.rooms.append(room)
    for ws, result, card in parts:
        changed = sorted(set(result.changes) | set(result.limit_changes))
        if not changed:
            continue
        by_id = {w.id: w for w in ws}
        card_memory = result.accounting.to_dict() if card is not None else None
        for wid in changed:
            patch: dict[str, float | None] = {}
            fields = by_id[wid].fields
            data: dict[str, object] = {"kind": "memory_quota", "from_gb": fields.memory_quota_gb}
            if wid in result.changes:
                patch["memory_quota_gb"] = result.changes[wid]
            data["to_gb"] = patch.get("memory_quota_gb", fields.memory_quota_gb)
            if wid in result.limit_changes:
                patch["memory_limit_gb"] = result.limit_changes[wid]
                data["limit_from_gb"] = fields.memory_limit_gb
                data["limit_to_gb"] = result.limit_changes[wid]
            if card is not None:
                data["card"] = card
                data["card_memory"] = dict(card_memory or {})
            data["reason"] = result.reasons.get(wid, "")
            data["pool_memory"] = dict(pool_memory)
            ev = Event(ts=now, type=EventType.QUOTA, worker_id=wid, pool=pool.name, data=data)
            verdict.changes.append(Change(wid, patch, "quota", [ev]))
    return verdict


def _room(
    pool: Pool, card: str, card_gb: float, ws: Sequence[WorkerView], trends: Mapping[str, MemoryTrend], now: float
) -> RoomRequest | None:
    """``dsec.quota.room.make_room`` for one card's workers (an actor is movable: its group restarts it alone, the
    launcher's default for actor groups; a learner's failure restarts its group)."""
    mates = []
    for w in ws:
        trend = trends.get(w.id)
        bursting = trend.bursting(now) if trend else False
        ramp = trend.ramp_gb_per_s if trend else 0.0
        used = finite(w.metrics, "memory_used_gb") or 0.0
        mates.append(CardMate(w.id, used, ramp, w.role == "actor" and not bursting, w.role == "learner"))
    chosen = make_room(card_gb, mates, ROOM_HORIZON_S)
    if chosen is None:
        return None
    moved = next(w for w in ws if w.id == chosen)
    until = now + BURST_HOLD_S
    projected = projected_gb(mates, ROOM_HORIZON_S)
    data: dict[str, object] = {
        "kind": "make_room",
        "card": card,
        "device": moved.device,
        "card_gb": card_gb,
        "projected_gb": round(projected, 3),
        "bursting": sorted(m.worker_id for m in mates if m.ramp_gb_per_s >= BURST_RAMP_GB_PER_S),
        "until": until,
        "reason": f"a burst will fill card {card} ({projected:.1f} of {card_gb:g} GB within {ROOM_HORIZON_S:g} s): "
        f"{moved.agent} moves off it",
    }
    ev = Event(ts=now, type=EventType.ROOM, worker_id=chosen, pool=pool.name, data=data)
    return RoomRequest(card, chosen, str(moved.device), until, ev)


def _member_row(
    pool: Pool, w: WorkerView, trends: Mapping[str, MemoryTrend], now: float
) -> tuple[str, float | None, float, float | None, float, float | None, float | None, bool]:
    """What ``dsec.quota.plan`` reads of ``w``: ``WorkerMemory``'s fields in order (worker, used, grant, own ceiling,
    ramp, recent peak, limit, bursting)."""
    trend = trends.get(w.id)
    f = w.fields
    return (
        w.id,
        finite(w.metrics, "memory_used_gb"),
        f.memory_quota_gb or pool.memory_base_gb,
        f.memory_ceiling_gb,
        trend.ramp_gb_per_s if trend else 0.0,
        trend.peak_gb if trend else None,
        f.memory_limit_gb,
        trend.bursting(now) if trend else False,
    )


def _pool_accounting(capacity_gb: float | None, plans: Sequence[QuotaPlan]) -> PoolMemory:
    """The pool's memory over its per-device plans: grants and usage add up; the headroom is the sum of the parts'
    (each device's own; a part of unknown capacity makes it unknown), the capacity the pool's devices' memory."""
    parts = [p.accounting for p in plans]
    headrooms = [a.headroom_gb for a in parts]
    first = parts[0]
    return PoolMemory(
        capacity_gb=float(capacity_gb) if capacity_gb is not None else None,
        granted_gb=math.fsum(a.granted_gb for a in parts),
        used_gb=math.fsum(a.used_gb for a in parts),
        headroom_gb=None if any(h is None for h in headrooms) else math.fsum(h for h in headrooms if h is not None),
        base_gb=first.base_gb,
        ceiling_gb=first.ceiling_gb,
        workers=sum(a.workers for a in parts),
    )


def precision_restore(w: WorkerView, guard: PrecisionGuard, now: float) -> Change | None:
    """The precision a fallback replaced, once ``guard`` has seen it stable for long enough."""
    if guard.original is None:
        return None
    decision = guard.revert(w.fields.precision, now)
    if decision is None:
        return None
    patch, data = decision
    ev = Event(ts=now, type=EventType.RECOVERED, worker_id=w.id, pool=w.pool, data=data)
    return Change(w.id, patch, "precision_fallback", [ev])
