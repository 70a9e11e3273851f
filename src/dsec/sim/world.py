"""The simulator's own models of the world — kept apart from DSec's decision code, which never reads them.

- **Layout**: nodes, cards (memory, NUMA node, NVLink peers), and the *slots* of a shared card (``workers_per_gpu``
  workers run on one card; each slot is what DSec's placement sees as a device, with an equal share of the card's
  memory).
- **Hidden truth**: a seeded fraction of cards is *bad* (memory leak, frequent throttling, crashes). DSec sees only
  what happens on them (OOMs, failures, throttling as NVML reports it while it lasts, memory growth) and has to
  learn which cards they are.
- **Fault trace**: one seeded list of timed events — thermal throttling per card, crashes per slot, sparse-reward
  memory bursts and link-jitter episodes per worker, the nightly power-saving window — generated once and replayed
  identically under every regime, so the regimes differ only in what they do about the faults.
- **Per-sample noise**: drawn from a generator keyed by (seed, sample index), so it is the same in every regime.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from dsec.sim.scenario import GpuTruth, Scenario

#: A group's status in the simulation (engine and regimes share it).
RUN, DOWN, PENDING = 0, 1, 2


class Kind(enum.IntEnum):
    # Order = processing order of events at the same instant: world changes first, then the sample that sees them.
    POWER_OFF = 0
    POWER_ON = 1
    THROTTLE_ON = 2
    THROTTLE_OFF = 3
    CRASH = 4
    BURST = 5
    JITTER_ON = 6
    JITTER_OFF = 7


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    workers_per_gpu: int
    numa_per_node: int
    nvlink: str

    @property
    def cards(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def slots(self) -> int:
        return self.cards * self.workers_per_gpu

    def card_of(self, slot: int) -> int:
        return slot // self.workers_per_gpu

    def node_of_card(self, card: int) -> int:
        return card // self.gpus_per_node

    def numa_of_card(self, card: int) -> int:
        return (card % self.gpus_per_node) * self.numa_per_node // self.gpus_per_node

    def nvlinked_cards(self, card: int) -> list[int]:
        """Cards with an NVLink to ``card`` (itself excluded)."""
        node, local = divmod(card, self.gpus_per_node)
        first = node * self.gpus_per_node
        if self.nvlink == "all":
            return [first + i for i in range(self.gpus_per_node) if i != local]
        if self.nvlink == "pairs":
            peer = local ^ 1
            return [first + peer] if peer < self.gpus_per_node else []
        return []

    def card_name(self, card: int) -> str:
        node, local = divmod(card, self.gpus_per_node)
        return f"n{node}-g{local}"

    def slot_name(self, slot: int) -> str:
        card, j = divmod(slot, self.workers_per_gpu)
        return f"{self.card_name(card)}-s{j}"


@dataclass
class Truth:
    """Per card, what it really does (hidden from DSec)."""

    bad: np.ndarray  # bool per card
    leak_gb_per_h: np.ndarray  # per card
    throttle_per_h: np.ndarray
    crash_per_h: np.ndarray


@dataclass
class Trace:
    """The seeded fault trace: events sorted by (time, kind)."""

    times: np.ndarray  # float seconds
    kinds: np.ndarray  # Kind values
    targets: np.ndarray  # card, slot or worker index
    values: np.ndarray  # burst size (GB) or episode/event duration (s)
    power_cards: tuple[int, ...] = ()  # the cards the power-saving window switches off
    counts: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.times)


def layout_of(sc: Scenario) -> Layout:
    c = sc.cluster
    return Layout(c.nodes, c.gpus_per_node, c.workers_per_gpu, c.numa_per_node, c.nvlink)


def truth_of(sc: Scenario, rng: np.random.Generator) -> Truth:
    cards = sc.gpus
    bad = np.zeros(cards, dtype=bool)
    n_bad = round(sc.cluster.bad_gpu_fraction * cards)
    if n_bad:
        bad[rng.choice(cards, size=n_bad, replace=False)] = True

    def per_card(name: str) -> np.ndarray:
        good: GpuTruth = sc.cluster.healthy
        worse: GpuTruth = sc.cluster.bad
        out: np.ndarray = np.where(bad, float(getattr(worse, name)), float(getattr(good, name)))
        return out

    return Truth(bad, per_card("leak_gb_per_h"), per_card("throttle_per_h"), per_card("crash_per_h"))


def _poisson_times(rng: np.random.Generator, rate_per_s: np.ndarray, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Event times of independent Poisson processes (one per entry of ``rate_per_s``) on [0, horizon)."""
    counts = rng.poisson(np.maximum(rate_per_s, 0.0) * horizon_s)
    owners = np.repeat(np.arange(len(rate_per_s)), counts)
    times = rng.uniform(0.0, horizon_s, size=int(counts.sum()))
    return times, owners


