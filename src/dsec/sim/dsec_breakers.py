"""DSec's per-worker breakers in the simulator.

One sample per running worker into its breaker (``dsec.breaker``) with the caps the control plane would compute
(``dsec.decide.caps_for``, ``dsec.decide.caps.safe_latency_floors``); a decision's directive
(``dsec.decide.breaker_step``) changes what the simulated worker sends from the next sample on."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from dsec.breaker import MAX_LEVEL, Action, Breaker, BreakerConfig, Caps, Phase, Sample
from dsec.decide import breaker_step, caps_for
from dsec.decide.beat import top_level
from dsec.decide.caps import safe_latency_floors
from dsec.health.fleet import FleetConfig
from dsec.model import PoolThresholds
from dsec.quota.relief import RELIEF_ACCUM_STEPS
from dsec.sim.regimes import Regime
from dsec.sim.scenario import Scenario

if TYPE_CHECKING:
    from dsec.sim.engine import Simulation


class BreakerPass(Regime):
    """Breakers of :class:`~dsec.sim.dsec_regime.DsecRegime` (set up by its ``attach``: :meth:`_attach_breakers`)."""

    sc: Scenario
    reference: bool
    breaker_config: BreakerConfig
    fleet_config: FleetConfig
    knobs: dict[tuple[str, str], float | None]
    pool_names: list[str]
    pool_meltdowns: np.ndarray

    def _attach_breakers(self, sim: Simulation) -> None:
        self.breakers: dict[int, Breaker] = {}
        self._thresholds: dict[tuple[float | None, ...], tuple[PoolThresholds, float | None]] = {}
        self._plain_caps: dict[tuple[float | None, ...], Caps] = {}
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
        self.breaker_accum = np.ones(sim.N)  # what the breaker's last directive asked (memory relief may ask more)
        self.relieved = np.zeros(sim.N, dtype=bool)  # accumulating for memory relief (dsec.quota.relief)

    def _caps_in_force(self, groups: np.ndarray, latency_ms: np.ndarray) -> dict[int, Caps]:
        """Each running group's caps, with cap safety (``dsec.decide.caps.safe_latency_floors``) from its workers'
        latencies this sample."""
        gs = groups.tolist()
        plain = {g: self._caps(g) for g in gs}
        rows = latency_ms.reshape(self.sim.G, self.sim.n)[groups]
        caps = np.array([plain[g].latency_ms for g in gs])
        floors = safe_latency_floors(rows, caps, self.fleet_config.min_peers, self.breaker_config.margin)
        return {g: plain[g] if math.isnan(f) else self._caps(g, f) for g, f in zip(gs, floors.tolist(), strict=True)}

    def _caps(self, g: int, latency_floor_ms: float | None = None) -> Caps:
        """The group's caps as the control plane computes them (``dsec.decide.caps_for``) from its pool's knobs,
        which policies may change; workers carry no per-worker cap overrides here."""
        pool = self.pool_names[g]
        knobs = (
            self.knobs[(pool, "latency_cap_ms")],
            self.knobs[(pool, "bandwidth_cap_mbps")],
            self.knobs[(pool, "memory_ceiling_gb")],
        )
        if latency_floor_ms is None:
            # The plain caps (most groups, every sample) once per distinct knob values: caps_for is pure and Caps
            # frozen, so one value serves every group with those knobs.
            plain = self._plain_caps.get(knobs)
            if plain is None:
                plain = self._plain_caps[knobs] = self._caps_from(knobs, None)
            return plain
        return self._caps_from(knobs, latency_floor_ms)

    def _caps_from(self, knobs: tuple[float | None, ...], latency_floor_ms: float | None) -> Caps:
        made = self._thresholds.get(knobs)
        if made is None:  # built once per distinct knob values (policies change them rarely)
            lat, bw, ceiling = knobs
            default = PoolThresholds()
            thresholds = PoolThresholds(
                bandwidth_cap_mbps=float(bw) if bw is not None else default.bandwidth_cap_mbps,
                latency_cap_ms=float(lat) if lat is not None else default.latency_cap_ms,
            )
            made = self._thresholds[knobs] = (thresholds, None if ceiling is None else float(ceiling))
        thresholds, ceiling_gb = made
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
        caps_of = self._caps_in_force(np.flatnonzero(np.bincount(groups, minlength=sim.G)), latency_ms)  # np.unique
        if self.reference:
            need = np.ones(len(run), dtype=bool)
        else:
            keep = 1.0 - self.breaker_config.margin
            per_group = np.zeros((3, sim.G))  # each group's caps, then each worker's from its group
            for g, c in caps_of.items():
                per_group[:, g] = (c.bandwidth_mbps, c.latency_ms, c.memory_gb or math.inf)
            cap_bw, cap_lat, cap_mem = per_group[:, groups]
            calm = (bw < cap_bw * keep) & (lat < cap_lat * keep) & (m < cap_mem * keep)
            need = ~(calm & self.closed[run])
        for i in np.flatnonzero(need).tolist():
            w = int(run[i])
            g = int(groups[i])
            self._decide(w, g, k, t, caps_of[g], Sample(t, float(bw[i]), float(lat[i]), float(m[i])))

    def _decide(self, w: int, g: int, k: int, t: float, caps: Caps, sample: Sample) -> None:
        """Worker ``w``'s breaker after this sample (the calm ones it skipped replayed first), and its decision."""
        b = self.breakers.get(w)
        if b is None:
            b = self.breakers[w] = Breaker(config=self.breaker_config)
        self._replay_calm(b, w, k, caps)
        b.observe(sample, caps)
        self.fed_k[w] = k
        move = breaker_step(b, caps, int(self.version[w]), t, top_level=self._top_level(w, g, b))
        self.closed[w] = b.phase is Phase.CLOSED
        if move is None:
            return
        tr = move.transition
        self.counts[f"breaker:{tr.action.value if tr.action is not Action.NONE else tr.trigger.value}"] += 1
        if tr.meltdown:
            self.pool_meltdowns[g] += 1
        if move.patch is not None:
            self.version[w] += 1
            b.issued(int(self.version[w]), t)  # the ack comes with the next sample
            self.closed[w] = False
            self._apply_fields(w, move.patch)

    def _top_level(self, w: int, g: int, b: Breaker) -> int:
        """The highest level worker ``w`` may reach (``dsec.decide.beat.top_level``) from what its probe would report:
        the wait it alone caused its group, as the median of the last three samples (``Simulation.lateness_ring``:
        the stand-in for the median ``sync_cost_ms`` over the breaker's evidence window that the control plane
        reads; this simulator's breakers judge raw latency), per step already (so accumulation 1), its group's step
        time and actors. Only read at the rung below the top, where it decides anything."""
        sim = self.sim
        if not self.sc.dsec.pause_when_it_pays or sim.is_learner[w] or b.level < MAX_LEVEL - 1:
            return MAX_LEVEL
        cost = float(np.median(sim.lateness_ring[:, w]))
        return top_level("actor", cost, 1.0, float(sim.last_step_s[g]) * 1000.0, self.sc.groups.actors)

    def _replay_calm(self, b: Breaker, w: int, k: int, caps: Caps) -> None:
        """The calm samples of worker ``w`` kept in the ring since it was last fed, in order, into its breaker."""
        dt = self.sc.sample_interval_s
        for j in range(max(k - self.ring_len + 1, int(self.fed_k[w]) + 1, int(self.valid_from[w])), k):
            r = j % self.ring_len
            if self.ring_k[r] == j and self.ring_run[r, w]:
                b.observe(
                    Sample(j * dt, float(self.ring_bw[r, w]), float(self.ring_lat[r, w]), float(self.ring_mem[r, w])),
                    caps,
                )

    def _apply_fields(self, w: int, fields: dict[str, Any]) -> None:
        """A directive's effect on the simulated worker: bytes per sync, steps per sync, sampling."""
        sim = self.sim
        bits = fields.get("compression_bits")  # None: the probe's default, uncompressed here
        sim.bits_frac[w] = 1.0 if bits is None or bits >= 32 else bits / 32.0
        self.breaker_accum[w] = float(fields["grad_accum_steps"])
        self._set_accum(w)
        # The probe holds env.step only in an actor (Probe.wait_for_sampling): a learner told to pause trains on.
        sim.paused[w] = not fields["async_sampling"] and not bool(sim.is_learner[w])

    def _set_accum(self, w: int) -> None:
        """Worker ``w``'s accumulation: the larger of the breaker's and memory relief's (dsec.quota.relief), while
        relief holds it."""
        self.sim.accum[w] = max(self.breaker_accum[w], RELIEF_ACCUM_STEPS if self.relieved[w] else 1.0)
