"""The two regimes the simulator compares on the same fault trace.

- :class:`Baseline` — common practice: Kubernetes + DDP/torchrun semantics. First-fit placement (bin-packing, as
  gang schedulers do for GPU jobs), no memory limits per worker (an OOM on a card kills every worker on it), any
  failure restarts the whole group from its last full checkpoint, stragglers are waited for up to a timeout.
- :class:`DsecRegime` — the same cluster run by DSec's *own* decision code, called in virtual time: the breaker
  (``dsec.breaker``) per worker, its ladder's directive fields, elastic quotas (``dsec.quota.plan``) per card, fleet
  comparison (``dsec.health.fleet.compare``) per group, degraded-device detection
  (``dsec.scheduler.DeviceHealthTracker``), placement with learned device personalities (``dsec.scheduler.place`` +
  ``Profiles``) and the policy engine (``dsec.policy.Engine``) over the pool gauges. The simulator only carries
  the decisions out (a directive is in force from the next sample on, its ack arrives with the sample after).

Neither regime reads the hidden truth (``Simulation.truth``); both see the same telemetry.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml

from dsec.breaker import Action, Breaker, BreakerConfig, Caps, Phase, Sample, fields_for
from dsec.health.fleet import DEFAULT_FEATURES, FleetConfig, PeerSample, compare
from dsec.model import Device, DeviceHealth, Pool, PoolThresholds
from dsec.policy import Engine, PolicySet, Scope, SeriesStore, compile_policies, load_policies
from dsec.policy.rules import Knob
from dsec.quota.elastic import QuotaConfig, WorkerMemory, plan
from dsec.scheduler import (
    DeviceHealthConfig,
    DeviceHealthTracker,
    DeviceSignals,
    GroupSpec,
    Inventory,
    JobSpec,
    NodeInfo,
    Occupancy,
    Profiles,
    RunRecord,
    WorkerSpec,
    classify_load,
    place,
)
from dsec.scheduler.device_health import SLOW_FEATURES
from dsec.sim.scenario import Scenario

if TYPE_CHECKING:
    from dsec.sim.engine import Simulation

#: How many other nodes (with the most free slots) a re-placement considers besides the group's own nodes:
#: kube-scheduler likewise scores a sample of feasible nodes in large clusters. Keeps a placement O(group x nodes).
CANDIDATE_NODES = 4
#: The control plane plans quotas every 2 s (health.md); a sample covers ``sample_interval_s``, so one plan per
#: sample grows a quota by the same GB per second.
CONTROL_QUOTA_INTERVAL_S = 2.0


class Regime:
    name = "regime"

    def __init__(self, durable_interval_s: float, durable_cost_s: float, restart_s: float) -> None:
        self.durable_interval_s = durable_interval_s
        self.durable_cost_s = durable_cost_s
        self.restart_s = restart_s
        self.pending: list[int] = []
        self.counts: Counter[str] = Counter()

    def attach(self, sim: Simulation) -> None:
        self.sim = sim

    # -- placement ---------------------------------------------------------------------------------------------------
    def choose(self, g: int, workers: list[int], t: float) -> dict[int, int] | None:
        raise NotImplementedError

    def first_fit(self, workers: list[int]) -> dict[int, int] | None:
        """The lowest free slots, in order (bin-packing); None when there are too few."""
        free = self.sim.free_slots()
        if len(free) < len(workers):
            return None
        return {w: int(s) for w, s in zip(workers, free[: len(workers)], strict=True)}

    def place_all(self, t: float) -> None:
        for g in range(self.sim.G):
            self._place_or_park(g, list(self.sim.workers_of(g)), t, delay_s=0.0)

    def _place_or_park(self, g: int, workers: list[int], t: float, delay_s: float) -> bool:
        """Place ``workers`` of group ``g`` (the rest keep their slots) and start it; failing that, the whole group
        anew; failing that, it waits holding nothing (gang scheduling: all or nothing, as Volcano / Kueue do)."""
        sim = self.sim
        sim.release(workers)
        chosen = self.choose(g, workers, t) if workers else {}
        if chosen is None and len(workers) < sim.n:
            workers = list(sim.workers_of(g))
            sim.release(workers)
            chosen = self.choose(g, workers, t)
        if chosen is None:
            sim.release(sim.workers_of(g))
            sim.park(g, t)
            if g not in self.pending:
                self.pending.append(g)
            return False
        for w, slot in chosen.items():
            sim.assign(w, slot)
        sim.start(g, t, delay_s)
        return True

    def capacity_back(self, t: float) -> None:
        """Slots may have become free: place waiting groups, oldest first."""
        sim = self.sim
        waiting, self.pending = self.pending, []
        for g in waiting:
            unplaced = [w for w in sim.workers_of(g) if sim.slot_of[w] < 0]
            if len(sim.free_slots()) < len(unplaced):
                self.pending.append(g)
                continue
            self._place_or_park(g, unplaced, t, self.restart_s)

    # -- faults ------------------------------------------------------------------------------------------------------
    def restart(self, g: int, t: float, cause: str, victims: list[int]) -> float:
        """Group ``g`` failed (its ``victims`` ended); restart it. Returns the recovery time."""
        sim = self.sim
        self.counts[f"restart:{cause}"] += 1
        off = np.repeat(sim.card_off, sim.layout.workers_per_gpu)
        stuck = [w for w in sim.workers_of(g) if sim.slot_of[w] < 0 or off[sim.slot_of[w]]]
        todo = sorted(set(self.to_move(g, victims, cause)) | set(stuck))
        self._place_or_park(g, todo, t, self.restart_s)
        return self.restart_s

    def to_move(self, g: int, victims: list[int], cause: str) -> list[int]:
        """Workers of a failed group to place anew (the others restart where they are)."""
        return []

    def power_off(self, t: float, cards: list[int]) -> None:
        sim = self.sim
        sim.card_off[cards] = True
        card = sim.card_of_worker()
        hit = np.flatnonzero((card >= 0) & sim.card_off[np.maximum(card, 0)])
        for g in sorted({int(sim.group_of[w]) for w in hit}):
            victims = [int(w) for w in hit if sim.group_of[w] == g]
            self.power_loss(g, t, victims)

    def power_loss(self, g: int, t: float, victims: list[int]) -> None:
        self.sim.fail(g, t, "power", victims)

    def observe(self, t: float, k: int, mem: np.ndarray, compute_s: np.ndarray, latency_ms: np.ndarray) -> None:
        raise NotImplementedError

    def running_workers(self) -> np.ndarray:
        from dsec.sim.engine import RUN

        return np.flatnonzero(self.sim.status[self.sim.group_of] == RUN)

    def fail_workers(self, t: float, cause: str, victims: list[int]) -> None:
        by_group: dict[int, list[int]] = {}
        for w in victims:
            by_group.setdefault(int(self.sim.group_of[w]), []).append(int(w))
        for g, ws in sorted(by_group.items()):
            self.sim.fail(g, t, cause, ws)

    def meltdowns(self) -> int | None:
        return None

    def decisions(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


class Baseline(Regime):
    name = "baseline"

    def __init__(self, scenario: Scenario) -> None:
        b = scenario.baseline
        super().__init__(b.checkpoint_interval_s, b.checkpoint_blocking_s, b.restart_s)

    def choose(self, g: int, workers: list[int], t: float) -> dict[int, int] | None:
        return self.first_fit(workers)

    def observe(self, t: float, k: int, mem: np.ndarray, compute_s: np.ndarray, latency_ms: np.ndarray) -> None:
        sim = self.sim
        run = self.running_workers()
        if not len(run):
            return
        card = sim.slot_of[run] // sim.layout.workers_per_gpu
        used = np.bincount(card, weights=mem[run], minlength=sim.layout.cards)
        full = np.flatnonzero(used > sim.sc.cluster.gpu_memory_gb)
        if len(full):
            # The card ran out of memory: the kernel / container runtime kills every process on it.
            victims = [int(w) for w in run[np.isin(card, full)]]
            self.counts["oom_cards"] += len(full)
            self.fail_workers(t, "oom", victims)


class _CardProfiles(Profiles):
    """Profiles keyed by card while placement sees slots: a slot's risk is its card's (the sim's adapter)."""

    def __init__(self, card_of_slot: dict[str, str]) -> None:
        super().__init__()
        self.card_of_slot = card_of_slot

    def device_risk(self, device: str, load_class: str) -> float:
        return super().device_risk(self.card_of_slot.get(device, device), load_class)


class DsecRegime(Regime):
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
        self.quota_config = QuotaConfig(step_gb=1.0 * sc.sample_interval_s / CONTROL_QUOTA_INTERVAL_S)
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

    def _slot_device(self, s: int) -> Device:
        lay, sc = self.sim.layout, self.sc
        card = lay.card_of(s)
        peers = tuple(
            lay.slot_name(p * lay.workers_per_gpu + j)
            for p in [card, *lay.nvlinked_cards(card)]
            for j in range(lay.workers_per_gpu)
            if p * lay.workers_per_gpu + j != s
        )
        return Device(
            id=lay.slot_name(s),
            node=f"n{lay.node_of_card(card)}",
            model=sc.cluster.gpu_model,
            memory_gb=sc.cluster.gpu_memory_gb / lay.workers_per_gpu,
            numa_node=lay.numa_of_card(card),
            nvlink_peers=peers,
        )

    # -- placement: dsec.scheduler.place on a pre-filtered inventory ---------------------------------------------------
    def choose(self, g: int, workers: list[int], t: float) -> dict[int, int] | None:
        sim, lay = self.sim, self.sim.layout
        if not self.sc.dsec.placement:
            return self.first_fit(workers)
        free = sim.free_slots()
        if len(free) < len(workers):
            return None
        cards = free // lay.workers_per_gpu
        placeable = free[~self.degraded[cards]]
        if len(placeable) < len(workers):
            return None
        node_of = placeable // lay.workers_per_gpu // lay.gpus_per_node
        own = {lay.node_of_card(lay.card_of(int(sim.slot_of[w]))) for w in sim.workers_of(g) if sim.slot_of[w] >= 0}
        per_node = np.bincount(node_of, minlength=lay.nodes)
        ranked = [int(nd) for nd in np.argsort(-per_node, kind="stable") if per_node[nd] > 0 and int(nd) not in own]
        nodes = own | set(ranked[:CANDIDATE_NODES])
        cand = placeable[np.isin(node_of, list(nodes))]
        if len(cand) < len(workers):
            cand, nodes = placeable, set(node_of.tolist())
        devices = {}
        signals = {}
        for s in cand.tolist():
            dev = self.slot_devices[s]
            health = self.health_by_name[self.card_names[lay.card_of(s)]]
            devices[dev.id] = dev if health is DeviceHealth.HEALTHY else replace(dev, health=health)
            if sim.throttled[lay.card_of(s)] > 0:
                signals[dev.id] = DeviceSignals(throttle_reasons=1)  # NVML: clocks lowered for thermal reasons
        inventory = Inventory({f"n{nd}": self.nodes[f"n{nd}"] for nd in sorted(nodes)}, devices, signals)
        n = sim.n
        job = JobSpec(
            f"g{g}",
            (
                GroupSpec(
                    f"g{g}",
                    tuple(
                        WorkerSpec(
                            str(w),
                            "learner" if sim.is_learner[w] else "actor",
                            self.sc.groups.memory.base_gb,
                            key=f"g{g}/{w % n}",
                        )
                        for w in workers
                    ),
                    self.load_class,
                ),
            ),
        )
        self.counts["placements"] += 1
        result = place(job, inventory, self.profiles)
        if not result.complete:
            return None
        return {int(a.worker): self.slot_name_to_index[a.device] for a in result.assignments}

    def to_move(self, g: int, victims: list[int], cause: str) -> list[int]:
        # The failed workers are placed anew with what was learned (their card's record just went in); placement
        # may well keep them where they were.
        return victims

    def restart(self, g: int, t: float, cause: str, victims: list[int]) -> float:
        self._record_runs(victims, t, failed=cause in ("crash", "oom"), oom=cause == "oom")
        sim = self.sim
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

    def _record_runs(self, victims: list[int], t: float, failed: bool, oom: bool) -> None:
        sim, lay = self.sim, self.sim.layout
        for w in victims:
            s = int(sim.slot_of[w])
            if s < 0:
                continue
            card = lay.card_of(s)
            hours = max(1e-6, (t - sim.run_start[w]) / 3600.0)
            # Growth as the probe reports it: memory now above what the worker started with, per hour, bursts
            # excluded (the probe's growth estimate is a slope over minutes, which a burst does not dominate).
            leak = self._observed_growth(w, t, hours)
            self.profiles.observe(
                RunRecord(
                    device=lay.card_name(card),
                    model=self.sc.cluster.gpu_model,
                    load_class=self.load_class,
                    worker_key=f"g{int(sim.group_of[w])}/{w % sim.n}",
                    oom=oom,
                    failed=failed,
                    throttled=bool(sim.saw_throttle[w]),
                    leak_gb_per_h=leak,
                    hours=hours,
                )
            )
            self.counts["run_records"] += 1

    def _observed_growth(self, w: int, t: float, hours: float) -> float:
        steady = float(self.sim.memory(t, [w], bursts=False)[0])
        return max(0.0, (steady - self.sc.groups.memory.base_gb) / hours)

    # -- per sample --------------------------------------------------------------------------------------------------
    def observe(self, t: float, k: int, mem: np.ndarray, compute_s: np.ndarray, latency_ms: np.ndarray) -> None:
        run = self.running_workers()
        if len(run):
            self._ooms(t, run, mem)
            run = self.running_workers()
        if len(run):
            if self.sc.dsec.quotas:
                self._quotas(run, mem)
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
        cap = self.quota[run] if self.sc.dsec.quotas else np.full(len(run), math.inf)
        over = run[mem[run] > cap + 1e-9]
        victims = set(int(w) for w in over)
        rest = np.array([w for w in run if int(w) not in victims], dtype=np.int64)
        if len(rest):
            card = sim.slot_of[rest] // sim.layout.workers_per_gpu
            used = np.bincount(card, weights=mem[rest], minlength=sim.layout.cards)
            for c in np.flatnonzero(used > self.sc.cluster.gpu_memory_gb):
                # Quotas over-committed (bases alone exceed the card): the largest user fails first.
                on = sorted(rest[card == c], key=lambda w: -mem[w])
                total = used[c]
                for w in on:
                    if total <= self.sc.cluster.gpu_memory_gb:
                        break
                    victims.add(int(w))
                    total -= mem[w]
        if victims:
            self.counts["oom_workers"] += len(victims)
            self.fail_workers(t, "oom", sorted(victims))

    def _quotas(self, run: np.ndarray, mem: np.ndarray) -> None:
        """dsec.quota.plan per card (the capacity the card's workers share), for the cards whose inputs changed since
        their last plan: plan() is pure, so unchanged inputs would give an unchanged plan."""
        sim = self.sim
        wpg, cards = sim.layout.workers_per_gpu, sim.layout.cards
        card = sim.slot_of[run] // wpg
        counts = np.bincount(card, minlength=cards)
        changed = (
            (mem[run] != self.plan_mem[run])
            | (self.quota[run] != self.plan_quota[run])
            | (sim.slot_of[run] != self.plan_slot[run])
        )
        dirty = counts != self.plan_count
        dirty[card[changed]] = True
        if self.reference:
            dirty[:] = True
        sel = dirty[card]
        inputs = self.quota[run].copy()  # what this plan reads: the next one re-plans if the quota moved since
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
            members = [WorkerMemory(str(int(w)), float(mem[w]), float(self.quota[w])) for w in ws]
            result = plan(cap, base, ceiling, members, self.quota_config)
            for wid, q in result.changes.items():
                self.quota[int(wid)] = q
            self.counts["quota_changes"] += len(result.changes)
        self.plan_mem[run] = mem[run]
        self.plan_quota[run] = inputs
        self.plan_slot[run] = sim.slot_of[run]
        self.plan_count = counts

    def _caps(self, g: int) -> Caps:
        pool = self.pool_names[g]
        lat = self.knobs[(pool, "latency_cap_ms")]
        bw = self.knobs[(pool, "bandwidth_cap_mbps")]
        ceiling = self.knobs[(pool, "memory_ceiling_gb")]
        return Caps(
            bandwidth_mbps=float(bw if bw is not None else PoolThresholds().bandwidth_cap_mbps),
            latency_ms=float(lat if lat is not None else PoolThresholds().latency_cap_ms),
            memory_gb=None if ceiling is None else float(ceiling) * self.sc.dsec.memory_pressure_fraction,
        )

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
        caps_of = {int(g): self._caps(int(g)) for g in np.unique(groups)}
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
            tr = b.decide(t, caps, int(self.version[w]))
            self.closed[w] = b.phase is Phase.CLOSED
            if tr is None:
                continue
            self.counts[f"breaker:{tr.action.value if tr.action is not Action.NONE else tr.trigger.value}"] += 1
            if tr.meltdown:
                self.pool_meltdowns[g] += 1
            if tr.action is not Action.NONE:
                self.version[w] += 1
                b.issued(int(self.version[w]), t)  # the ack comes with the next sample
                self.closed[w] = False
                fields = fields_for(b.level, b.causes, caps.memory_gb)
                bits = int(fields["compression_bits"])
                sim.bits_frac[w] = 1.0 if bits >= 32 else bits / 32.0
                sim.accum[w] = float(fields["grad_accum_steps"])
                sim.paused[w] = not fields["async_sampling"]

    def _device_health(self, t: float, run: np.ndarray, compute_s: np.ndarray, latency_ms: np.ndarray) -> None:
        sim, lay = self.sim, self.sim.layout
        flagged: set[int] = set()
        groups = np.unique(sim.group_of[run])
        if len(groups):
            n = sim.n
            step_ms = ((compute_s + latency_ms / 1000.0 / sim.accum) * 1000.0).reshape(sim.G, n)
            lat = latency_ms.reshape(sim.G, n)
            candidates = groups if self.reference else groups[self._may_have_outliers(groups, step_ms, lat)]
            for g in candidates.tolist():
                ws = range(g * n, (g + 1) * n)
                samples = [
                    PeerSample(
                        str(w),
                        "learner" if sim.is_learner[w] else "actor",
                        self.pool_names[g],
                        {"step_ms_mean": float(step_ms[g, i]), "sync_latency_ms_p50": float(lat[g, i])},
                    )
                    for i, w in enumerate(ws)
                ]
                report = compare(samples, self.fleet_config)
                for wid, outs in report.outliers_by_worker().items():
                    if any(o.feature in SLOW_FEATURES for o in outs):
                        flagged.add(int(wid))
        card_w = sim.slot_of[run] // lay.workers_per_gpu
        on_card = np.bincount(card_w, minlength=lay.cards)
        is_flagged = np.zeros(sim.N)
        is_flagged[list(flagged)] = 1.0
        # Judged: workers of a role with enough peers to compare (the fleet comparison's min_peers).
        learners, actors = self.sc.groups.learners, self.sc.groups.actors
        min_peers = self.fleet_config.min_peers
        judgeable = np.where(sim.is_learner, learners >= min_peers, actors >= min_peers).astype(float)
        judged_on_card = np.bincount(card_w, weights=judgeable[run], minlength=lay.cards)
        slow_on_card = np.bincount(card_w, weights=is_flagged[run] * judgeable[run], minlength=lay.cards)
        occupancy = {
            self.card_names[c]: Occupancy(int(on_card[c]), int(judged_on_card[c]), int(slow_on_card[c]))
            for c in np.flatnonzero(on_card).tolist()
        }
        for change in self.tracker.step(t, self.health_by_name, occupancy):
            c = self._card_index(change.device)
            self.set_card_health(c, change.after)
            self.counts[f"device:{change.after.value}"] += 1
            if change.degraded:
                self._migrate_off(c, t)

    def set_card_health(self, card: int, health: DeviceHealth) -> None:
        self.health_by_name[self.card_names[card]] = health
        self.degraded[card] = health is DeviceHealth.DEGRADED

    def _may_have_outliers(self, groups: np.ndarray, step_ms: np.ndarray, lat: np.ndarray) -> np.ndarray:
        """Which groups ``compare`` could flag anyone in (an exact pre-filter, vectorized over groups): an outlier's
        excess over its role's median must exceed the feature's floors, so a group whose largest excess does not
        cannot have one. Comparing only the others gives the same flags for a fraction of the cost."""
        learners = self.sc.groups.learners
        out = np.zeros(len(groups), dtype=bool)
        specs = {f.name: f for f in self.fleet_config.features}
        for lo, hi in ((0, learners), (learners, self.sim.n)):
            if hi - lo < self.fleet_config.min_peers:
                continue
            for name, values in (("step_ms_mean", step_ms), ("sync_latency_ms_p50", lat)):
                spec = specs.get(name)
                if spec is None:
                    continue
                sub = values[groups, lo:hi]
                med = np.median(sub, axis=1)
                floor = np.maximum(spec.min_abs_excess, spec.min_rel_excess * np.abs(med))
                out |= sub.max(axis=1) - med > floor - 1e-9
        return out

    def _card_index(self, name: str) -> int:
        node, rest = name[1:].split("-g")
        return int(node) * self.sim.layout.gpus_per_node + int(rest)

    def _migrate_off(self, card: int, t: float) -> None:
        """The card degraded: its workers were asked for a snapshot; their groups move from it."""
        sim, lay = self.sim, self.sim.layout
        ws = [int(w) for w in sim.occupant[card * lay.workers_per_gpu : (card + 1) * lay.workers_per_gpu] if w >= 0]
        groups = sorted({int(sim.group_of[w]) for w in ws})
        for g in groups:
            self.recovering_until[g] = t + self.health_config.recovery_hold_s
            victims = [w for w in ws if sim.group_of[w] == g]
            self.counts["migrations"] += 1
            self._record_runs(victims, t, failed=False, oom=False)
            sim.fail(g, t, "migration", victims, durable_first=True)

    # -- policies: dsec.policy.Engine over the pool gauges -------------------------------------------------------------
    def _policies(self, t: float, mem: np.ndarray) -> None:
        from dsec.sim.engine import RUN

        sim = self.sim
        assert self.engine is not None
        samples: dict[tuple[str, str, str | None], float] = {}
        running = sim.status[sim.group_of] == RUN
        for g, pool in enumerate(self.pool_names):
            ws = sim.workers_of(g)
            active = running[ws]
            q = self.quota[ws]
            used = mem[ws]
            util = float(np.mean(used[active] / q[active])) if active.any() else 0.0
            ops = float(sim.sync_ops[g])
            samples[("dsec_sandbox_utilization_rate", pool, None)] = util
            samples[("dsec_gradient_sync_success_rate", pool, None)] = float(sim.sync_ok[g]) / ops if ops else math.nan
            samples[("dsec_snapshot_recovery_time", pool, None)] = float(self.last_recovery[g])
            samples[("dsec_melt_down_count", pool, None)] = float(self.pool_meltdowns[g])
            samples[("dsec_workers_active", pool, None)] = float(active.sum())
            samples[("dsec_workers_lost", pool, None)] = 0.0
            samples[("dsec_directives_pending", pool, None)] = 0.0
            samples[("dsec_pool_memory_used_gb", pool, None)] = float(used[active].sum())
            samples[("dsec_pool_memory_granted_gb", pool, None)] = float(q[active].sum())
        self.series.add(t, {k: v for k, v in samples.items() if not math.isnan(v)})

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


def policies_from(paths: list[Path]) -> PolicySet:
    """One policy set from several files; each file is validated on its own first (errors name file and line)."""
    rules: list[object] = []
    for f in paths:
        load_policies(f)
        rules += (yaml.safe_load(f.read_text()) or {}).get("policies", [])
    return compile_policies(yaml.safe_dump({"policies": rules}, sort_keys=False), ", ".join(str(p) for p in paths))


def example_policy_files() -> list[Path]:
    """The example policy files shipped with DSec (src/dsec/data/policies)."""
    return sorted(Path(str(resources.files("dsec") / "data" / "policies")).glob("*.yaml"))