class _TraceBuilder:
    """The events of a fault trace as they are drawn, kind by kind; those past the horizon are dropped."""

    def __init__(self, horizon: float) -> None:
        self.horizon = horizon
        self.times: list[np.ndarray] = []
        self.kinds: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.counts: dict[str, int] = {}

    def add(self, kind: Kind, t: np.ndarray, who: np.ndarray, value: np.ndarray | float = 0.0) -> None:
        v = np.broadcast_to(np.asarray(value, dtype=float), t.shape)
        keep = t < self.horizon
        self.times.append(t[keep])
        self.kinds.append(np.full(int(keep.sum()), int(kind)))
        self.targets.append(who[keep].astype(np.int64))
        self.values.append(v[keep])
        self.counts[kind.name.lower()] = self.counts.get(kind.name.lower(), 0) + int(keep.sum())

    def trace(self, power_cards: tuple[int, ...]) -> Trace:
        """All events in time order (same instant: in :class:`Kind` order)."""
        times, kinds, targets, values = self.times, self.kinds, self.targets, self.values
        all_t = np.concatenate(times) if times else np.zeros(0)
        all_k = np.concatenate(kinds) if kinds else np.zeros(0, np.int64)
        order = np.lexsort((all_k, all_t))
        return Trace(
            all_t[order],
            all_k[order],
            np.concatenate(targets)[order] if targets else np.zeros(0, np.int64),
            np.concatenate(values)[order] if values else np.zeros(0),
            power_cards,
            self.counts,
        )


def generate(sc: Scenario, layout: Layout, truth: Truth, seed: int | None = None) -> Trace:
    """The fault trace of ``sc`` over its whole duration (independent of any regime)."""
    rng = np.random.default_rng([sc.seed if seed is None else seed, 2])
    horizon = sc.duration_h * 3600.0
    trace = _TraceBuilder(horizon)
    add = trace.add
    # Thermal throttling per card: episodes of fixed length (overlaps merge into one longer episode).
    t, card = _poisson_times(rng, truth.throttle_per_h / 3600.0, horizon)
    dur = sc.cluster.throttle_duration_s
    add(Kind.THROTTLE_ON, t, card, dur)
    add(Kind.THROTTLE_OFF, t + dur, card, dur)
    # Crashes per slot, at the rate of the slot's card (whatever worker sits there then is hit).
    slot_rate = np.repeat(truth.crash_per_h / 3600.0, layout.workers_per_gpu)
    t, slot = _poisson_times(rng, slot_rate, horizon)
    add(Kind.CRASH, t, slot)
    # Sparse-reward memory bursts per worker (a property of the workload, not of the card).
    mem = sc.groups.memory
    t, w = _poisson_times(rng, np.full(sc.workers, mem.burst_per_h / 3600.0), horizon)
    add(Kind.BURST, t, w, rng.exponential(mem.burst_gb, size=len(t)) if mem.burst_gb > 0 else 0.0)
    # Link jitter on a fixed fraction of workers (a property of their link).
    jit = sc.network.jitter
    n_jitter = round(jit.fraction * sc.workers)
    jittery = np.sort(rng.choice(sc.workers, size=n_jitter, replace=False)) if n_jitter else np.zeros(0, np.int64)
    t, idx = _poisson_times(rng, np.full(len(jittery), jit.episodes_per_h / 3600.0), horizon)
    add(Kind.JITTER_ON, t, jittery[idx], jit.episode_s)
    add(Kind.JITTER_OFF, t + jit.episode_s, jittery[idx], jit.episode_s)
    return trace.trace(_power_saving(sc, layout, rng, trace))


def _power_saving(sc: Scenario, layout: Layout, rng: np.random.Generator, trace: _TraceBuilder) -> tuple[int, ...]:
    """The nightly power-saving window switches off a fixed set of cards (the same cards every night): its events
    into ``trace``; the cards it switches off."""
    power_cards: tuple[int, ...] = ()
    ps = sc.faults.power_saving
    if ps is not None and ps.fraction > 0 and ps.duration_h > 0:
        n_off = round(ps.fraction * layout.cards)
        power_cards = tuple(sorted(int(c) for c in rng.choice(layout.cards, size=n_off, replace=False)))
        day = 0
        while day * 86400.0 + ps.start_h * 3600.0 < trace.horizon:
            start = day * 86400.0 + ps.start_h * 3600.0
            trace.add(Kind.POWER_OFF, np.array([start]), np.array([day]))
            trace.add(Kind.POWER_ON, np.array([start + ps.duration_h * 3600.0]), np.array([day]))
            day += 1
    return power_cards


def sample_noise(seed: int, index: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-worker noise of sample ``index``: a standard normal (latency noise) and a unit exponential (jitter size);
    the same for every regime."""
    rng = np.random.default_rng([seed, 3, index])
    return rng.standard_normal(workers), rng.exponential(1.0, workers)
