"""DSec as the simulator runs it: the same cluster run by DSec's *own* decision code, called in virtual time.

Per sample: elastic quotas (``dsec.quota.plan``) per card, each worker's breaker (``dsec.decide.breaker_step`` with
``dsec.decide.caps_for``), degraded-device detection (:mod:`dsec.sim.dsec_devices`), placement with learned device
personalities (:mod:`dsec.sim.dsec_placement`) and, on its interval, the policy engine (``dsec.policy.Engine``) over
the pool gauges (``dsec.decide.policy_samples``). The simulator only carries the decisions out: a directive is in
force from the next sample on, its ack arrives with the sample after. It never reads the hidden truth.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from dsec.breaker import Action, Breaker, BreakerConfig, Caps, Phase, Sample
from dsec.decide import PoolGauges, breaker_step, caps_for, policy_samples, safe_latency_floor
from dsec.decide.gauges import sync_success, utilization
from dsec.health.fleet import DEFAULT_FEATURES, FleetConfig
from dsec.model import DeviceHealth, Pool, PoolThresholds, WorkerState
from dsec.policy import Engine, PolicySet, Scope, SeriesStore
from dsec.policy.rules import Knob
from dsec.quota.elastic import QuotaConfig, WorkerMemory, plan
from dsec.quota.trend import bursting, observe_arrays
from dsec.scheduler import DeviceHealthConfig, DeviceHealthTracker, NodeInfo, classify_load
from dsec.sim.dsec_devices import DeviceHealthPass
from dsec.sim.dsec_placement import PlacementPass, _CardProfiles
from dsec.sim.regimes import largest_first
from dsec.sim.scenario import Scenario
from dsec.sim.world import RUN

if TYPE_CHECKING:
    from dsec.sim.engine import Simulation

#: The control plane plans quotas every 2 s (health.md); a sample covers ``sample_interval_s``, so one plan per
#: sample grows a quota by the same GB per second.
CONTROL_QUOTA_INTERVAL_S = 2.0


class DsecRegime(PlacementPass, DeviceHealthPass):
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
        self.fleet_config = FleetConfig(
            features=tuple(f for f in DEFAULT_FEATURES if f.name in ("step_ms_mean", "sync_latency_ms_p50"))
        )
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
        self.breakers: dict[int, Breaker] = {}
        self.reference = False
        # The inputs of each card's last quota plan (see _quotas).
        self.plan_mem = np.full(sim.N, -1.0)
        self.plan_quota = np.full(sim.N, -1.0)
        self.plan_slot = np.full(sim.N, -1, dtype=np.int64)
        self.plan_count = np.zeros(lay.cards, dtype=np.int64)
        self.closed = np.ones(sim.N, dtype=bool)  # no breaker yet, or its phase is CLOSED
        self.ring_len = self.breaker_config.min_samples + 2  # covers the breaker's window (inclusive bounds)
        self.ring_k = np.full(self.ring_len, -1, dtype=np.int64)
        self.ring_run = np.zeros((self.ring_len, sim.N), dtype=bool)
        self.ring_bw = np.zeros((self.ring_len, sim.N))
        self.ring_lat = np.zeros((self.ring_len, sim.N))
        self.ring_mem = np.zeros((self.ring_len, sim.N))
        self.fed_k = np.full(sim.N, -1, dtype=np.int64)
        self.valid_from = np.zeros(sim.N, dtype=np.int64)
        self.version = np.zeros(sim.N, dtype=np.int64)
        self.quota = np.full(sim.N, sc.quota_base_gb())
        # The allocator limit each worker's probe enforces (NaN: none issued yet — the probe caps at the quota).
        self.limit = np.full(sim.N, math.nan)
        self.plan_limit = np.full(sim.N, -1.0)
        # Each worker's memory trend (dsec.quota.trend, the server's formula over arrays): t, used, ramp, peak.
        self.trend = [np.full(sim.N, -math.inf), np.zeros(sim.N), np.zeros(sim.N), np.zeros(sim.N),
                      np.full(sim.N, -math.inf), np.full(sim.N, -math.inf)]  # fmt: skip
        self.plan_bursting = np.zeros(sim.N, dtype=bool)
        self.plan_ramp = np.full(sim.N, -1.0)
        self.plan_peak = np.full(sim.N, -1.0)
        self.pool_meltdowns = np.zeros(sim.G, dtype=np.int64)
        self.last_recovery = np.full(sim.G, math.nan)
        self.recovering_until = np.full(sim.G, -math.inf)
        self.degraded = np.zeros(lay.cards, dtype=bool)  # placement excludes these (dsec.scheduler.place does too)
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

    def restart(self, g: int, t: float, cause: str, victims: list[int]) -> float:
        self._record_runs(victims, t, failed=cause in ("crash", "oom"), oom=cause == "oom")
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
        self.quota[w] = self.knobs[(self.pool_names[int(sim.group_of[w])], "memory_base_gb")] or 0.0
        self.limit[w] = math.nan
        for arr, v in zip(self.trend, (-math.inf, 0.0, 0.0, 0.0, -math.inf, -math.inf), strict=True):
            arr[w] = v  # a new process: the old one's trend is gone with it

    # -- per sample --------------------------------------------------------------------------------------------------
    def observe(self, t: float, k: int, mem: np.ndarray, compute_s: np.ndarray, latency_ms: np.ndarray) -> None:
        run = self.running_workers()
        if len(run):
            self._ooms(t, run, mem)
            run = self.running_workers()
        if len(run):
            if self.sc.dsec.quotas:
                self._observe_trends(t, run, mem)
                self._quotas(t, run, mem)
            if self.sc.dsec.breaker:
                self._breakers(k, t, run, mem, latency_ms)
        if self.sc.dsec.device_health:
            self._device_health(t, run, compute_s, latency_ms)
        if self.engine is not None and k % self.policy_every == 0:
            self._policies(t, mem)

    def _ooms(self, t: float, run: np.ndarray, mem: np.ndarray) -> None:
        sim = self.sim
        # The quota is the worker's allocator cap (torch.cuda.set_per_process_memory_fraction): a worker above it
        # fails its own allocation; its neighbours on the card keep running.
        if not self.sc.dsec.quotas:
            cap = np.full(len(run), math.inf)
        elif self.sc.dsec.quota_limits:
            cap = np.where(np.isnan(self.limit[run]), self.quota[run], self.limit[run])
        else:  # the first design: the allocator capped at the grant
            cap = self.quota[run]
        over = run[mem[run] > cap + 1e-9]
        victims = set(int(w) for w in over)
        rest = np.array([w for w in run if int(w) not in victims], dtype=np.int64)
        # Quotas over-committed (bases alone exceed the card): the largest user fails first.
        victims |= largest_first(rest, mem, sim.slot_of, sim.layout.workers_per_gpu, self.sc.cluster.gpu_memory_gb)
        if victims:
            self.counts["oom_workers"] += len(victims)
            self.fail_workers(t, "oom", sorted(victims))

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
        limits_on = self.sc.dsec.quota_limits
        ramp, peak = self.trend[2], self.trend[3]
        ws_all, card_d = run[sel], card[sel]
        order = np.argsort(card_d, kind="stable")
        ws_all, card_d = ws_all[order], card_d[order]
        cap = self.sc.cluster.gpu_memory_gb
        for ws in np.split(ws_all, np.flatnonzero(np.diff(card_d)) + 1) if len(ws_all) else []:
            # Pools share a card; the memory knobs of the first worker's pool apply (they differ only if a policy
            # changed one pool's base or ceiling, which the example policies do not).
            pool = self.pool_names[int(sim.group_of[ws[0]])]
            base = float(self.knobs[(pool, "memory_base_gb")] or 0.0)
            ceiling = float(self.knobs[(pool, "memory_ceiling_gb")] or base)
            members = [
                WorkerMemory(
                    str(int(w)), float(mem[w]), float(self.quota[w]),
                    ramp_gb_per_s=float(ramp[w]) if limits_on else 0.0,
                    recent_peak_gb=float(peak[w]) if limits_on else None,
                    limit_gb=None if math.isnan(self.limit[w]) else float(self.limit[w]),
                    bursting=bool(burst_now[w]),
                )
                for w in ws
            ]  # fmt: skip
            result = plan(cap, base, ceiling, members, self.quota_config, device_gb=cap)
            for wid, q in result.changes.items():
                self.quota[int(wid)] = q
            for wid, lim in result.limit_changes.items():
                self.limit[int(wid)] = math.nan if lim is None else lim
            self.counts["quota_changes"] += len(result.changes)
            self.counts["limit_changes"] += len(result.limit_changes)
        self.plan_mem[run] = mem[run]
        self.plan_quota[run] = inputs
        self.plan_limit[run] = limits_in
        self.plan_bursting[run] = burst_now[run]
        self.plan_ramp[run] = ramp[run]
        self.plan_peak[run] = peak[run]
        self.plan_slot[run] = sim.slot_of[run]
        self.plan_count = counts

    def _latency_floors(self, groups: np.ndarray, latency_ms: np.ndarray) -> dict[int, float | None]:
        """Cap safety per running group (``dsec.decide.safe_latency_floor``), its workers' latencies this sample."""
        lat = latency_ms.reshape(self.sim.G, self.sim.n)
        return {
            int(g): safe_latency_floor(
                lat[g].tolist(), self._caps(int(g)).latency_ms, self.fleet_config.min_peers, self.breaker_config.margin
            )
            for g in groups
        }

    def _caps(self, g: int, latency_floor_ms: float | None = None) -> Caps:
        """The group's caps as the control plane computes them (``dsec.decide.caps_for``) from its pool's knobs,
        which policies may change; workers carry no per-worker cap overrides here."""
        pool = self.pool_names[g]
        lat = self.knobs[(pool, "latency_cap_ms")]
        bw = self.knobs[(pool, "bandwidth_cap_mbps")]
        ceiling = self.knobs[(pool, "memory_ceiling_gb")]
        default = PoolThresholds()
        thresholds = PoolThresholds(
            bandwidth_cap_mbps=float(bw) if bw is not None else default.bandwidth_cap_mbps,
            latency_cap_ms=float(lat) if lat is not None else default.latency_cap_ms,
        )
        ceiling_gb = None if ceiling is None else float(ceiling)
        return caps_for(thresholds, ceiling_gb, None, self.sc.dsec.memory_pressure_fraction, latency_floor_ms)

    def _breakers(self, k: int, t: float, run: np.ndarray, mem: np.ndarray, latency_ms: np.ndarray) -> None:
        """One sample per running worker into its breaker (dsec.breaker), and the ladder's fields for each decision.

        Lazy feeding (exactly equivalent, and what makes 10,000 workers affordable): a CLOSED breaker given a calm
        sample changes nothing a later decision reads except its window of samples — ``decide`` finds no
        transition for (CLOSED, CALM) and the next non-calm sample resets the calm clock. So calm samples of closed
        breakers are only kept in a ring buffer, and replayed in order into the breaker before the first sample that
        needs a decision. ``reference`` turns this off (the test compares both)."""
        sim = self.sim
        groups = sim.group_of[run]
        grad = self.sc.groups.gradient_mb
        bw = grad * sim.bits_frac[run] / (sim.last_step_s[groups] * sim.accum[run])
        lat = latency_ms[run]
        m = mem[run]
        slot = k % self.ring_len
        self.ring_k[slot] = k
        self.ring_run[slot] = False
        self.ring_run[slot, run] = True
        self.ring_bw[slot, run], self.ring_lat[slot, run], self.ring_mem[slot, run] = bw, lat, m
        floors = self._latency_floors(np.unique(groups), latency_ms)
        caps_of = {g: self._caps(g, floor) for g, floor in floors.items()}
        if self.reference:
            need = np.ones(len(run), dtype=bool)
        else:
            keep = 1.0 - self.breaker_config.margin
            cap_bw = np.array([caps_of[int(g)].bandwidth_mbps for g in groups])
            cap_lat = np.array([caps_of[int(g)].latency_ms for g in groups])
            cap_mem = np.array([caps_of[int(g)].memory_gb or math.inf for g in groups])
            calm = (bw < cap_bw * keep) & (lat < cap_lat * keep) & (m < cap_mem * keep)
            need = ~(calm & self.closed[run])
        dt = self.sc.sample_interval_s
        for i in np.flatnonzero(need).tolist():
            w = int(run[i])
            g = int(groups[i])
            caps = caps_of[g]
            b = self.breakers.get(w)
            if b is None:
                b = self.breakers[w] = Breaker(config=self.breaker_config)
            for j in range(max(k - self.ring_len + 1, int(self.fed_k[w]) + 1, int(self.valid_from[w])), k):
                r = j % self.ring_len
                if self.ring_k[r] == j and self.ring_run[r, w]:
                    b.observe(
                        Sample(
                            j * dt, float(self.ring_bw[r, w]), float(self.ring_lat[r, w]), float(self.ring_mem[r, w])
                        ),
                        caps,
                    )
            b.observe(Sample(t, float(bw[i]), float(lat[i]), float(m[i])), caps)
            self.fed_k[w] = k
            move = breaker_step(b, caps, int(self.version[w]), t)
            self.closed[w] = b.phase is Phase.CLOSED
            if move is None:
                continue
            tr = move.transition
            self.counts[f"breaker:{tr.action.value if tr.action is not Action.NONE else tr.trigger.value}"] += 1
            if tr.meltdown:
                self.pool_meltdowns[g] += 1
            if move.patch is not None:
                self.version[w] += 1
                b.issued(int(self.version[w]), t)  # the ack comes with the next sample
                self.closed[w] = False
                self._apply_fields(w, move.patch)

    def _apply_fields(self, w: int, fields: dict[str, Any]) -> None:
        """A directive's effect on the simulated worker: bytes per sync, steps per sync, sampling."""
        sim = self.sim
        bits = fields.get("compression_bits")  # None: the probe's default, uncompressed here
        sim.bits_frac[w] = 1.0 if bits is None or bits >= 32 else bits / 32.0
        sim.accum[w] = float(fields["grad_accum_steps"])
        sim.paused[w] = not fields["async_sampling"]

    # -- policies: dsec.policy.Engine over the pool gauges -------------------------------------------------------------
    def _policies(self, t: float, mem: np.ndarray) -> None:
        sim = self.sim
        assert self.engine is not None
        running = sim.status[sim.group_of] == RUN
        gauges: dict[str, PoolGauges] = {}
        for g, pool in enumerate(self.pool_names):
            ws = sim.workers_of(g)
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
