"""DSec's degraded-device detection in the simulator.

The fleet comparison per group (``dsec.health.fleet``), the slow and judged workers (``dsec.decide.fleet``), their
occupancy per card (``dsec.decide.occupancy``) and the device-health timers (``dsec.scheduler.DeviceHealthTracker``);
a degraded card's groups move (``dsec.decide.degrade``)."""

from __future__ import annotations

import numpy as np

from dsec.decide import degrade, judged_workers, occupancy, slow_workers
from dsec.health.fleet import FleetConfig, PeerSample, compare
from dsec.model import DeviceHealth
from dsec.scheduler import DeviceHealthConfig, DeviceHealthTracker
from dsec.sim.regimes import Regime
from dsec.sim.scenario import Scenario
from dsec.sim.world import RUN

UNMOVABLE_RETRY_S = 30.0  # the launcher's supervisor's default ``unmovable_retry_s``


class DeviceHealthPass(Regime):
    """Device health of :class:`~dsec.sim.dsec_regime.DsecRegime` (set up by its ``attach``)."""

    sc: Scenario
    reference: bool
    fleet_config: FleetConfig
    health_config: DeviceHealthConfig
    tracker: DeviceHealthTracker
    degraded: np.ndarray
    probation: np.ndarray
    card_names: list[str]
    health_by_name: dict[str, DeviceHealth]
    pool_names: list[str]
    recovering_until: np.ndarray
    unmovable: dict[int, tuple[int, float]]

    def _record_runs(self, victims: list[int], t: float, failed: bool, oom: bool) -> None:
        raise NotImplementedError

    def choose_elsewhere(self, g: int, workers: list[int], t: float) -> dict[int, int] | None:
        raise NotImplementedError

    def _device_health(self, t: float, run: np.ndarray, compute_s: np.ndarray) -> None:
        """Device health on each worker's compute time (the probe's ``compute_ms_p50``): a slow or jittery link makes
        a worker's syncs slower, not its compute, and follows the worker, so it is no evidence against a card."""
        sim, lay = self.sim, self.sim.layout
        slow: set[int] = set()
        judged: set[int] = set()
        groups = np.unique(sim.group_of[run])
        if len(groups):
            n = sim.n
            compute_ms = (compute_s * 1000.0).reshape(sim.G, n)
            candidates = groups if self.reference else groups[self._may_have_outliers(groups, compute_ms)]
            for g in candidates.tolist():
                samples = [
                    PeerSample(
                        str(w),
                        "learner" if sim.is_learner[w] else "actor",
                        self.pool_names[g],
                        {"compute_ms_p50": float(compute_ms[g, i])},
                    )
                    for i, w in enumerate(range(g * n, (g + 1) * n))
                ]
                report = compare(samples, self.fleet_config)
                slow |= {int(w) for w in slow_workers(report.outliers_by_worker())}
                if self.reference:
                    judged |= {int(w) for w in judged_workers(samples, report, self.fleet_config)}
        card_of_run = sim.slot_of[run] // lay.workers_per_gpu
        if not self.reference:
            # Fast path, exact: every worker of a running group reports the compute feature, so a role's peer
            # count is its size and judged_workers() is every worker of a role with >= min_peers members (the
            # reference mode computes it from the comparison; tests/unit/sim compares the two). And the tracker
            # reads a healthy card's occupancy only for whether all its judged workers are slow, which needs a slow
            # worker: occupancy is counted for the cards with a slow worker and the cards that are not healthy (an
            # absent healthy card reads as one whose workers are not all slow, which it is).
            keep = self.degraded[card_of_run] | self.probation[card_of_run]
            if slow:
                keep |= np.isin(card_of_run, card_of_run[np.isin(run, list(slow))])
            run, card_of_run = run[keep], card_of_run[keep]
            min_peers = self.fleet_config.min_peers
            learners, actors = self.sc.groups.learners >= min_peers, self.sc.groups.actors >= min_peers
            judged = {w for w in run.tolist() if (learners if sim.is_learner[w] else actors)}
        placed = zip((self.card_names[c] for c in card_of_run.tolist()), run.tolist(), strict=True)
        for change in self.tracker.step(t, self.health_by_name, occupancy(placed, judged, slow)):
            c = self._card_index(change.device)
            self.set_card_health(c, change.after)
            self.counts[f"device:{change.after.value}"] += 1
            if change.degraded:
                self._migrate_off(c, t)
        if self.unmovable:
            self._retry_unmovable(t)

    def set_card_health(self, card: int, health: DeviceHealth) -> None:
        self.health_by_name[self.card_names[card]] = health
        self.degraded[card] = health is DeviceHealth.DEGRADED
        self.probation[card] = health is DeviceHealth.PROBATION

    def _may_have_outliers(self, groups: np.ndarray, compute_ms: np.ndarray) -> np.ndarray:
        """Which groups ``compare`` could flag anyone in (an exact pre-filter, vectorized over groups): an outlier's
        excess over its role's median must exceed the feature's floors, so a group whose largest excess does not
        cannot have one. Comparing only the others gives the same flags for a fraction of the cost."""
        learners = self.sc.groups.learners
        out = np.zeros(len(groups), dtype=bool)
        spec = next((f for f in self.fleet_config.features if f.name == "compute_ms_p50"), None)
        if spec is None:
            return out
        for lo, hi in ((0, learners), (learners, self.sim.n)):
            if hi - lo < self.fleet_config.min_peers:
                continue
            sub = compute_ms[groups, lo:hi]
            med = np.median(sub, axis=1)
            floor = np.maximum(spec.min_abs_excess, spec.min_rel_excess * np.abs(med))
            out |= sub.max(axis=1) - med > floor - 1e-9
        return out

    def _card_index(self, name: str) -> int:
        node, rest = name[1:].split("-g")
        return int(node) * self.sim.layout.gpus_per_node + int(rest)

    def _migrate_off(self, card: int, t: float) -> None:
        """The card degraded: its workers were asked for a snapshot; their groups move from it — where they can go.
        A group with nowhere to go keeps running on the degraded card, as the launcher's supervisor does (it stays
        when the job cannot be placed again); moving it anyway parked it, holding nothing, until capacity came back
        (on scale-10k, with no spare slot, for the rest of the run)."""
        sim, lay = self.sim, self.sim.layout
        ws = [int(w) for w in sim.occupant[card * lay.workers_per_gpu : (card + 1) * lay.workers_per_gpu] if w >= 0]
        groups = sorted({int(sim.group_of[w]) for w in ws})
        for g in groups:
            self.recovering_until[g] = degrade(self.card_names[card], t, self.health_config).hold_until
            self._move_off(card, g, [w for w in ws if sim.group_of[w] == g], t)

    def _move_off(self, card: int, g: int, victims: list[int], t: float, retry: bool = False) -> None:
        sim = self.sim
        self.unmovable.pop(g, None)
        if self.recover_alone(g, t, "migration", victims):
            return  # actors only: they move alone, the learner trains on (counted restart_alone:migration)
        if not self._placeable(g, victims, t):
            self.counts["unmovable_retries" if retry else "unmovable"] += 1
            self.unmovable[g] = (card, t)
            return
        self.counts["migrations"] += 1
        self._record_runs(victims, t, failed=False, oom=False)
        sim.fail(g, t, "migration", victims, durable_first=True)

    def _retry_unmovable(self, t: float) -> None:
        """As the supervisor does every ``UNMOVABLE_RETRY_S``: a group left on a degraded card tries to move again
        (capacity may have come back), while the card is degraded and the group still has workers on it."""
        sim, per_card = self.sim, self.sim.layout.workers_per_gpu
        for g, (card, tried) in sorted(self.unmovable.items()):
            if t - tried < UNMOVABLE_RETRY_S:
                continue
            victims = [int(w) for w in sim.workers_of(g) if sim.slot_of[w] >= 0 and sim.slot_of[w] // per_card == card]
            if not self.degraded[card] or not victims or sim.status[g] != RUN:
                del self.unmovable[g]
                continue
            self._move_off(card, g, victims, t, retry=True)

    def _placeable(self, g: int, victims: list[int], t: float) -> bool:
        """Whether placement finds the ``victims`` of group ``g`` new slots (the degraded card excluded), or else
        the whole group (the supervisor re-places the whole job); nothing is moved here."""
        return any(self.choose_elsewhere(g, ws, t) is not None for ws in (victims, list(self.sim.workers_of(g))))
