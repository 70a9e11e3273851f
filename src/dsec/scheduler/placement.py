"""Placement of a job's worker groups onto devices: hard constraints, scored preferences, and an explanation.

Hard constraints (a device failing one is *excluded*, with the reason): not degraded or drained, no NVML alarm
(throttling, uncorrected ECC), inside the pool's devices and its ``gpu_quota``, one worker per device, enough free
memory for the worker's need. A device on *probation* (readmitted after a degradation) is placeable, last in line
(the ``probation`` term).

Scored preferences, per assignment (the explanation lists every term):

- ``numa`` (hardware affinity): an actor on the same NUMA node as its group's learner (+1 per such pair);
- ``nvlink`` (topology affinity): in a group that shares a replay buffer, +1 per NVLink link to an already placed
  member;
- ``state`` (state affinity): minus the device's learned risk for the group's load class (profiles.py), plus, for a
  worker with an OOM history, its affinity to the device model (towards models where it ran stably);
- ``node``: a group kept on one node (+0.5 per worker) — cross-node gradient sync is the expensive kind.

The search is greedy and deterministic: for each group (largest first), every node that can hold it is tried and
the best-scoring node wins; a group that fits on no single node is spread over the best devices anywhere.

**Pins**: a worker may name its ``device``: it is assigned there first, whatever the device's health (the caller
says the worker runs there and stays: the launcher pins every worker it does not move when some must leave a
degraded device), and no other worker gets that device. A pin is refused (the worker is unplaced, with the reason)
when the device is unknown, outside the pool, held by another job, or pinned twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dsec.model import Device, DeviceHealth
from dsec.scheduler.inventory import Inventory
from dsec.scheduler.profiles import LOAD_CLASSES, Profiles


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str = "learner"  # learner | actor | other
    memory_gb: float = 8.0
    key: str | None = None  # stable identity for history (default: group/name)
    device: str | None = None  # pinned: assigned this device first (see the module's docstring)


@dataclass(frozen=True)
class GroupSpec:
    name: str
    workers: tuple[WorkerSpec, ...]
    load_class: str = "short-episode"
    replay_share: bool = False  # its workers share a replay buffer: NVLink between them pays

    def __post_init__(self) -> None:
        if self.load_class not in LOAD_CLASSES:
            raise ValueError(f"load_class={self.load_class!r} is invalid: expected one of {', '.join(LOAD_CLASSES)}")


@dataclass(frozen=True)
class JobSpec:
    name: str
    groups: tuple[GroupSpec, ...]
    pool: str | None = None


def job_to_dict(job: JobSpec) -> dict[str, Any]:
    """The JSON form of a job (the body of ``POST /v1/placements``)."""
    return {
        "name": job.name,
        "pool": job.pool,
        "groups": [
            {"name": g.name, "load_class": g.load_class, "replay_share": g.replay_share,
             "workers": [{"name": w.name, "role": w.role, "memory_gb": w.memory_gb, "key": w.key,
                          **({"device": w.device} if w.device is not None else {})}
                         for w in g.workers]}
            for g in job.groups
        ],
    }  # fmt: skip


def job_from_dict(data: Mapping[str, Any]) -> JobSpec:
    """The job a :func:`job_to_dict` form (validated by the API's schema) describes."""
    return JobSpec(
        str(data["name"]),
        tuple(
            GroupSpec(
                str(g["name"]),
                tuple(
                    WorkerSpec(
                        str(w["name"]),
                        str(w.get("role", "learner")),
                        float(w.get("memory_gb", 8.0)),
                        w.get("key"),
                        None if w.get("device") is None else str(w["device"]),
                    )
                    for w in g["workers"]
                ),
                str(g.get("load_class", "short-episode")),
                bool(g.get("replay_share", False)),
            )
            for g in data["groups"]
        ),
        data.get("pool"),
    )


@dataclass(frozen=True)
class Weights:
    numa: float = 1.0
    nvlink: float = 1.0
    state: float = 2.0
    node: float = 0.5


@dataclass(frozen=True)
class Assignment:
    worker: str
    group: str
    role: str
    device: str
    node: str
    numa_node: int
    cpus: tuple[int, ...]
    terms: Mapping[str, float]

    @property
    def score(self) -> float:
        return round(sum(self.terms.values()), 4)

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "group": self.group,
            "role": self.role,
            "device": self.device,
            "node": self.node,
            "numa_node": self.numa_node,
            "cpus": list(self.cpus),
            "score": self.score,
            "terms": {k: round(v, 4) for k, v in self.terms.items()},
        }


@dataclass(frozen=True)
class Placement:
    job: str
    assignments: tuple[Assignment, ...]
    unplaced: Mapping[str, str] = field(default_factory=dict)  # worker -> why
    excluded: Mapping[str, str] = field(default_factory=dict)  # device -> why

    @property
    def complete(self) -> bool:
        return not self.unplaced

    @property
    def score(self) -> float:
        return round(sum(a.score for a in self.assignments), 4)

    def device_of(self, worker: str) -> str | None:
        return next((a.device for a in self.assignments if a.worker == worker), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "complete": self.complete,
            "score": self.score,
            "assignments": [a.to_dict() for a in self.assignments],
            "unplaced": dict(self.unplaced),
            "excluded": dict(sorted(self.excluded.items())),
        }


