"""DSec as the simulator runs it: the same cluster run by DSec's *own* decision code, called in virtual time.

Per sample: elastic quotas (``dsec.quota.plan``) per card (:mod:`dsec.sim.dsec_quotas`), each worker's breaker
(``dsec.decide.breaker_step`` with ``dsec.decide.caps_for``; :mod:`dsec.sim.dsec_breakers`), degraded-device
detection (:mod:`dsec.sim.dsec_devices`), placement with learned device personalities (:mod:`dsec.sim.dsec_placement`)
and, on its interval, the policy engine (``dsec.policy.Engine``) over the pool gauges (``dsec.decide.policy_samples``).
The simulator only carries the decisions out: a directive is in force from the next sample on, its ack arrives with
the sample after. It never reads the hidden truth.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from dsec.breaker import BreakerConfig
from dsec.decide import PoolGauges, policy_samples
from dsec.decide.cadence import snapshot_interval_s
from dsec.decide.gauges import sync_success, utilization
from dsec.health.fleet import DEFAULT_FEATURES, FleetConfig
from dsec.model import DeviceHealth, Pool, WorkerState
from dsec.policy import Engine, PolicySet, Scope, SeriesStore
from dsec.policy.rules import Knob
from dsec.quota.elastic import QuotaConfig
from dsec.scheduler import DeviceHealthConfig, DeviceHealthTracker, NodeInfo, classify_load
from dsec.sim.dsec_breakers import BreakerPass
from dsec.sim.dsec_devices import DeviceHealthPass
from dsec.sim.dsec_placement import PlacementPass, _CardProfiles
from dsec.sim.dsec_quotas import QuotaPass
from dsec.sim.scenario import Scenario
from dsec.sim.world import RUN

if TYPE_CHECKING:
    from dsec.sim.engine import Simulation

#: The control plane plans quotas every 2 s (health.md); a sample covers ``sample_interval_s``, so one plan per
#: sample grows a quota by the same GB per second.
CONTROL_QUOTA_INTERVAL_S = 2.0


class DsecRegime(PlacementPass, DeviceHealthPass, QuotaPass, BreakerPass):
    name = "dsec"

    def __init__(self, scenario: Scenario, policies: PolicySet | None = None) -> None:
        self.sc = sc = scenario
        d = sc.dsec
        super().__init__(d.snapshot_interval_s, d.snapshot_cost_s, d.restart_s)
        self.policies = policies
        self.breaker_config = BreakerConfig(
            window_s=d.breaker_window_samples * sc.sample_interval_s,
            min_samples=d.breaker_window_samples,
            recovery_s=d.breaker_recovery_s,
            max_recovery_s=max(600.0, d.breaker_recovery_s),
        )
        # One plan per sample: growth covers the observed ramp for two plans ahead, as on the server.
        self.quota_config = QuotaConfig(
            step_gb=1.0 * sc.sample_interval_s / CONTROL_QUOTA_INTERVAL_S, ramp_horizon_s=2 * sc.sample_interval_s
        )
        # The simulator compares workers for device health only, so only on the compute features it judges cards by
        # (SLOW_FEATURES); a worker's compute here is its step time on its card (throttling included), without the
        # link's latency or jitter — what the probe's compute_ms_p50 measures.
        self.fleet_config = FleetConfig(features=tuple(f for f in DEFAULT_FEATURES if f.name == "compute_ms_p50"))
        self.health_config = DeviceHealthConfig()

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        sc, lay = self.sc, sim.layout
        self.pool_names = [f"g{g}" for g in range(sim.G)]
        base = Pool("sim")
        self.knobs: dict[tuple[str, str], float | None] = {}
        for p in self.pool_names:
            self.knobs[(p, "latency_cap_ms")] = sc.dsec.latency_cap_ms
            self.knobs[(p, "bandwidth_cap_mbps")] = sc.dsec.bandwidth_cap_mbps
            self.knobs[(p, "memory_base_gb")] = sc.quota_base_gb()
            self.knobs[(p, "memory_ceiling_gb")] = sc.ceiling_gb()
            self.knobs[(p, "snapshot_compression_level")] = float(base.snapshot_compression_level)
            self.knobs[(p, "snapshot_interval_s")] = sc.dsec.snapshot_interval_s
            self.knobs[(p, "gpu_quota")] = None
        self.reference = False
        self._attach_quotas(sim)
        self._attach_breakers(sim)
        # Each group's failure history for the snapshot cadence, as the supervisor keeps it: seconds trained and
        # the restarts that rolled it back to its snapshot.
        self.exposure_s = np.zeros(sim.G)
        self.rollbacks = np.zeros(sim.G, dtype=np.int64)
        self.pool_meltdowns = np.zeros(sim.G, dtype=np.int64)
        self.last_recovery = np.full(sim.G, math.nan)
        self.recovering_until = np.full(sim.G, -math.inf)
        self.degraded = np.zeros(lay.cards, dtype=bool)  # placement excludes these (dsec.scheduler.place does too)
        self.probation = np.zeros(lay.cards, dtype=bool)  # on probation after a degradation
        # group -> (the degraded card it could not be moved off, when it last tried): the supervisor tries again
        self.unmovable: dict[int, tuple[int, float]] = {}
        self.card_names = [lay.card_name(c) for c in range(lay.cards)]
        self.health_by_name = dict.fromkeys(self.card_names, DeviceHealth.HEALTHY)
        self.tracker = DeviceHealthTracker(self.health_config)
        self.slot_devices = [self._slot_device(s) for s in range(lay.slots)]
        self.slot_name_to_index = {d.id: s for s, d in enumerate(self.slot_devices)}
        self.profiles = _CardProfiles({d.id: lay.card_name(lay.card_of(s)) for s, d in enumerate(self.slot_devices)})
        self.nodes = {f"n{i}": NodeInfo(f"n{i}") for i in range(lay.nodes)}
        self.load_class = classify_load(
            {
                "sync_latency_ms_p50": sc.network.base_latency_ms + sim.transfer_ms,
                "step_ms_mean": sc.groups.step_s * 1000.0,
                "episode_length_mean": sc.groups.episode_length,
            }
        )
        policies = self.policies
        self.engine = Engine(policies) if policies is not None and policies.rules else None
        history = policies.history_s if policies is not None else 0.0
        self.series = SeriesStore(retention_s=history + 2 * sc.policy_interval_s)
        self.policy_every = max(1, round(sc.policy_interval_s / sc.sample_interval_s))
        self.scopes = [Scope(p) for p in self.pool_names]
        self.recorded: set[int] = set()  # victims whose run a failed per-worker restart already recorded

    def recover_alone(self, g: int, t: float, cause: str, victims: list[int]) -> bool:
        """DSec's per-worker restarts (``restart_scope: worker``, the default for actor groups; docs/scheduling.md):
        a failed actor is placed anew with what was learned (placement may keep it on its card) and started alone on
        a warm standby; the learner goes on with the other actors. Nowhere to go: the group restarts as a whole."""
        sim, d = self.sim, self.sc.dsec
        # A move off a degraded card too (the supervisor re-places the job with every other worker pinned and
        # restarts only the moved workers of a ``restart_scope: worker`` group, each from its own snapshot).
        # (Only from a running group, of actors not already restarting alone: else the group moves as a whole.)
        moving_actors = (
            cause in ("migration", "make_room")
            and sim.status[g] == RUN
            and not bool(sim.is_learner[victims].any() or sim.absent[victims].any())
        )
        if not d.restart_actors_alone or not (self.actors_only(cause, victims) or moving_actors):
            return False
        if not moving_actors:  # a failure is learned from before the new slot is chosen
            # A drained process deregisters (a planned stop): the control plane records no failure for it.
            self._record_runs(victims, t, failed=cause != "drain", oom=cause == "oom")
        per_card = sim.layout.workers_per_gpu
        chosen = self.choose_elsewhere(g, victims, t)
        if chosen is None:
            if not moving_actors:
                self.recorded.update(victims)  # restart() must not record these runs twice
            return False
        if moving_actors:
            self._record_runs(victims, t, failed=False, oom=False)
        old = {w: int(sim.slot_of[w]) for w in victims}
        sim.release(victims)
        for w, slot in chosen.items():
            sim.assign(w, slot)
        # As for a group (restart): a warm restart unless the old card is gone (off or degraded) — placement may pick
        # another card of the node for the new process at no extra cost.
        gone = sim.card_off | self.degraded
        moved = any(gone[slot // per_card] for slot in old.values())
        if cause == "make_room":  # the old card is healthy: a move costs a reschedule only to another node
            lay = sim.layout
            moved = any(
                lay.node_of_card(old[w] // per_card) != lay.node_of_card(s // per_card) for w, s in chosen.items()
            )
        for w in victims:
            self._reset_worker(w)
        recovery = (d.restart_reschedule_s if moved else d.restart_s) + (d.snapshot_cost_s if moving_actors else 0.0)
        self.last_recovery[g] = recovery
        self.counts[f"restart_alone:{cause}"] += 1
        sim.lose_workers(g, t, cause, victims, recovery)
        return True

    def restart(self, g: int, t: float, cause: str, victims: list[int]) -> float:
        if cause == "oom" and self._foreseen(victims):
            # A burst the probe saw coming: the group snapshotted just before it failed, so the restart loses next
            # to nothing whatever the cadence. Young's interval is for the failures nobody foresaw (the supervisor
            # counts the same way: launch/supervisor.py, ``foreseen``).
            self.counts["foreseen_rollbacks"] += 1
        elif cause in ("crash", "oom"):
            self.rollbacks[g] += 1  # a failure the group restarts from its snapshot for (planned moves save first)
        unrecorded = [w for w in victims if w not in self.recorded]
        self.recorded.clear()
        self._record_runs(unrecorded, t, failed=cause in ("crash", "oom"), oom=cause == "oom")
        sim = self.sim
        d, per_card = self.sc.dsec, sim.layout.workers_per_gpu
        gone = sim.card_off | self.degraded
        moving = cause in ("migration", "power") or any(
            sim.slot_of[w] < 0 or gone[sim.slot_of[w] // per_card] for w in sim.workers_of(g)
        )
        # DSec is charged what it really costs: warm standbys restart in place in ~3 s (measured); a move to
        # another card or node costs a reschedule, and a migration also the snapshot taken before it.
        self.restart_s = (d.restart_reschedule_s if moving else d.restart_s) + (
            d.snapshot_cost_s if cause == "migration" else 0.0
        )
        for w in sim.workers_of(g):
            self._reset_worker(w)
        self.last_recovery[g] = self.restart_s
        return super().restart(g, t, cause, victims)

    def _foreseen(self, victims: list[int]) -> bool:
        """Whether a learner among ``victims`` failed in a burst its group snapshotted ahead of
        (``QuotaPass._burst_snapshots``; a burst's snapshot is forgotten when the burst ends)."""
        return any(self.sim.is_learner[w] and not math.isnan(self.burst_saved[w]) for w in victims)

    def power_loss(self, g: int, t: float, victims: list[int]) -> None:
        # The power-saving window is on a schedule: DSec snapshots the group before its cards go (a planned move).
        self.counts["planned_moves"] += 1
        self._record_runs(victims, t, failed=False, oom=False)
        self.sim.fail(g, t, "power", victims, durable_first=True)

    def _reset_worker(self, w: int) -> None:
        sim = self.sim
        self.breakers.pop(w, None)
        self.closed[w] = True
        self.fed_k[w] = -1
        self.valid_from[w] = int(sim.now // self.sc.sample_interval_s) + 1  # samples of the old process: gone
        sim.bits_frac[w], sim.accum[w], sim.paused[w] = 1.0, 1.0, False
        self.breaker_accum[w], self.relieved[w] = 1.0, False
        pool = self.pool_names[int(sim.group_of[w])]
        self.quota[w] = self.knobs[(pool, "memory_base_gb")] or 0.0
        # A new process registers anew: its limit starts at its pool's ceiling (DirectiveFields.for_pool).
        self.limit[w] = self.knobs[(pool, "memory_ceiling_gb")] or math.nan
        for arr, v in zip(self.trend, (-math.inf, 0.0, 0.0, 0.0, -math.inf, -math.inf), strict=True):
            arr[w] = v  # a new process: the old one's trend is gone with it
        self.burst_saved[w] = math.nan

    def durable_interval(self, g: int, t: float) -> float:
        if self.sc.dsec.snapshot_cadence == "fixed":
            return self.durable_interval_s
        d = self.sc.dsec
        own = (float(self.exposure_s[g]), int(self.rollbacks[g]))
        peers = (0.0, 0)
        if d.snapshot_history == "job":  # the other groups' history as the prior, as the launcher's history file gives
            peers = (float(self.exposure_s.sum()) - own[0], int(self.rollbacks.sum()) - own[1])
        return snapshot_interval_s(d.snapshot_cost_s, *own, d.snapshot_interval_s, peers=peers)

    # -- per sample --------------------------------------------------------------------------------------------------
    def observe(self, t: float, k: int, mem: np.ndarray, compute_s: np.ndarray, latency_ms: np.ndarray) -> None:
        self.exposure_s += np.where(self.sim.status == RUN, self.sc.sample_interval_s, 0.0)
        run = self.running_workers()
        if len(run):
            self._ooms(t, run, mem)
            run = self.running_workers()
        if len(run):
            # The burst snapshot is the probe's and needs no quota: without one its bound is the card's room.
            if self.sc.dsec.burst_snapshots:
                self._burst_snapshots(t, run, mem)
            if self.sc.dsec.quotas or self.sc.dsec.burst_snapshots:
                self._observe_trends(t, run, mem)
            if self.sc.dsec.quotas:
                if self.sc.dsec.make_room:  # before the plan: the limits it issues count the room made
                    self._make_room(t, run, mem)
                    run = self.running_workers()
                self._quotas(t, run, mem)
                if self.sc.dsec.memory_relief:
                    self._relief(t, run, mem)
            if self.sc.dsec.breaker:
                self._breakers(k, t, run, mem, latency_ms)
        if self.sc.dsec.device_health:
            self._device_health(t, run, compute_s)
        if self.engine is not None and k % self.policy_every == 0:
            self._policies(t, mem)

    # -- policies: dsec.policy.Engine over the pool gauges -------------------------------------------------------------
    def _policies(self, t: float, mem: np.ndarray) -> None:
        sim = self.sim
        assert self.engine is not None
        running = sim.status[sim.group_of] == RUN
        gauges: dict[str, PoolGauges] = {}
        n = sim.n
        for g, pool in enumerate(self.pool_names):
            ws = slice(g * n, (g + 1) * n)  # sim.workers_of(g) as a slice: numpy views, not a gather per array
            active = running[ws]
            q = self.quota[ws]
            used = mem[ws]
            n_active = int(active.sum())
            gauges[pool] = PoolGauges(
                utilization=utilization((used[active] / q[active]).tolist()),
                sync_success=sync_success(float(sim.sync_ok[g]), float(sim.sync_ops[g])),
                recovery_s=float(self.last_recovery[g]),
                meltdowns=float(self.pool_meltdowns[g]),
                workers={WorkerState.ACTIVE: n_active, WorkerState.LOST: 0},  # a lost worker fails its group here
                pending=0,  # directives are acked with the next sample
                memory={"used": float(used[active].sum()), "granted": float(q[active].sum())},
            )
        self.series.add(t, policy_samples(gauges))

        def read(scope: Scope, knob: Knob) -> float | None:
            return self.knobs.get((scope.pool, knob.name))

        def suppressed(pool: str) -> bool:
            return bool(self.recovering_until[int(pool[1:])] > t)

        decisions, _ = self.engine.evaluate(t, self.scopes, self.series, read, suppressed)
        for d in decisions:
            self.counts[f"policy:{d.rule}:{d.outcome}"] += 1
            if d.changes and d.new is not None and (d.scope.pool, d.knob) in self.knobs:
                self.knobs[(d.scope.pool, d.knob)] = d.new
                if d.knob.startswith("memory_"):
                    self.plan_count[:] = -1  # every card's quota inputs changed: plan them all again

    def meltdowns(self) -> int | None:
        return int(self.pool_meltdowns.sum())
