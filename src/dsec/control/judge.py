"""Health judgment on the control plane: the owner of each worker's decision state, calling the decision core.

Two entry points, both called by ``ControlPlane`` with the worker state it owns:

* ``on_beat`` — per heartbeat, under the worker's lock: ``dsec.decide.judge_beat`` (breaker, precision guard,
  anomaly responses). Its verdict rides back in the same heartbeat answer.
* ``periodic_inputs`` / ``PeriodicInputs.run`` / ``finish_periodic`` — from the reconcile loop:
  ``dsec.decide.judge_pool`` (fleet comparison and pool slowdowns), ``plan_pool_quotas`` (elastic memory quotas),
  then ``precision_restore``. ``run`` reads only frozen views and copies, so the reconciler may call it on a thread
  (at thousands of workers it takes 100+ ms).

The decisions are pure functions in ``dsec.decide`` (the simulator calls the same ones). This module keeps what
they need between calls — one breaker and one precision guard per worker, the fleet flags — turns live workers into
views, and routes committed alert events to the sinks.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsec import pacing
from dsec.alerts import Alert, AlertRouter, Severity
from dsec.breaker import Breaker, BreakerConfig, Caps
from dsec.control.views import beat_view, view_of
from dsec.control.worker_alerts import worker_alert
from dsec.decide import (
    SOURCE,
    BeatInputs,
    CardMemo,
    Change,
    FleetVerdict,
    QuotaVerdict,
    Verdict,
    WorkerView,
    caps_for,
    judge_beat,
    judge_pool,
    observe_memory,
    plan_pool_quotas,
    precision_restore,
)
from dsec.health.fleet import FleetConfig
from dsec.health.interventions import PrecisionGuard
from dsec.model import Event, EventType, Pool, WorkerState
from dsec.quota import MemoryTrend, PoolMemory, QuotaConfig

if TYPE_CHECKING:
    from dsec.control.state import HotState, LiveWorker

log = logging.getLogger(__name__)

#: Workers whose views ``Judge.active_views`` builds between two turns of the event loop (~1-2 ms of work).
VIEW_CHUNK = 1000

__all__ = ["SOURCE", "Change", "Judge", "JudgeConfig", "Verdict", "view_of"]


@dataclass(frozen=True)
class JudgeConfig:
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    quota: QuotaConfig = field(default_factory=QuotaConfig)
    fleet_interval_s: float = 1.0
    quota_interval_s: float = 2.0
    precision_fallback: Mapping[str, str] = field(default_factory=lambda: {"bf16": "fp16", "fp16": "fp32"})
    precision_stable_s: float = 300.0
    grad_spike_factor: float = 10.0
    # The breaker's memory cap as a fraction of the memory ceiling; None: memory is not judged by the breaker
    # (dsec.decide.caps_for says why that is the default). DSEC_MEMORY_PRESSURE sets it for `dsec serve`.
    memory_pressure: float | None = None
    # Room for a burst (dsec.quota.room): an actor moves off a card that a burst will fill, if that card holds a
    # learner. DSEC_MAKE_ROOM=0 turns it off for `dsec serve`.
    make_room: bool = True

    def __post_init__(self) -> None:
        p = self.memory_pressure
        if p is not None and not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1):
            raise ValueError(f"memory_pressure={p!r} is invalid: expected a number in (0, 1], or None (off)")


class Judge:
    def __init__(
        self,
        state: HotState,
        config: JudgeConfig | None = None,
        router: AlertRouter | None = None,
        forward_worker_alerts: bool = True,
    ) -> None:
        self.state = state
        self.config = config or JudgeConfig()
        self.router = router
        self.forward_worker_alerts = forward_worker_alerts
        self.breakers: dict[str, Breaker] = {}
        self.guards: dict[str, PrecisionGuard] = {}
        self.flags: dict[str, set[str]] = {}  # worker -> fleet features it is an outlier on
        # Workers the last fleet comparison could judge on speed (their role had enough peers reporting it).
        self.judged: set[str] = set()
        self.slow_pools: set[str] = set()
        self.latency_floors: dict[str, float] = {}  # cap safety, per pool (decide.safe_latency_floor)
        self.pool_actors: dict[str, int] = {}  # active actors per pool at the last fleet pass (decide.pause)
        self.pool_step_ms: dict[str, float | None] = {}  # its learners' median step_ms_mean (decide.pause)
        self.pool_memory: dict[str, PoolMemory] = {}
        # Breaker levels recorded before a restart (from the durable breaker events), by worker.
        self.resume_levels: dict[str, int] = {}
        self._last_fleet = -math.inf
        self._last_quota = -math.inf
        self.memory_trends: dict[str, MemoryTrend] = {}  # per active worker: ramp and recent peak, for the quotas
        # Each pool's cards' last quota plans (decide.plan_pool_quotas's memo): read and replaced only by the pass's
        # judgments (PeriodicInputs.run: on a thread at scale, one pass at a time), never by the loop.
        self.quota_memo: dict[str, CardMemo] = {}

    # -- decision state --------------------------------------------------------------------------------
    def caps_for(self, w: LiveWorker) -> Caps:
        """The caps in force for ``w`` (``dsec.decide.caps_for``). Kept on the record while its inputs are the same:
        the pool and the directive's fields are frozen and swapped on change, so the same objects (and the same cap
        safety floor) give the same caps; every beat reads them twice (its judgment, its answer)."""
        pool = self.state.pools.get(w.pool)
        fields = w.directive.fields
        floor = self.latency_floors.get(w.pool)
        kept = w.caps_cache
        if kept is not None and kept[0] is pool and kept[1] is fields and kept[2] == floor:
            return kept[3]
        caps = caps_for(
            pool.thresholds if pool else None,
            pool.memory_ceiling_gb if pool else None,
            fields,
            # The pool's own switch for the breaker's memory path, else the control plane's default.
            pool.memory_pressure if pool and pool.memory_pressure is not None else self.config.memory_pressure,
            floor,
        )
        w.caps_cache = (pool, fields, floor, caps)
        return caps

    def breaker(self, w: LiveWorker, now: float) -> Breaker:
        b = self.breakers.get(w.id)
        if b is None:
            # First sight of this worker (new, or after a control-plane restart): resume at the level the
            # last recorded breaker transition left it at (a manual directive is not a breaker level).
            level = self.resume_levels.pop(w.id, 0)
            b = self.breakers[w.id] = Breaker.resumed(self.config.breaker, level, now)
        return b

    def breaker_state(self, w: LiveWorker, now: float) -> dict[str, Any]:
        b = self.breakers.get(w.id)
        if b is None:  # not judged (yet, or any more): what it would resume at, without keeping it
            b = Breaker.resumed(self.config.breaker, self.resume_levels.get(w.id, 0), now)
        return b.to_dict()

    def guard(self, worker_id: str) -> PrecisionGuard:
        g = self.guards.get(worker_id)
        if g is None:
            c = self.config
            g = self.guards[worker_id] = PrecisionGuard(
                mapping=dict(c.precision_fallback), spike_factor=c.grad_spike_factor, stable_s=c.precision_stable_s
            )
        return g

    def forget(self, worker_id: str) -> None:
        for d in (self.breakers, self.guards, self.flags):
            d.pop(worker_id, None)
        self.judged.discard(worker_id)

    # -- per beat --------------------------------------------------------------------------------------
    def on_beat(
        self,
        w: LiveWorker,
        metrics: Mapping[str, Any],
        worker_events: Sequence[Event],
        acked_version: int,
        now: float,
    ) -> tuple[Verdict, Breaker | None]:
        """Decide for one beat. Returns the verdict and, when the breaker moved, its state before (to
        restore if the verdict cannot be committed)."""
        b = self.breaker(w, now)
        beat = BeatInputs(
            beat_view(w),
            self.state.pools.get(w.pool),
            self.caps_for(w),
            metrics,
            worker_events,
            acked_version,
            now,
            self.pool_actors.get(w.pool),
            self.pool_step_ms.get(w.pool),
        )
        verdict = judge_beat(beat, b, self.guard(w.id))
        return verdict, b.undo() if verdict.breaker_moved else None

    def issued(self, w: LiveWorker, verdict: Verdict, version: int, now: float) -> None:
        """The verdict's directive was committed as ``version``."""
        if verdict.breaker_issued:
            self.breakers[w.id].issued(version, now)

    def restore(self, w: LiveWorker, saved: Breaker | None) -> None:
        if saved is not None:
            self.breakers[w.id] = saved

    def route(self, ev: Event) -> None:
        """Hand a recorded alert event to the sinks (after it was committed)."""
        if self.router is None or ev.type is not EventType.ALERT:
            return
        if ev.data.get("source") != SOURCE:  # a worker's alert event (stamped source=worker at ingest)
            if self.forward_worker_alerts:
                self.router.submit(worker_alert(ev))
            return
        data = dict(ev.data)
        data.pop("source", None)
        name = str(data.pop("name", None) or data.get("reason") or "worker_alert")
        raw = data.pop("severity", "warning")
        severity = Severity(raw) if raw in {s.value for s in Severity} else Severity.WARNING
        try:
            alert = Alert(
                name=name,
                severity=severity,
                ts=ev.ts,
                pool=ev.pool or None,
                worker_id=ev.worker_id or None,
                summary=str(data.pop("summary", "")),
                data=data,
            )
        except ValueError:
            log.warning("alert %r could not be routed", name, exc_info=True)
            return
        self.router.submit(alert)

    # -- periodic --------------------------------------------------------------------------------------
    def _due(self, now: float) -> tuple[bool, bool]:
        """Whether a pass at ``now`` has (a fleet judgment, a quota judgment) to make."""
        return (
            now - self._last_fleet >= self.config.fleet_interval_s,
            now - self._last_quota >= self.config.quota_interval_s,
        )

    def periodic_due(self, now: float) -> bool:
        """Whether a pass at ``now`` has a fleet or a quota judgment to make (``periodic_inputs`` would take views)."""
        return any(self._due(now))

    async def active_views(self, chunk: int | None = None) -> dict[str, list[WorkerView]]:
        """The views of the active workers by pool (what ``periodic_inputs`` takes), giving the event loop a turn
        every ``chunk`` workers (default :data:`VIEW_CHUNK`): at 10,000 workers building them takes ~15-20 ms, which
        a batch of beats arriving meanwhile waited out whole. A worker that leaves meanwhile is left out if its turn
        comes after; one that registers meanwhile waits for the next pass, as it would a moment later."""
        n = VIEW_CHUNK if chunk is None else chunk
        workers = list(self.state.workers.values())
        out: dict[str, list[WorkerView]] = {}
        for start in range(0, len(workers), n):
            if start:
                await asyncio.sleep(0)
            _add_active_views(out, workers[start : start + n])
        return out

    def periodic_inputs(self, now: float, views: dict[str, list[WorkerView]] | None = None) -> PeriodicInputs:
        """What this pass's fleet and quota judgments read (none, when neither is due), taken now: frozen views of
        the active workers (``views``, when the caller took them with ``active_views``) and copies of the judge's own
        state, so ``PeriodicInputs.run`` may run on another thread while beats go on. Hand its result to
        ``finish_periodic``."""
        fleet_due, quota_due = self._due(now)
        if fleet_due:
            self._last_fleet = now
        if quota_due:
            self._last_quota = now
        pools = dict(self.state.pools)
        memory, cards = self.memory_inputs(pools.values()) if quota_due else ({}, {})
        return PeriodicInputs(
            now=now,
            fleet_due=fleet_due,
            quota_due=quota_due,
            # One view of the active workers for both judgments (building it is O(workers)).
            by_pool=(self._active_by_pool() if views is None else views) if fleet_due or quota_due else {},
            pools=pools,
            flags=dict(self.flags) if fleet_due else {},
            slow_pools=frozenset(self.slow_pools),
            memory=memory,
            cards=cards,
            trends=self.memory_trends,
            config=self.config,
            quota_memo=self.quota_memo,
            room_held=dict(self.state.room_until) if quota_due and self.config.make_room else None,
        )

    def finish_periodic(self, inputs: PeriodicInputs, result: PeriodicResult) -> tuple[list[Change], list[Event]]:
        """Take in the judgments ``inputs.run()`` made, then the precision restores: (directive changes, events)."""
        events: list[Event] = []
        changes: list[Change] = []
        if inputs.fleet_due:
            events += self._take_fleet(inputs, result.fleet)
        if inputs.quota_due:
            # A worker lost for a moment (a process that stalled past its beats) keeps its trend: it comes back with
            # its ramp and peak, not as a newcomer with none (mid-burst, that hid the burst from the next plans).
            # A deregistered or forgotten worker's trend goes.
            lost = WorkerState.LOST
            kept = {
                wid: t
                for wid, t in self.memory_trends.items()
                if wid not in result.trends and (w := self.state.workers.get(wid)) is not None and w.state is lost
            }
            self.memory_trends = {**kept, **result.trends} if kept else result.trends
            for name, v in result.quotas.items():
                self.pool_memory[name] = v.accounting
                changes += v.changes
                for room in v.rooms:  # placement keeps the card free meanwhile; the launcher moves the actor
                    self.state.room_until[room.card] = room.until
                    events.append(room.event)
            for card in [c for c, until in self.state.room_until.items() if until <= inputs.now]:
                del self.state.room_until[card]
        # Only guards with a fallback in force have anything to restore (one per worker exists: skip the rest first).
        for wid, guard in [(wid, g) for wid, g in self.guards.items() if g.original is not None]:
            w = self.state.workers.get(wid)
            if w is None:
                continue
            if (c := precision_restore(view_of(w), guard, inputs.now)) is not None:
                changes.append(c)
        return changes, events

    def _active_by_pool(self) -> dict[str, list[WorkerView]]:
        return _add_active_views({}, list(self.state.workers.values()))

    def _take_fleet(self, inputs: PeriodicInputs, verdicts: Mapping[str, FleetVerdict]) -> list[Event]:
        events: list[Event] = []
        judged: set[str] = set()
        for pool_name, v in verdicts.items():
            events += v.events
            judged |= v.judged
            for wid, flags in v.flags.items():
                w = self.state.workers.get(wid)
                # A worker that left while the judgment ran (off the loop) was forgotten: do not bring it back.
                if w is not None and w.state is not WorkerState.DEREGISTERED:
                    self.flags[wid] = flags
            if inputs.pools.get(pool_name) is not None:
                (self.slow_pools.add if v.slow_pool else self.slow_pools.discard)(pool_name)
                if v.latency_floor_ms is None:
                    self.latency_floors.pop(pool_name, None)
                else:
                    self.latency_floors[pool_name] = v.latency_floor_ms
        self.judged = judged
        # For the top rung's rule (dsec.decide.pause), as the pass counted them (off the loop at scale).
        self.pool_actors = {p: v.actors for p, v in verdicts.items()}
        self.pool_step_ms = {p: v.learner_step_ms for p, v in verdicts.items()}
        for gone in set(self.latency_floors) - set(inputs.by_pool):  # no active worker: nothing to be safe from
            self.latency_floors.pop(gone, None)
        return events

    def card_memory_gb(self) -> dict[str, float]:
        """Each card's memory (``Device.card_id``): the largest its devices give (a card's slots each give the
        card's memory; a device without ``card`` is a card of its own)."""
        out: dict[str, float] = {}
        for d in self.state.devices.values():
            out[d.card_id] = max(out.get(d.card_id, 0.0), d.memory_gb)
        return out

    def memory_inputs(
        self, pools: Iterable[Pool]
    ) -> tuple[dict[str, tuple[float | None, float | None]], dict[str, tuple[str, float]]]:
        """What quotas are planned over: per pool, the memory of its cards (each card once, however many of its
        slots the pool holds) and its largest card (no allocator limit exceeds one card); per device of a card of
        known memory, that card and its memory."""
        gb = self.card_memory_gb()
        devices = self.state.devices
        memory: dict[str, tuple[float | None, float | None]] = {}
        for p in pools:
            sizes = [gb[c] for c in {devices[d].card_id for d in p.devices if d in devices}]
            memory[p.name] = (sum(sizes) or None, max(sizes, default=0.0) or None)
        cards = {d.id: (d.card_id, gb[d.card_id]) for d in devices.values() if gb[d.card_id] > 0}
        return memory, cards