def placement_from_dict(d: Mapping[str, Any]) -> Placement:
    """The inverse of ``Placement.to_dict`` (scores are derived from the terms, so they are not read back)."""
    assignments = tuple(
        Assignment(
            worker=str(a["worker"]),
            group=str(a["group"]),
            role=str(a["role"]),
            device=str(a["device"]),
            node=str(a["node"]),
            numa_node=int(a["numa_node"]),
            cpus=tuple(int(c) for c in a["cpus"]),
            terms={str(k): float(v) for k, v in a["terms"].items()},
        )
        for a in d["assignments"]
    )
    return Placement(
        job=str(d["job"]),
        assignments=assignments,
        unplaced={str(k): str(v) for k, v in d.get("unplaced", {}).items()},
        excluded={str(k): str(v) for k, v in d.get("excluded", {}).items()},
    )


def _order(group: GroupSpec) -> list[WorkerSpec]:
    """Learners first: actors are then placed relative to them."""
    rank = {"learner": 0, "other": 1, "actor": 2}
    return sorted(group.workers, key=lambda w: (rank.get(w.role, 1), w.name))


def place(
    job: JobSpec,
    inventory: Inventory,
    profiles: Profiles | None = None,
    *,
    allowed: set[str] | None = None,
    gpu_quota: int | None = None,
    used_memory_gb: Mapping[str, float] | None = None,
    busy: set[str] | None = None,
    weights: Weights = Weights(),
    held: Mapping[str, str] | None = None,
) -> Placement:
    """Place ``job``; ``allowed`` = the pool's devices (None: all), ``busy`` = devices already running workers,
    ``held`` = devices kept free for now (device -> why; a worker pinned to one keeps it)."""
    profiles = profiles or Profiles()
    used = dict(used_memory_gb or {})
    busy = set(busy or ())
    excluded: dict[str, str] = {}
    for dev in sorted(inventory.devices.values(), key=lambda d: d.id):
        if allowed is not None and dev.id not in allowed:
            excluded[dev.id] = "not in the pool"
        elif dev.health in (DeviceHealth.DEGRADED, DeviceHealth.DRAINED):
            excluded[dev.id] = f"device is {dev.health.value}"
        elif dev.id in busy:
            excluded[dev.id] = "already runs a worker"
        elif held and dev.id in held:
            excluded[dev.id] = held[dev.id]
        elif inventory.signals.get(dev.id) is not None and inventory.signals[dev.id].alarming:
            excluded[dev.id] = "NVML reports throttling or uncorrected ECC errors"
    unplaced: dict[str, str] = {}
    pins = _pins(job, inventory, allowed, busy, unplaced)
    free = [d for d in sorted(inventory.devices) if d not in excluded and d not in pins.values()]
    if gpu_quota is not None:
        quota_left = max(0, gpu_quota - len(busy & set(allowed or inventory.devices)) - len(pins))
        for d in free[quota_left:]:
            excluded[d] = f"over the pool's gpu_quota ({gpu_quota})"
        free = free[:quota_left]
    assignments: list[Assignment] = []
    for whole in sorted(job.groups, key=lambda g: (-len(g.workers), g.name)):
        group = replace(whole, workers=tuple(w for w in whole.workers if w.name not in unplaced))
        pinned = {w.name: pins[w.name] for w in group.workers if w.name in pins}
        pinned_nodes = {inventory.devices[d].node for d in pinned.values()}
        best: list[Assignment] | None = None
        for node in sorted(inventory.nodes):
            if pinned_nodes - {node}:
                continue  # a worker pinned elsewhere: the group is not on this one node
            candidates = [d for d in free if inventory.devices[d].node == node]
            trial = _place_group(group, candidates, inventory, profiles, used, weights, True, pinned)
            if trial is not None and (best is None or _total(trial) > _total(best)):
                best = trial
        if best is None:
            best = _place_group(group, free, inventory, profiles, used, weights, False, pinned)
        if best is None:
            for w in group.workers:
                if w.name not in pinned:
                    unplaced[w.name] = (
                        f"no device left with {w.memory_gb:g} GB free among {len(free)} eligible "
                        f"(group {group.name} needs {len(group.workers) - len(pinned)})"
                    )
            # Its pinned workers keep their devices all the same (they run there; nobody else may take them).
            alone = replace(group, workers=tuple(w for w in group.workers if w.name in pinned))
            best = _place_group(alone, [], inventory, profiles, used, weights, False, pinned) or []
        for a in best:
            if a.worker in pinned:
                continue  # its device never was free
            free.remove(a.device)
            used[a.device] = used.get(a.device, 0.0) + next(w.memory_gb for w in group.workers if w.name == a.worker)
        assignments += best
    return Placement(job.name, tuple(assignments), unplaced, excluded)


