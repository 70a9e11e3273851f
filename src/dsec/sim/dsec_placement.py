"""DSec's placement in the simulator: ``dsec.scheduler.place`` with profiles learned from the simulated runs, on an
inventory built from the simulated cluster (a pre-filtered sample of nodes, as kube-scheduler scores a sample)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dsec.model import Device, DeviceHealth
from dsec.scheduler import (
    DeviceSignals,
    GroupSpec,
    Inventory,
    JobSpec,
    NodeInfo,
    Profiles,
    RunRecord,
    WorkerSpec,
    place,
)
from dsec.sim.regimes import Regime
from dsec.sim.scenario import Scenario

#: How many other nodes (with the most free slots) a re-placement considers besides the group's own nodes:
#: kube-scheduler likewise scores a sample of feasible nodes in large clusters. Keeps a placement O(group x nodes).
CANDIDATE_NODES = 4


class _CardProfiles(Profiles):
    """Profiles keyed by card while placement sees slots: a slot's risk is its card's (the sim's adapter)."""

    def __init__(self, card_of_slot: dict[str, str]) -> None:
        super().__init__()
        self.card_of_slot = card_of_slot

    def device_risk(self, device: str, load_class: str) -> float:
        return super().device_risk(self.card_of_slot.get(device, device), load_class)


class PlacementPass(Regime):
    """Placement and run history of :class:`~dsec.sim.dsec_regime.DsecRegime` (set up by its ``attach``)."""

    sc: Scenario
    degraded: np.ndarray
    room_until: np.ndarray
    health_by_name: dict[str, DeviceHealth]
    card_names: list[str]
    slot_devices: list[Device]
    slot_name_to_index: dict[str, int]
    profiles: Profiles
    nodes: dict[str, NodeInfo]
    load_class: str

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
        # Degraded cards take nobody, nor do cards holding room made for a burst (dsec.quota.room) while it lasts.
        placeable = free[~self.degraded[cards] & ~(self.room_until[cards] > t)]
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

    def choose_elsewhere(self, g: int, workers: list[int], t: float) -> dict[int, int] | None:
        """What ``choose`` would give ``workers`` of group ``g`` with their own slots free; nothing is moved."""
        sim = self.sim
        held = {w: int(sim.slot_of[w]) for w in workers}
        sim.release(workers)
        try:
            return self.choose(g, workers, t)
        finally:
            for w, slot in held.items():
                if slot >= 0:
                    sim.assign(w, slot)

    def to_move(self, g: int, victims: list[int], cause: str) -> list[int]:
        # The failed workers are placed anew with what was learned (their card's record just went in); placement
        # may well keep them where they were.
        return victims

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
