"""The discrete-event loop: world state, progress accounting and outcomes, shared by every regime.

Time is virtual: nothing sleeps. Trace events (faults) and the loop's own events (a group back up after a restart,
a checkpoint or snapshot due) are processed in time order; every ``sample_interval_s`` the workers' telemetry is
computed from the world models and handed to the regime, which decides (the DSec regime by calling DSec's own
modules), and the groups' training rates for the next interval follow from the result.

Progress is accounted exactly between events: a running group advances at its current rate (useful optimizer steps
per second, already discounted by statistical efficiency); a failure rolls it back to its last durable point
(checkpoint or snapshot); a checkpoint or snapshot costs its blocking time at the current rate. Where the regime
restarts failed workers *alone* (actors: RLlib's env-runner fault tolerance, DSec's per-worker restarts), nothing
rolls back: the group trains on without them until their replacements are up (:meth:`Simulation.lose_workers`).

The group's step, per sample (the learner synchronizes with every worker of the group):

- a worker arrives at the sync after its compute time (slowed while its card throttles) plus its sync time
  (latency with noise and jitter, plus the transfer of its gradient at its compression; with gradient accumulation
  it synchronizes every 4th step, so it holds the group up a quarter as often — a fluid approximation);
- the learner waits up to ``straggler_timeout_ms`` past the median arrival, then goes on without the late ones
  (their gradients are dropped: a failed sync);
- a worker whose asynchronous sampling is paused, or whose process is down while it restarts alone, contributes
  no samples and does not hold the group up;
- the step is worth the mean of its workers' contributions: 0 for dropped, otherwise the statistical efficiency of
  what was sent (4-bit compression, accumulation staleness); while some actors sample nothing (paused or
  restarting alone), the mean of the others times the measured progress at that share of the actors sampling
  (``efficiency.sampling_progress``, calibrated on a real actor-learner job; None: they count 0 in the mean).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

# Re-exported: the records a run leaves behind lived here before (dsec.sim.runner imports Outcome from here).
from dsec.sim.outcome import Interruption as Interruption
from dsec.sim.outcome import Outcome as Outcome
from dsec.sim.scenario import Scenario
from dsec.sim.world import DOWN, PENDING, RUN, Kind, Layout, Trace, Truth, generate, layout_of, sample_noise, truth_of


class Regime(Protocol):
    """What the loop asks of a regime (dsec.sim.regimes implements it); a protocol, so the loop does not import the
    regimes that drive it."""

    name: str
    durable_interval_s: float
    durable_cost_s: float
    pending: list[int]

    def attach(self, sim: Simulation) -> None: ...
    def place_all(self, t: float) -> None: ...
    def restart(self, g: int, t: float, cause: str, victims: list[int]) -> float: ...
    def fail_workers(self, t: float, cause: str, victims: list[int]) -> None: ...
    def durable_interval(self, g: int, t: float) -> float: ...
    def power_off(self, t: float, cards: list[int]) -> None: ...
    def capacity_back(self, t: float) -> None: ...
    def observe(self, t: float, k: int, mem: np.ndarray, compute_s: np.ndarray, latency_ms: np.ndarray) -> None: ...
    def meltdowns(self) -> int | None: ...
    def decisions(self) -> dict[str, int]: ...


_UP, _DURABLE, _REJOIN = 0, 1, 2


class Simulation:
    def __init__(self, sc: Scenario, regime: Regime, trace: Trace | None = None, truth: Truth | None = None) -> None:
        self.sc = sc
        self.layout: Layout = layout_of(sc)
        self.truth = truth if truth is not None else truth_of(sc, np.random.default_rng([sc.seed, 1]))
        self.trace = trace if trace is not None else generate(sc, self.layout, self.truth)
        g, n = sc.groups.count, sc.groups.size
        self.G, self.n, self.N = g, n, sc.workers
        self.group_of = np.arange(self.N) // n
        self.is_learner = (np.arange(self.N) % n) < sc.groups.learners
        self.slot_of = np.full(self.N, -1, dtype=np.int64)
        self.occupant = np.full(self.layout.slots, -1, dtype=np.int64)
        self.run_start = np.zeros(self.N)
        self.burst_t0 = np.full(self.N, -math.inf)
        self.burst_gb = np.zeros(self.N)
        self.burst_end = np.full(self.N, -math.inf)
        self.jitter = np.zeros(self.N, dtype=np.int64)
        self.card_off = np.zeros(self.layout.cards, dtype=bool)
        self.throttled = np.zeros(self.layout.cards, dtype=np.int64)
        self.saw_throttle = np.zeros(self.N, dtype=bool)  # throttling seen (as NVML reports it) during the run
        # Per-worker controls in force (the regime sets them): fraction of uncompressed bytes, accumulation, paused.
        self.bits_frac = np.ones(self.N)
        self.accum = np.ones(self.N)
        self.paused = np.zeros(self.N, dtype=bool)
        # Workers restarting alone (their group trains on without them), and since when.
        self.absent = np.zeros(self.N, dtype=bool)
        self.absent_since = np.zeros(self.N)
        # Groups.
        self.status = np.full(g, PENDING)
        self.epoch = np.zeros(g, dtype=np.int64)
        self.progress = np.zeros(g)
        self.durable = np.zeros(g)
        self.rate = np.zeros(g)  # useful steps/s
        self.raw_rate = np.zeros(g)  # optimizer steps/s
        self.syncing = np.zeros(g)  # workers synchronizing per step
        self.dropped = np.zeros(g)  # of which dropped per step
        self.acc_t = np.zeros(g)
        self.down_since = np.zeros(g)
        self.pending_since = np.zeros(g)
        self.down_s = np.zeros(g)
        self.pending_s = np.zeros(g)
        self.blocked_s = np.zeros(g)
        self.rolled_back = np.zeros(g)
        self.sync_ops = np.zeros(g)  # gradient syncs attempted / succeeded, per group
        self.sync_ok = np.zeros(g)
        self.last_step_s = np.full(g, sc.groups.step_s)
        # What each worker's probe reports as its sync cost, over the last three samples (the breaker's evidence
        # window): how long the group waited for it alone at that sample's step (ms; 0 but for each group's latest
        # arrival). The breaker's top-rung rule reads it (dsec.sim.dsec_breakers).
        self.lateness_ring = np.zeros((3, self.N))
        self._lateness_k = 0
        self.interruptions: list[Interruption] = []
        self.timeline: list[tuple[float, float]] = []
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self.now = 0.0
        self.regime = regime
        grp = sc.groups
        self.transfer_ms = grp.gradient_mb / sc.network.link_mb_per_s * 1000.0
        self.sampling_curve = sc.efficiency.sampling_curve()
        self.ideal_step_s = grp.step_s + (sc.network.base_latency_ms + self.transfer_ms) / 1000.0
        regime.attach(self)

    # -- helpers the regimes use ------------------------------------------------------------------------------------
    def workers_of(self, g: int) -> range:
        return range(g * self.n, (g + 1) * self.n)

    def free_slots(self) -> np.ndarray:
        usable = ~np.repeat(self.card_off, self.layout.workers_per_gpu)
        return np.flatnonzero((self.occupant < 0) & usable)

    def card_of_worker(self) -> np.ndarray:
        """Card of each worker (-1: none)."""
        return np.where(self.slot_of >= 0, self.slot_of // self.layout.workers_per_gpu, -1)

    def memory(self, t: float, sel: slice | list[int] = slice(None), bursts: bool = True) -> np.ndarray:
        """Memory the workers ``sel`` use at ``t`` (the world model; placed workers only, others 0); without
        ``bursts``: the steady part only (base + what the card leaked)."""
        mem = self.sc.groups.memory
        slot = self.slot_of[sel]
        placed = (slot >= 0) & ~self.absent[sel]  # a process restarting alone holds no memory
        card = np.where(placed, slot // self.layout.workers_per_gpu, 0)
        used = mem.base_gb + self.truth.leak_gb_per_h[card] * np.maximum(0.0, t - self.run_start[sel]) / 3600.0
        if bursts:
            t0, size = self.burst_t0[sel], self.burst_gb[sel]
            in_burst = (t >= t0) & (t < self.burst_end[sel])
            ramp = np.clip((t - t0) / mem.burst_ramp_s, 0.0, 1.0) if mem.burst_ramp_s > 0 else 1.0
            burst = np.where(in_burst, size * ramp, 0.0)
            used = used + np.where(self.accum[sel] > 1, burst * mem.accumulation_burst_factor, burst)
        return np.where(placed, used, 0.0)

    def _push(self, t: float, kind: int, g: int, target: int | None = None) -> None:
        """Schedule ``kind`` for group ``g`` (``target``: the worker for a rejoin), void if the group fails first."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, g if target is None else target, int(self.epoch[g])))

    # -- group lifecycle ---------------------------------------------------------------------------------------------
    def account(self, t: float, sel: slice = slice(None)) -> None:
        """Advance the groups ``sel`` (default: all) to ``t`` at their current rates; a running group's ``acc_t``
        may lie ahead of ``t`` (it stands still while its state is saved), then nothing is added."""
        dt = np.where(self.status[sel] == RUN, np.maximum(0.0, t - self.acc_t[sel]), 0.0)
        self.progress[sel] += self.rate[sel] * dt
        steps = self.raw_rate[sel] * dt
        self.sync_ops[sel] += steps * self.syncing[sel]
        self.sync_ok[sel] += steps * (self.syncing[sel] - self.dropped[sel])
        self.acc_t[sel] = np.maximum(self.acc_t[sel], t)

    def start(self, g: int, t: float, delay_s: float) -> None:
        """Group ``g`` (all its workers placed) trains again after ``delay_s``."""
        if self.status[g] == PENDING:
            self.pending_s[g] += t - self.pending_since[g]
        self.status[g] = DOWN
        self.down_since[g] = t
        self.rate[g] = self.raw_rate[g] = 0.0
        ws = self.workers_of(g)
        self.run_start[ws] = t + delay_s
        self.saw_throttle[ws] = False
        self.burst_end[ws] = -math.inf  # a new process: what the old one held is gone
        self._push(t + delay_s, _UP, g)

    def park(self, g: int, t: float) -> None:
        """Group ``g`` waits for capacity (some worker has no slot)."""
        if self.status[g] == DOWN:
            self.down_s[g] += t - self.down_since[g]
        if self.status[g] != PENDING:
            self.pending_since[g] = t
        self.status[g] = PENDING
        self.rate[g] = self.raw_rate[g] = 0.0

    def release(self, workers: Iterable[int]) -> None:
        for w in workers:
            self.assign(w, -1)

    def assign(self, w: int, slot: int) -> None:
        old = self.slot_of[w]
        if old >= 0:
            self.occupant[old] = -1
        if slot >= 0:
            assert self.occupant[slot] < 0, f"slot {slot} is taken"
            self.occupant[slot] = w
        self.slot_of[w] = slot

    def lose_workers(self, g: int, t: float, cause: str, victims: list[int], recovery_s: float) -> None:
        """Workers ``victims`` of the running group ``g`` ended at ``t`` and restart alone, back in ``recovery_s``
        (their slots already chosen by the regime); the group trains on without them, nothing is rolled back. Their
        absence is charged as restart time: each absent worker-second is 1/n of a group-second. The group's rate
        follows from the next sample on (rates are per sample): an absence shorter than the sample interval is in
        the restart time, not in the progress — at most one sample's worth per restart, for every regime alike."""
        self.account(t, slice(g, g + 1))
        for w in victims:
            self.absent[w] = True
            self.absent_since[w] = t
            self.run_start[w] = t + recovery_s
            self.saw_throttle[w] = False
            self.burst_end[w] = -math.inf  # a new process: what the old one held is gone
            self._push(t + recovery_s, _REJOIN, g, target=w)
        self.interruptions.append(
            Interruption(t, g, cause, len(victims), recovery_s, 0.0, int(self.is_learner[victims].sum()))
        )

    def _rejoin(self, w: int, t: float) -> None:
        if self.absent[w]:
            g = int(self.group_of[w])
            self.account(t, slice(g, g + 1))
            self.down_s[g] += (t - self.absent_since[w]) / self.n
            self.absent[w] = False

    def _rejoin_all(self, g: int, t: float) -> None:
        """Close the absences of group ``g``'s workers at ``t`` (the group stops, or the run ends)."""
        for w in self.workers_of(g):
            self._rejoin(w, t)

    def save(self, g: int, t: float) -> None:
        """Group ``g`` (running) saves its state now (a periodic checkpoint or snapshot, or one a regime asks for at
        ``t``): what it trained so far becomes durable; training stands still for the save's cost. The periodic
        schedule is not moved."""
        if self.status[g] != RUN:
            return
        self.account(t, slice(g, g + 1))
        self.durable[g] = self.progress[g]
        cost = self.regime.durable_cost_s
        self.acc_t[g] = max(self.acc_t[g], t) + cost  # training stands still while the state is saved
        self.blocked_s[g] += cost

    def fail(self, g: int, t: float, cause: str, victims: list[int], durable_first: bool = False) -> None:
        """Workers ``victims`` of group ``g`` ended at ``t`` (crash, OOM, power, migration); the group stops and
        the regime restarts it. ``durable_first``: the state was saved just before (planned moves)."""
        if self.status[g] == PENDING:
            return
        self._rejoin_all(g, t)  # workers restarting alone go down with the group (and their restart is void)
        self.account(t, slice(g, g + 1))
        if self.status[g] == DOWN:
            self.down_s[g] += t - self.down_since[g]
        if durable_first:
            self.durable[g] = self.progress[g]
        lost = self.progress[g] - self.durable[g]
        self.rolled_back[g] += lost
        self.progress[g] = self.durable[g]
        self.epoch[g] += 1
        self.status[g] = DOWN  # until the regime decides
        self.down_since[g] = t
        self.rate[g] = self.raw_rate[g] = 0.0
        recovery = self.regime.restart(g, t, cause, victims)
        learners = int(self.is_learner[victims].sum())
        self.interruptions.append(Interruption(t, g, cause, len(victims), recovery, lost, learners))

    # -- the loop ------------------------------------------------------------------------------------------------------
    def run(self, on_progress: Callable[[int, int], None] | None = None) -> Outcome:
        """Simulate the whole horizon; ``on_progress(ticks done, ticks)`` after every timeline point (10 simulated
        minutes) and at the end."""
        wall0 = time.perf_counter()
        sc = self.sc
        horizon = sc.duration_h * 3600.0
        dt = sc.sample_interval_s
        self.regime.place_all(0.0)
        ticks = math.floor(horizon / dt + 1e-9)
        ti = 0
        tr = self.trace
        timeline_every = max(1, round(600.0 / dt))
        for k in range(1, ticks + 1):
            t_sample = k * dt
            while True:
                next_trace = tr.times[ti] if ti < len(tr) else math.inf
                next_own = self._heap[0][0] if self._heap else math.inf
                t_next = min(next_trace, next_own)
                if t_next > t_sample:
                    break
                if next_own <= next_trace:
                    self._own_event(*heapq.heappop(self._heap))
                else:
                    self._trace_event(float(tr.times[ti]), int(tr.kinds[ti]), int(tr.targets[ti]), float(tr.values[ti]))
                    ti += 1
            self.now = t_sample
            self._sample(k, t_sample)
            if k % timeline_every == 0 or k == ticks:
                self.timeline.append((t_sample, float(self.progress.sum())))
                if on_progress is not None:
                    on_progress(k, ticks)
        self.account(horizon)
        for g in range(self.G):
            self._rejoin_all(g, horizon)
            if self.status[g] == DOWN:
                self.down_s[g] += horizon - self.down_since[g]
            elif self.status[g] == PENDING:
                self.pending_s[g] += horizon - self.pending_since[g]
        return Outcome(
            regime=self.regime.name,
            duration_s=horizon,
            groups=self.G,
            workers=self.N,
            gpus_per_group=self.n / self.layout.workers_per_gpu,
            ideal_rate=1.0 / self.ideal_step_s,
            progress=self.progress.copy(),
            down_s=self.down_s.copy(),
            pending_s=self.pending_s.copy(),
            blocked_s=self.blocked_s.copy(),
            rolled_back=self.rolled_back.copy(),
            sync_ops=float(self.sync_ops.sum()),
            sync_ok=float(self.sync_ok.sum()),
            interruptions=list(self.interruptions),
            meltdowns=self.regime.meltdowns(),
            timeline=list(self.timeline),
            decisions=self.regime.decisions(),
            wall_s=time.perf_counter() - wall0,
        )

    def _own_event(self, t: float, _seq: int, kind: int, g: int, epoch: int) -> None:
        if kind == _REJOIN:  # ``g`` is the worker here
            if epoch == self.epoch[self.group_of[g]]:  # else its group failed meanwhile: the restart is void
                self._rejoin(g, t)
            return
        if epoch != self.epoch[g]:
            return  # the group failed since this was scheduled
        if kind == _UP and self.status[g] == DOWN:
            self.down_s[g] += t - self.down_since[g]
            self.status[g] = RUN
            self.acc_t[g] = t
            self._fault_free_rate(g)
            self._push(t + self.regime.durable_interval(g, t), _DURABLE, g)
        elif kind == _DURABLE and self.status[g] == RUN:
            self.save(g, t)
            self._push(t + self.regime.durable_interval(g, t), _DURABLE, g)

    def _trace_event(self, t: float, kind: int, target: int, value: float) -> None:
        if kind == Kind.THROTTLE_ON:
            self.throttled[target] += 1
            on = self.slot_of >= 0
            self.saw_throttle |= on & (self.slot_of // self.layout.workers_per_gpu == target)
        elif kind == Kind.THROTTLE_OFF:
            self.throttled[target] = max(0, self.throttled[target] - 1)
        elif kind == Kind.CRASH:
            w = int(self.occupant[target])
            if w >= 0 and self.status[self.group_of[w]] == RUN and not self.absent[w]:
                self.regime.fail_workers(t, "crash", [w])
        elif kind == Kind.BURST:
            ramp = self.sc.groups.memory.burst_ramp_s
            self.burst_t0[target] = t
            self.burst_gb[target] = value
            self.burst_end[target] = t + ramp + self.sc.groups.memory.burst_s
        elif kind == Kind.JITTER_ON:
            self.jitter[target] += 1
        elif kind == Kind.JITTER_OFF:
            self.jitter[target] = max(0, self.jitter[target] - 1)
        elif kind == Kind.POWER_OFF:
            cards = list(self.trace.power_cards)
            self.regime.power_off(t, cards)
        elif kind == Kind.POWER_ON:
            self.card_off[list(self.trace.power_cards)] = False
            self.regime.capacity_back(t)

    # -- a sample: telemetry, decisions, rates -----------------------------------------------------------------------
    def _sample(self, k: int, t: float) -> None:
        self.account(t)
        sc = self.sc
        normal, expo = sample_noise(sc.seed, k, self.N)
        card = self.card_of_worker()
        placed = card >= 0
        slow = np.where(placed & (self.throttled[np.maximum(card, 0)] > 0), sc.cluster.throttle_slowdown, 1.0)
        compute_s = sc.groups.step_s * slow
        net = sc.network
        sigma = net.noise_sigma
        base = net.base_latency_ms + np.where(self.jitter > 0, net.jitter.extra_ms * expo, 0.0)
        latency_ms = base * np.exp(sigma * normal - sigma * sigma / 2) + self.transfer_ms * self.bits_frac
        mem = self.memory(t)
        self.regime.observe(t, k, mem, compute_s, latency_ms)
        if self.regime.pending:
            self.regime.capacity_back(t)
        self._rates(compute_s, latency_ms)

    def _fault_free_rate(self, g: int) -> None:
        # A group back up between samples trains at a fault-free estimate until the next sample measures it.
        self.rate[g] = self.raw_rate[g] = 1.0 / self.ideal_step_s
        self.syncing[g] = self.n
        self.dropped[g] = 0.0

    def _rates(self, compute_s: np.ndarray, latency_ms: np.ndarray) -> None:
        sc = self.sc
        n, G = self.n, self.G
        out = self.paused | self.absent  # neither sends samples nor holds the group up
        paused = out.reshape(G, n)
        stall = latency_ms / 1000.0 / self.accum
        arrival = np.where(paused, np.inf, (compute_s + stall).reshape(G, n))
        active = ~paused
        counts = active.sum(axis=1)
        # Median and latest of the active workers' arrivals (paused ones sort last as +inf).
        ordered = np.sort(arrival, axis=1)
        lo = np.maximum((counts - 1) // 2, 0)[:, None]
        hi = np.maximum(counts // 2, 0)[:, None]
        with np.errstate(invalid="ignore"):
            med = 0.5 * (np.take_along_axis(ordered, lo, 1) + np.take_along_axis(ordered, hi, 1))[:, 0]
        latest = np.take_along_axis(ordered, np.maximum(counts - 1, 0)[:, None], 1)[:, 0]
        cutoff = med + sc.baseline.straggler_timeout_ms / 1000.0
        dropped = active & (arrival > cutoff[:, None])
        step_s = np.minimum(latest, cutoff)
        eff = sc.efficiency
        contrib = np.where(self.bits_frac < 1.0, eff.compressed_4bit, 1.0) * np.where(
            self.accum > 1, eff.accumulated, 1.0
        )
        contrib = np.where(dropped.ravel() | out, 0.0, contrib).reshape(G, n)
        curve, actors = self.sampling_curve, sc.groups.actors
        if curve is None or actors == 0:
            useful = contrib.mean(axis=1)
        else:
            # The others' mean (a learner that is out still counts 0), times the progress left at this share of the
            # actors sampling; with every actor sampling, exactly the mean above.
            idle = (out & ~self.is_learner).reshape(G, n).sum(axis=1)
            useful = contrib.sum(axis=1) / np.maximum(n - idle, 1) * np.interp(1.0 - idle / actors, *curve)
        run = self.status == RUN
        ok = run & (counts > 0) & (step_s > 0)
        self.raw_rate = np.where(ok, 1.0 / np.where(ok, step_s, 1.0), 0.0)
        self.rate = self.raw_rate * useful
        per_step = (1.0 / self.accum).reshape(G, n)  # syncs per step: accumulating workers sync every 4th
        self.syncing = np.where(ok, (active * per_step).sum(axis=1), 0.0)
        self.dropped = np.where(ok, (dropped * per_step).sum(axis=1), 0.0)
        self.last_step_s = np.where(ok, step_s, self.last_step_s)
        # The latest arrival's lead over the next one, both capped at the cutoff: the wait it alone caused.
        second = np.take_along_axis(ordered, np.maximum(counts - 2, 0)[:, None], 1)[:, 0]
        lead = np.where(ok & (counts >= 2), np.minimum(latest, cutoff) - np.minimum(second, cutoff), 0.0)
        last = np.argmax(np.where(paused, -np.inf, arrival), axis=1)
        row = self.lateness_ring[self._lateness_k % 3]
        row[:] = 0.0
        row[np.arange(G) * n + last] = np.maximum(lead, 0.0) * 1000.0
        self._lateness_k += 1
