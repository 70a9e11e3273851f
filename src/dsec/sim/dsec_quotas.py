"""DSec's elastic memory quotas in the simulator.

Each worker's memory trend (``dsec.quota.trend``, the server's formula over arrays), the allocator cap a worker
above its quota or limit runs into (an OOM), and ``dsec.quota.plan`` per card for the cards whose inputs changed."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dsec.decide.quotas import ROOM_HORIZON_S
from dsec.quota.elastic import QuotaConfig, WorkerMemory, plan
from dsec.quota.relief import CardWorker, relief
from dsec.quota.room import CardMate, make_room
from dsec.quota.trend import (
    AT_CEILING_GB,
    BURST_HOLD_S,
    BURST_RAMP_GB_PER_S,
    burst_at_risk,
    bursting,
    drainable,
    observe_arrays,
)
from dsec.sim.regimes import Regime, largest_first
from dsec.sim.scenario import Scenario

if TYPE_CHECKING:
    from dsec.sim.engine import Simulation


class QuotaPass(Regime):
    """Quotas of :class:`~dsec.sim.dsec_regime.DsecRegime` (set up by its ``attach``, see :meth:`_attach_quotas`)."""

    sc: Scenario
    reference: bool
    quota_config: QuotaConfig
    knobs: dict[tuple[str, str], float | None]
    pool_names: list[str]
    relieved: np.ndarray
    _set_accum: Callable[[int], None]  # BreakerPass's: the breaker's and relief's accumulation merged

    def recover_alone(self, g: int, t: float, cause: str, victims: list[int]) -> bool:
        raise NotImplementedError

    def _attach_quotas(self, sim: Simulation) -> None:
        sc, lay = self.sc, sim.layout
        # The inputs of each card's last quota plan (see _quotas).
        self.plan_mem = np.full(sim.N, -1.0)
        self.plan_quota = np.full(sim.N, -1.0)
        self.plan_slot = np.full(sim.N, -1, dtype=np.int64)
        self.plan_count = np.zeros(lay.cards, dtype=np.int64)
        self.quota = np.full(sim.N, sc.quota_base_gb())
        # The allocator limit each worker's probe enforces (NaN: none — the probe caps at the quota). A new worker's
        # is its pool's ceiling, as registration issues it (DirectiveFields.for_pool), until its card's first plan.
        self.limit = np.full(sim.N, sc.ceiling_gb())
        self.plan_limit = np.full(sim.N, -1.0)
        # Each worker's memory trend (dsec.quota.trend, the server's formula over arrays): t, used, ramp, peak.
        self.trend = [np.full(sim.N, -math.inf), np.zeros(sim.N), np.zeros(sim.N), np.zeros(sim.N),
                      np.full(sim.N, -math.inf), np.full(sim.N, -math.inf)]  # fmt: skip
        self.plan_bursting = np.zeros(sim.N, dtype=bool)
        # The cap each learner's current burst was snapshotted for (NaN: not yet); the probe snapshots once per burst
        # and cap, and again if the cap rose meanwhile (the snapshot for the old one is stale by then).
        self.burst_saved = np.full(sim.N, np.nan)
        self.plan_ramp = np.full(sim.N, -1.0)
        self.plan_peak = np.full(sim.N, -1.0)
        # Until when each card keeps the room made on it for a burst (dsec.quota.room): placement puts nobody there.
        self.room_until = np.full(lay.cards, -math.inf)

    def _ooms(self, t: float, run: np.ndarray, mem: np.ndarray) -> None:
        sim = self.sim
        # The quota is the worker's allocator cap (torch.cuda.set_per_process_memory_fraction): a worker above it
        # fails its own allocation; its neighbours on the card keep running.
        if not self.sc.dsec.quotas:
            cap = np.full(len(run), math.inf)
        elif self.sc.dsec.quota_limits:
            cap = self._allocator_cap(run)
        else:  # the first design: the allocator capped at the grant
            cap = self.quota[run]
        over = run[mem[run] > cap + 1e-9]
        drained: list[int] = []
        if len(over) and self.sc.dsec.quotas and self.sc.dsec.quota_limits and self.sc.dsec.memory_drain:
            slow = self._drained(t, over, mem)
            drained, over = over[slow].tolist(), over[~slow]
        victims = set(over.tolist())
        rest = run[~np.isin(run, [*victims, *drained])] if victims or drained else run
        # Quotas over-committed (bases alone exceed the card): the largest user fails first.
        victims |= largest_first(rest, mem, sim.slot_of, sim.layout.workers_per_gpu, self.sc.cluster.gpu_memory_gb)
        if victims:
            self.counts["oom_workers"] += len(victims)
            failed_groups = set(sim.group_of[sorted(victims)].tolist())
            # A drained worker whose group fails of this OOM goes down with it (restarted from its last snapshot).
            with_them = [w for w in drained if int(sim.group_of[w]) in failed_groups]
            drained = [w for w in drained if int(sim.group_of[w]) not in failed_groups]
            self.fail_workers(t, "oom", sorted(victims | set(with_them)))
        if drained:
            self.counts["memory_drains"] += len(drained)
            self.drain_workers(t, drained)

    def _drained(self, t: float, over: np.ndarray, mem: np.ndarray) -> np.ndarray:
        """Which of the workers ``over`` their cap the probe drains before the cap (``dsec.probe.recycle``'s rule):
        a limit that is final (at the worker's pool ceiling) and a slow climb into it — rising, below the burst line
        over the last sample, and not a burst the control plane still counts. The probe sees every optimizer step, so
        it stops such a climb at the last step that fits; the simulator sees 5 s samples and stops it at the first
        sample over."""
        sim = self.sim
        limit = self.limit[over]
        pools = [self.pool_names[int(g)] for g in sim.group_of[over].tolist()]
        ceiling = np.array([self.knobs[(p, "memory_ceiling_gb")] or math.inf for p in pools])
        slope = self._sample_slope(t, over, mem, math.inf)
        # The probe's rule (NaN limit: no limit, not drainable), and not a burst the control plane still counts.
        return np.asarray(drainable(limit, ceiling, slope) & ~bursting(self.trend[5][over], t), dtype=bool)

    def _burst_snapshots(self, t: float, run: np.ndarray, mem: np.ndarray) -> None:
        """The probe's snapshot ahead of a burst's OOM (``dsec.quota.trend.burst_at_risk``): a learner rising at a
        burst's rate over the last sample that would pass its allocator cap before the next one has its group
        snapshot now, once per burst and cap (a sample below the burst line ends the burst; a cap that rose since
        is a new risk). The cap is what binds first: the allocator limit or the card's room beside its card-mates.
        Call before this sample's trends. The probe sees every optimizer step and looks 2 s ahead; the simulator
        sees 5 s samples and looks one ahead. Actors hold no state to save (they restart alone)."""
        sim = self.sim
        ws = run[sim.is_learner[run]]
        if not len(ws):
            return
        slope = self._sample_slope(t, ws, mem, 0.0)
        self.burst_saved[ws[slope < BURST_RAMP_GB_PER_S]] = np.nan
        # What binds first, as the probe reads it: the allocator cap, or the card's room beside its card-mates.
        card = sim.slot_of[run] // sim.layout.workers_per_gpu
        on_card = np.bincount(card, weights=mem[run], minlength=sim.layout.cards)
        room = self.sc.cluster.gpu_memory_gb - (on_card[sim.slot_of[ws] // sim.layout.workers_per_gpu] - mem[ws])
        # Without quotas nothing caps the allocator (its limit is never planned): the card binds alone.
        cap = np.minimum(self._allocator_cap(ws), room) if self.sc.dsec.quotas else room
        saved = self.burst_saved[ws]
        fresh = np.isnan(saved) | (cap > np.where(np.isnan(saved), -np.inf, saved) + AT_CEILING_GB)
        due_at = burst_at_risk(mem[ws], slope, cap, self.sc.sample_interval_s) & fresh
        for w, c in zip(ws[due_at].tolist(), cap[due_at].tolist(), strict=True):
            self.burst_saved[w] = c
            self.counts["burst_snapshots"] += 1
            sim.save(int(sim.group_of[w]), t)

    def _allocator_cap(self, ws: np.ndarray) -> np.ndarray:
        """The allocator cap each worker's probe enforces: its limit, or its grant where no limit was issued."""
        cap: np.ndarray = np.where(np.isnan(self.limit[ws]), self.quota[ws], self.limit[ws])
        return cap

    def _sample_slope(self, t: float, ws: np.ndarray, mem: np.ndarray, unknown: float) -> np.ndarray:
        """Each worker's memory growth (GB/s) since its trend's last reading (``unknown`` where it has none)."""
        dt = t - self.trend[0][ws]
        with np.errstate(invalid="ignore", divide="ignore"):
            slope: np.ndarray = np.where(dt > 0, (mem[ws] - self.trend[1][ws]) / dt, unknown)
        return slope

    def _observe_trends(self, t: float, run: np.ndarray, mem: np.ndarray) -> None:
        """Each running worker's memory trend after this sample (``dsec.quota.trend.observe_arrays``)."""
        t0, used, ramp, peak, peak_t, burst_t = (arr[run] for arr in self.trend)
        out = observe_arrays(t0, used, ramp, peak, peak_t, mem[run], t, burst_t=burst_t)
        for arr, new in zip(self.trend, out, strict=True):
            arr[run] = new

    def _quotas(self, t: float, run: np.ndarray, mem: np.ndarray) -> None:
        """dsec.quota.plan per card (the capacity the card's workers share), for the cards whose inputs changed since
        their last plan: plan() is pure, so unchanged inputs would give an unchanged plan."""
        sim = self.sim
        wpg, cards = sim.layout.workers_per_gpu, sim.layout.cards
        card = sim.slot_of[run] // wpg
        counts = np.bincount(card, minlength=cards)
        burst_now = bursting(self.trend[5], t)
        changed = (
            (mem[run] != self.plan_mem[run])
            | (self.quota[run] != self.plan_quota[run])
            | (sim.slot_of[run] != self.plan_slot[run])
            | (self.trend[2][run] != self.plan_ramp[run])
            | (self.trend[3][run] != self.plan_peak[run])
            | (burst_now[run] != self.plan_bursting[run])
            | ~((self.limit[run] == self.plan_limit[run]) | (np.isnan(self.limit[run]) & (self.plan_limit[run] < 0)))
        )
        dirty = counts != self.plan_count
        dirty[card[changed]] = True
        if self.reference:
            dirty[:] = True
        sel = dirty[card]
        inputs = self.quota[run].copy()  # what this plan reads: the next one re-plans if the quota moved since
        limits_in = np.where(np.isnan(self.limit[run]), -1.0, self.limit[run])
        ws_all, card_d = run[sel], card[sel]
        order = np.argsort(card_d, kind="stable")
        ws_all, card_d = ws_all[order], card_d[order]
        if len(ws_all):
            # The plans' inputs as Python values, converted once for all cards (a plan changes only its own
            # card's workers, so reading them all up front reads what each plan would have read).
            ws_l, mem_l, quota_l = ws_all.tolist(), mem[ws_all].tolist(), self.quota[ws_all].tolist()
            ramp_l, peak_l = self.trend[2][ws_all].tolist(), self.trend[3][ws_all].tolist()
            limit_l, burst_l = self.limit[ws_all].tolist(), burst_now[ws_all].tolist()
            bounds = [0, *(np.flatnonzero(np.diff(card_d)) + 1).tolist(), len(ws_all)]
            for lo, hi in itertools.pairwise(bounds):
                self._plan_card(ws_l[lo:hi], mem_l[lo:hi], quota_l[lo:hi], ramp_l[lo:hi], peak_l[lo:hi],
                                limit_l[lo:hi], burst_l[lo:hi])  # fmt: skip
        self.plan_mem[run] = mem[run]
        self.plan_quota[run] = inputs
        self.plan_limit[run] = limits_in
        self.plan_bursting[run] = burst_now[run]
        self.plan_ramp[run] = self.trend[2][run]
        self.plan_peak[run] = self.trend[3][run]
        self.plan_slot[run] = sim.slot_of[run]
        self.plan_count = counts

    def _plan_card(
        self,
        ws: list[int],
        mem: list[float],
        quota: list[float],
        ramp: list[float],
        peak: list[float],
        limit: list[float],
        burst: list[bool],
    ) -> None:
        """``dsec.quota.plan`` for the workers ``ws`` of one card (their inputs alongside); its quota and limit
        changes take effect."""
        limits_on = self.sc.dsec.quota_limits
        cap = self.sc.cluster.gpu_memory_gb
        # Pools share a card; the memory knobs of the first worker's pool apply (they differ only if a policy
        # changed one pool's base or ceiling, which the example policies do not).
        pool = self.pool_names[int(self.sim.group_of[ws[0]])]
        base = float(self.knobs[(pool, "memory_base_gb")] or 0.0)
        ceiling = float(self.knobs[(pool, "memory_ceiling_gb")] or base)
        # Positional (worker_id, used, quota, ceiling, ramp, recent peak, limit, bursting): one per worker of every
        # card planned, ~1.4 M an hour at 10,000 workers, where keyword passing was a measurable part.
        if limits_on:
            members = [
                WorkerMemory(str(w), m, q, None, r, p, None if math.isnan(lim) else lim, b)
                for w, m, q, r, p, lim, b in zip(ws, mem, quota, ramp, peak, limit, burst, strict=True)
            ]
        else:
            members = [
                WorkerMemory(str(w), m, q, None, 0.0, None, None if math.isnan(lim) else lim, b)
                for w, m, q, lim, b in zip(ws, mem, quota, limit, burst, strict=True)
            ]
        result = plan(cap, base, ceiling, members, self.quota_config, device_gb=cap)
        for wid, q in result.changes.items():
            self.quota[int(wid)] = q
        for wid, lim in result.limit_changes.items():
            self.limit[int(wid)] = math.nan if lim is None else lim
        self.counts["quota_changes"] += len(result.changes)
        self.counts["limit_changes"] += len(result.limit_changes)

    def _relief(self, t: float, run: np.ndarray, mem: np.ndarray) -> None:
        """``dsec.quota.relief`` for the cards that may overflow (a vectorized pre-filter, loose by a rounding
        margin: the rule checks again) and the cards holding a relieved worker; its decisions take effect at once
        (the next sample's memory)."""
        sim = self.sim
        cap = self.sc.cluster.gpu_memory_gb
        horizon = self.quota_config.ramp_horizon_s
        ramp = self.trend[2]
        card = sim.slot_of[run] // sim.layout.workers_per_gpu
        projected = np.bincount(card, weights=mem[run] + ramp[run] * horizon, minlength=sim.layout.cards)
        look = projected > cap - 1e-6
        look[card[self.relieved[run]]] = True
        if not look.any():
            return
        burst = bursting(self.trend[5], t)
        for c in np.flatnonzero(look).tolist():
            ws = run[card == c].tolist()
            out = relief(
                cap,
                [
                    CardWorker(str(w), float(mem[w]), float(ramp[w]), bool(sim.accum[w] > 1), bool(self.relieved[w]),
                               bool(burst[w]))
                    for w in ws
                ],
                horizon,
            )  # fmt: skip
            for wid, held in [(x, True) for x in out.relieve] + [(x, False) for x in out.release]:
                self.relieved[int(wid)] = held
                self._set_accum(int(wid))
            self.counts["memory_relief"] += len(out.relieve)

    def _make_room(self, t: float, run: np.ndarray, mem: np.ndarray) -> None:
        """``dsec.quota.room.make_room`` for the cards whose projected usage may overflow them before the next sample
        (a vectorized pre-filter, loose by a rounding margin: the rule checks again); the worker it names moves alone
        to another card (``recover_alone``, cause ``make_room``: the supervisor's move of an actor; the card it leaves
        is held, so placement leaves it out), at once: its memory leaves the card before the next sample."""
        sim = self.sim
        if not self.sc.dsec.restart_actors_alone:
            return
        cap, horizon = self.sc.cluster.gpu_memory_gb, ROOM_HORIZON_S
        ramp = self.trend[2]
        card = sim.slot_of[run] // sim.layout.workers_per_gpu
        projected = np.bincount(
            card, weights=mem[run] + np.maximum(ramp[run], 0.0) * horizon, minlength=sim.layout.cards
        )
        # A card holding room already gets no second request while it lasts (the control plane's rule too).
        look = np.flatnonzero((projected > cap - 1e-6) & ~(self.room_until > t))
        if not len(look):
            return
        burst = bursting(self.trend[5], t)
        for c in look.tolist():
            ws = run[card == c].tolist()
            mates = [
                CardMate(str(w), float(mem[w]), float(ramp[w]),
                         bool(not sim.is_learner[w] and not burst[w] and not sim.absent[w]),
                         bool(sim.is_learner[w]) or self.sc.dsec.make_room_for == "all")
                for w in ws
            ]  # fmt: skip
            chosen = make_room(cap, mates, horizon)
            if chosen is None:
                continue
            # The card is held for the burst (its hold) from the request on, moved or not, as the control plane holds
            # it: placement leaves it out (the move below included), and it gets no second request meanwhile.
            self.room_until[c] = t + BURST_HOLD_S
            w = int(chosen)
            moved = self.recover_alone(int(sim.group_of[w]), t, "make_room", [w])
            self.counts["make_room" if moved else "make_room_nowhere"] += 1
