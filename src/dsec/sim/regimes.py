"""The two regimes the simulator compares on the same fault trace.

- :class:`Baseline` — common practice: Kubernetes + DDP/torchrun semantics. First-fit placement (bin-packing, as
  gang schedulers do for GPU jobs), no memory limits per worker (an OOM on a card kills every worker on it), any
  failure restarts the whole group from its last full checkpoint, stragglers are waited for up to a timeout; and
  :class:`TunedBaseline`, what a competent team runs (actors among them restarted alone, as RLlib does).
- :class:`~dsec.sim.dsec_regime.DsecRegime` — the same cluster run by DSec's *own* decision code
  (``dsec.decide`` and the cores it calls), in virtual time; it lives in its own module. This module holds no
  decision of DSec's: only the regimes' common mechanics and the baseline's.

Neither regime reads the hidden truth (``Simulation.truth``); both see the same telemetry.
"""

from __future__ import annotations

from collections import Counter
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml

from dsec.decide.cadence import young_interval_s
from dsec.policy import PolicySet, compile_policies, load_policies
from dsec.sim.scenario import Scenario
from dsec.sim.world import RUN

if TYPE_CHECKING:
    from dsec.sim.engine import Simulation


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

    def durable_interval(self, g: int, t: float) -> float:
        """Seconds from a save (checkpoint, snapshot) of group ``g`` at ``t`` to its next one."""
        return self.durable_interval_s

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
        """Workers of running groups whose process is up (not restarting alone)."""
        sim = self.sim
        return np.flatnonzero((sim.status[sim.group_of] == RUN) & ~sim.absent)

    def fail_workers(self, t: float, cause: str, victims: list[int]) -> None:
        """Processes ``victims`` ended (a crash, an OOM): per group, restart them alone when the regime does
        (:meth:`recover_alone`), else the group fails and restarts from its last durable point."""
        for g, ws in self._by_group(victims):
            if not self.recover_alone(g, t, cause, ws):
                self.sim.fail(g, t, cause, ws)

    def drain_workers(self, t: float, victims: list[int]) -> None:
        """Processes ``victims`` stopped after a snapshot at their last step (the probe's drain before the cap):
        per group, restarted alone when the regime does, else the group restarts from that snapshot (nothing rolls
        back)."""
        for g, ws in self._by_group(victims):
            if not self.recover_alone(g, t, "drain", ws):
                self.sim.fail(g, t, "drain", ws, durable_first=True)

    def _by_group(self, victims: list[int]) -> list[tuple[int, list[int]]]:
        """``victims`` by group, groups in order, each group's workers in the order given."""
        by_group: dict[int, list[int]] = {}
        for w in victims:
            by_group.setdefault(int(self.sim.group_of[w]), []).append(int(w))
        return sorted(by_group.items())

    def recover_alone(self, g: int, t: float, cause: str, victims: list[int]) -> bool:
        """Restart ``victims`` of group ``g`` alone while the group trains on (``Simulation.lose_workers``), if
        this regime does; False: the group restarts as a whole. The naive baseline never does (torchrun restarts
        every worker of the job)."""
        return False

    def actors_only(self, cause: str, victims: list[int]) -> bool:
        """A process failure (not a planned move) of actors only: no learner state is lost, nothing to roll back."""
        return cause in ("crash", "oom", "drain") and not bool(self.sim.is_learner[victims].any())

    def meltdowns(self) -> int | None:
        return None

    def decisions(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


def largest_first(
    workers: np.ndarray, mem: np.ndarray, slot_of: np.ndarray, per_card: int, capacity: float
) -> set[int]:
    """The workers whose allocations fail on cards over ``capacity``: a CUDA OOM raises in the process that
    allocates, and the largest user is the likeliest to be allocating; users fail largest first until the card fits."""
    victims: set[int] = set()
    if not len(workers):
        return victims
    card = slot_of[workers] // per_card
    used = np.bincount(card, weights=mem[workers])
    for c in np.flatnonzero(used > capacity):
        total = used[c]
        for w in sorted(workers[card == c], key=lambda w: -mem[w]):
            if total <= capacity:
                break
            victims.add(int(w))
            total -= mem[w]
    return victims


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


class TunedBaseline(Baseline):
    """What a competent team runs without DSec (``scenario.baseline.tuned``): checkpoints at the Young/Daly interval
    with asynchronous checkpointing, restarts in place unless a card is gone, drains before a planned power-off,
    cordons cards that keep failing, and a CUDA OOM fails only the allocating process."""

    name = "tuned"

    def __init__(self, scenario: Scenario, checkpoint_interval_s: float) -> None:
        t = scenario.baseline.tuned
        Regime.__init__(self, checkpoint_interval_s, t.checkpoint_blocking_s, t.restart_in_place_s)
        self.tuned = t
        self.failures: Counter[int] = Counter()  # per card: workers that crashed on it

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        self.cordoned = np.zeros(sim.layout.cards, dtype=bool)

    def first_fit(self, workers: list[int]) -> dict[int, int] | None:
        free = self.sim.free_slots()
        free = free[~self.cordoned[free // self.sim.layout.workers_per_gpu]]
        if len(free) < len(workers):
            return None
        return {w: int(s) for w, s in zip(workers, free[: len(workers)], strict=True)}

    def fail_workers(self, t: float, cause: str, victims: list[int]) -> None:
        sim, per_card = self.sim, self.sim.layout.workers_per_gpu
        if cause == "crash":  # a hardware/driver fault (XID); an OOM is the workload's, not the card's
            for w in victims:
                if sim.slot_of[w] >= 0:
                    card = int(sim.slot_of[w] // per_card)
                    self.failures[card] += 1
                    if self.failures[card] >= self.tuned.cordon_after_failures and not self.cordoned[card]:
                        self.cordoned[card] = True
                        self.counts["cordoned_cards"] += 1
        super().fail_workers(t, cause, victims)

    def recover_alone(self, g: int, t: float, cause: str, victims: list[int]) -> bool:
        """Actor fault tolerance (RLlib's ``restart_failed_env_runners``, IMPALA-style actor pools): a failed actor is
        recreated, in place unless its card is gone or cordoned; the learner goes on with the other actors."""
        if not self.tuned.actor_fault_tolerance or not self.actors_only(cause, victims):
            return False
        sim = self.sim
        moving = self.to_move(g, victims, cause)
        if moving:
            sim.release(moving)
            chosen = self.first_fit(moving)
            if chosen is None:  # nowhere to go: the group restarts as a whole (and waits for capacity)
                return False
            for w, slot in chosen.items():
                sim.assign(w, slot)
        self.counts[f"restart_alone:{cause}"] += 1
        tuned = self.tuned
        sim.lose_workers(g, t, cause, victims, tuned.restart_reschedule_s if moving else tuned.restart_in_place_s)
        return True

    def restart(self, g: int, t: float, cause: str, victims: list[int]) -> float:
        sim, per_card = self.sim, self.sim.layout.workers_per_gpu
        moved = self.to_move(g, victims, cause)
        off = sim.card_off | self.cordoned
        gone = any(sim.slot_of[w] < 0 or off[sim.slot_of[w] // per_card] for w in sim.workers_of(g))
        self.restart_s = self.tuned.restart_reschedule_s if gone or moved else self.tuned.restart_in_place_s
        return super().restart(g, t, cause, victims)

    def to_move(self, g: int, victims: list[int], cause: str) -> list[int]:
        per_card = self.sim.layout.workers_per_gpu
        off = self.sim.card_off | self.cordoned
        return [w for w in victims if self.sim.slot_of[w] >= 0 and off[self.sim.slot_of[w] // per_card]]

    def power_loss(self, g: int, t: float, victims: list[int]) -> None:
        if not self.tuned.drain_before_power_off:
            return super().power_loss(g, t, victims)
        # SIGTERM ahead of the scheduled power-off: the group checkpoints, then stops (nothing rolled back).
        self.counts["drains"] += 1
        self.sim.fail(g, t, "power", victims, durable_first=True)

    def observe(self, t: float, k: int, mem: np.ndarray, compute_s: np.ndarray, latency_ms: np.ndarray) -> None:
        if not self.tuned.per_process_oom:
            return super().observe(t, k, mem, compute_s, latency_ms)
        sim = self.sim
        run = self.running_workers()
        victims = largest_first(run, mem, sim.slot_of, sim.layout.workers_per_gpu, sim.sc.cluster.gpu_memory_gb)
        if victims:
            self.counts["oom_workers"] += len(victims)
            self.fail_workers(t, "oom", sorted(victims))


def young_daly_interval_s(blocking_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval sqrt(2 C M) for a checkpoint costing ``blocking_s`` and a mean time between
    failures ``mtbf_s`` (Daly's higher-order terms change it by little when C << M); at least 10 s."""
    return max(10.0, young_interval_s(max(blocking_s, 1e-3), mtbf_s))