def _add_active_views(out: dict[str, list[WorkerView]], workers: Iterable[LiveWorker]) -> dict[str, list[WorkerView]]:
    """Add the views of the active ones of ``workers`` to ``out`` by pool; answers ``out``."""
    for w in workers:
        if w.state is WorkerState.ACTIVE:
            out.setdefault(w.pool, []).append(view_of(w))
    return out


@dataclass(frozen=True)
class PeriodicResult:
    fleet: dict[str, FleetVerdict] = field(default_factory=dict)  # by pool, for the pools with active workers
    trends: dict[str, MemoryTrend] = field(default_factory=dict)
    quotas: dict[str, QuotaVerdict] = field(default_factory=dict)  # by pool, every pool


@dataclass(frozen=True)
class PeriodicInputs:
    """One pass's fleet and quota judgments, over what ``Judge.periodic_inputs`` took: ``run`` only reads these
    (frozen views, copies) and calls the pure decision core, so it is safe off the event loop."""

    now: float
    fleet_due: bool
    quota_due: bool
    by_pool: dict[str, list[WorkerView]]  # the active workers, by pool
    pools: dict[str, Pool]
    flags: dict[str, set[str]]  # each worker's fleet flags before this pass
    slow_pools: frozenset[str]
    memory: dict[str, tuple[float | None, float | None]]  # pool -> (capacity, largest device), GB
    cards: dict[str, tuple[str, float]]  # device -> (its card, the card's memory in GB), for cards of known memory
    trends: Mapping[str, MemoryTrend]
    config: JudgeConfig
    quota_memo: dict[str, CardMemo] = field(default_factory=dict)  # the judge's, mutated by run (see Judge)
    room_held: dict[str, float] | None = None  # card -> until when room made on it is held (None: no room made)

    @property
    def workers(self) -> int:
        return sum(len(ws) for ws in self.by_pool.values())

    def run(self) -> PeriodicResult:
        c, now = self.config, self.now
        fleet: dict[str, FleetVerdict] = {}
        if self.fleet_due:
            for name, ws in self.by_pool.items():
                was_slow = name in self.slow_pools
                fleet[name] = judge_pool(self.pools.get(name), name, ws, self.flags, was_slow, c.fleet, now,
                                         c.breaker.margin)  # fmt: skip
        if not self.quota_due:
            return PeriodicResult(fleet)
        trends = observe_memory(self.trends, [w for ws in self.by_pool.values() for w in ws], now)
        quotas = {}
        for name, pool in self.pools.items():
            pacing.checkpoint()
            capacity, device_gb = self.memory[name]
            ws = self.by_pool.get(name, [])
            memo = self.quota_memo.setdefault(name, {})
            quotas[name] = plan_pool_quotas(pool, capacity, ws, c.quota, now, trends=trends, device_gb=device_gb,
                                            cards=self.cards, memo=memo, room_held=self.room_held)  # fmt: skip
        for gone in set(self.quota_memo) - set(self.pools):
            del self.quota_memo[gone]
        return PeriodicResult(fleet, trends, quotas)