def _pins(
    job: JobSpec, inventory: Inventory, allowed: set[str] | None, busy: set[str], unplaced: dict[str, str]
) -> dict[str, str]:
    """The job's honoured pins (worker -> device); a refused pin leaves its worker in ``unplaced`` with why."""
    pins: dict[str, str] = {}
    holder: dict[str, str] = {}
    for g in job.groups:
        for w in g.workers:
            d = w.device
            if d is None:
                continue
            if d not in inventory.devices:
                unplaced[w.name] = f"pinned to {d}: no such device"
            elif allowed is not None and d not in allowed:
                unplaced[w.name] = f"pinned to {d}: not in the pool"
            elif d in busy:
                unplaced[w.name] = f"pinned to {d}: a worker of another job runs there"
            elif d in holder:
                unplaced[w.name] = f"pinned to {d}, which {holder[d]} is pinned to"
            else:
                pins[w.name], holder[d] = d, w.name
    return pins


def _total(assignments: list[Assignment]) -> float:
    return sum(a.score for a in assignments)


#: An assignment's score terms, in the order they are summed.
_TERMS = ("state", "numa", "nvlink", "node", "probation")


def _place_group(
    group: GroupSpec,
    candidates: list[str],
    inventory: Inventory,
    profiles: Profiles,
    used: Mapping[str, float],
    weights: Weights,
    one_node: bool,
    pinned: Mapping[str, str],
) -> list[Assignment] | None:
    if len(candidates) < len(group.workers) - len(pinned):
        return None
    left = list(candidates)
    placed: list[Assignment] = []
    devices = inventory.devices
    # Per group, not per (worker, device): a device's learned risk for the group's load class, and per worker its
    # affinity to each device model. Placing 16 workers over hundreds of candidates asked Profiles millions of times.
    risk = {d: profiles.device_risk(d, group.load_class) for d in [*candidates, *pinned.values()]}
    counter = {"learner": "actor", "actor": "learner"}
    node_term = weights.node if one_node else 0.0
    nvlink = bool(group.replay_share)
    no_numa = weights.numa * 0.0
    # What a candidate's score reads of its device, once per group: the device, its (node, NUMA node) key (None:
    # no NUMA node, which scores 0), its model, the memory already used on it, and its probation term. The loop
    # below then scores a candidate in a few operations (placing 10,000 workers scored ~8 M candidates).
    facts: dict[str, tuple[Device, tuple[str, int] | None, str, float, float, float, float]] = {}
    for d in [*candidates, *pinned.values()]:
        dev = devices[d]
        where = (dev.node, dev.numa_node) if dev.numa_node >= 0 else None
        # On probation after a degradation: placeable (it must prove itself), but last in line.
        probation = -weights.state if dev.health is DeviceHealth.PROBATION else 0.0
        facts[d] = (dev, where, dev.model, dev.memory_gb, used.get(d, 0.0), -risk[d], probation)
    for w in _order(group):
        key = w.key or f"{group.name}/{w.name}"
        affinity: dict[str, float] = {}
        # The numa term pairs a learner with actors (and an actor with learners) on the same node and NUMA node.
        partners: dict[tuple[str, int], float] = {}
        for p in placed:
            if p.role == counter.get(w.role) and p.numa_node >= 0:
                partners[(p.node, p.numa_node)] = partners.get((p.node, p.numa_node), 0.0) + 1.0
        pin = pinned.get(w.name)
        need = w.memory_gb
        # The best candidate: the first with the highest score (terms summed in _TERMS order, as the Assignment
        # records them).
        best_score = 0.0
        best: tuple[str, tuple[float, ...]] | None = None  # (device, its terms), kept only when it leads
        for d in [pin] if pin is not None else left:
            dev, where, model, memory, in_use, neg_risk, probation = facts[d]
            if pin is None and memory and in_use + need > memory:
                continue  # (a pinned worker runs there already: its memory is in use, not asked for)
            aff = affinity.get(model)
            if aff is None:
                aff = affinity[model] = profiles.worker_model_affinity(key, model)
            state = weights.state * (neg_risk + aff)
            numa = weights.numa * partners.get(where, 0.0) if where is not None and partners else no_numa
            nvl = weights.nvlink * sum(1.0 for p in placed if inventory.nvlinked(p.device, d)) if nvlink else 0.0
            score = state + numa + nvl + node_term + probation
            if best is None or score > best_score + 1e-12:
                best_score, best = score, (d, (state, numa, nvl, node_term, probation))
        if best is None:
            return None
        d, values = best
        dev = facts[d][0]
        terms = dict(zip(_TERMS, values, strict=True))
        node = inventory.nodes.get(dev.node)
        cpus = node.cpus_for(dev.numa_node) if node else ()
        placed.append(Assignment(w.name, group.name, w.role, d, dev.node, dev.numa_node, cpus, terms))
        if pin is None:
            left.remove(d)
    return placed
