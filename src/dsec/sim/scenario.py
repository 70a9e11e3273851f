"""Scenario files for ``dsec simulate``: the cluster, its hidden truth, the workload, the network, the faults and
the two regimes' parameters. Every field has a default; docs/simulator.md gives each one's provenance (measured on
this project's machine, published, or assumed). Errors name file, line and column (yamlconf.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dsec.decide.pause import SAMPLING_PROGRESS, curve_points
from dsec.yamlconf import ConfigError, load_file


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GpuTruth(_Strict):
    """What a GPU really does, hidden from DSec: it has to learn it from what happens to the workers on it."""

    leak_gb_per_h: float = Field(0.0, ge=0)  # memory that the card's workers lose and never get back
    throttle_per_h: float = Field(0.02, ge=0)  # thermal-throttling episodes per hour
    crash_per_h: float = Field(0.002, ge=0)  # process crashes per hour per worker on the card (XID, driver)


class Cluster(_Strict):
    nodes: int = Field(4, ge=1, le=10_000)
    gpus_per_node: int = Field(8, ge=1, le=64)
    gpu_memory_gb: float = Field(80.0, gt=0)
    gpu_model: str = "A100-80GB"
    numa_per_node: int = Field(2, ge=1, le=16)
    nvlink: Literal["none", "pairs", "all"] = "pairs"
    workers_per_gpu: int = Field(4, ge=1, le=64)  # workers sharing one card (slots)
    bad_gpu_fraction: float = Field(0.1, ge=0, le=1)  # cards with the `bad` truth (chosen by the seed)
    healthy: GpuTruth = GpuTruth()
    bad: GpuTruth = GpuTruth(leak_gb_per_h=3.0, throttle_per_h=0.5, crash_per_h=0.02)
    throttle_duration_s: float = Field(900.0, gt=0)
    throttle_slowdown: float = Field(2.0, ge=1)  # compute time multiplier while throttled


class Memory(_Strict):
    base_gb: float = Field(14.0, gt=0)  # steady usage of one worker
    burst_per_h: float = Field(1.0, ge=0)  # sparse-reward bursts (long episodes, big rollouts) per worker-hour
    burst_gb: float = Field(6.0, ge=0)  # mean extra memory of a burst (exponentially distributed)
    burst_s: float = Field(120.0, gt=0)  # how long a burst holds
    burst_ramp_s: float = Field(30.0, ge=0)  # how long it takes to build up
    # A burst's size under gradient accumulation. 1.0: the probe's zero-touch accumulation keeps the training code's
    # micro-batch, so a burst is as large (until 2026-12-06 0.5, an assumption for code that shrinks it).
    accumulation_burst_factor: float = Field(1.0, ge=0, le=1)


class Groups(_Strict):
    count: int = Field(8, ge=1, le=100_000)
    learners: int = Field(1, ge=1)
    actors: int = Field(15, ge=0)
    step_s: float = Field(0.6, gt=0)  # compute time of one optimizer step on a healthy card
    gradient_mb: float = Field(40.0, gt=0)  # bytes each worker synchronizes per step, uncompressed
    episode_length: float = Field(400.0, gt=0)  # mean episode length (steps): decides the load class
    memory: Memory = Memory()

    @property
    def size(self) -> int:
        return self.learners + self.actors


class Jitter(_Strict):
    fraction: float = Field(0.1, ge=0, le=1)  # workers whose link has jitter episodes
    episodes_per_h: float = Field(2.0, ge=0)
    episode_s: float = Field(300.0, gt=0)
    extra_ms: float = Field(150.0, ge=0)  # mean extra sync latency during an episode (exponential per sync)


class Network(_Strict):
    link_mb_per_s: float = Field(1000.0, gt=0)  # per-worker gradient bandwidth
    base_latency_ms: float = Field(10.0, ge=0)
    noise_sigma: float = Field(0.2, ge=0)  # lognormal noise on every sync
    jitter: Jitter = Jitter()


class PowerSaving(_Strict):
    start_h: float = Field(1.0, ge=0, lt=24)  # local time of day the window opens
    duration_h: float = Field(4.0, ge=0, le=24)
    fraction: float = Field(0.25, ge=0, le=1)  # GPUs switched off


class Faults(_Strict):
    power_saving: PowerSaving | None = PowerSaving()


class TunedBaseline(_Strict):
    """What a competent team runs without DSec (issue 17): each choice below is standard practice, not DSec's."""

    # None: Young/Daly, sqrt(2 x blocking x MTBF), with the MTBF the naive baseline measured on the same trace (a team
    # tunes its checkpoint interval from its own failure history).
    checkpoint_interval_s: float | None = Field(None, gt=0)
    checkpoint_blocking_s: float = Field(0.5, ge=0)  # async distributed checkpoint: only the device->host copy blocks
    restart_in_place_s: float = Field(30.0, ge=0)  # torchrun restarts the process group on the same nodes
    restart_reschedule_s: float = Field(90.0, ge=0)  # a worker's card is gone (off, cordoned): the pod moves
    drain_before_power_off: bool = True  # planned power-off: SIGTERM, checkpoint, then stop (no work lost)
    cordon_after_failures: int = Field(3, ge=1)  # a card on which this many workers crashed gets no new ones
    per_process_oom: bool = True  # a CUDA OOM raises in the allocating process only (the largest user fails)
    # A failed actor is recreated alone (RLlib's restart_failed_env_runners, IMPALA-style actor pools), in place
    # (restart_in_place_s) unless its card is gone or cordoned (restart_reschedule_s); the learner trains on.
    actor_fault_tolerance: bool = True


class Baseline(_Strict):
    """Common practice: Kubernetes + DDP/torchrun semantics (``naive``), and its ``tuned`` variant."""

    checkpoint_interval_s: float = Field(600.0, gt=0)
    checkpoint_blocking_s: float = Field(2.0, ge=0)
    restart_s: float = Field(90.0, ge=0)  # pod rescheduled, container + process group up, checkpoint loaded
    straggler_timeout_ms: float = Field(500.0, gt=0)  # the learner waits this long past the median, then drops
    tuned: TunedBaseline = TunedBaseline()


class Dsec(_Strict):
    snapshot_interval_s: float = Field(90.0, gt=0)
    snapshot_cost_s: float = Field(0.25, ge=0)  # training time a snapshot costs (blocking + background work)
    restart_s: float = Field(3.2, ge=0)  # detect + stop + restart a group on warm standbys + restore
    # A group whose worker must move (its card degraded or off): the replacement starts elsewhere, rendezvous and
    # restore over the network; a migration also pays the snapshot taken before the move (snapshot_cost_s).
    restart_reschedule_s: float = Field(20.0, ge=0)
    latency_cap_ms: float = Field(85.0, gt=0)
    bandwidth_cap_mbps: float = Field(128.0, gt=0)
    memory_base_gb: float | None = Field(None, gt=0)  # the pool's guaranteed quota; default: steady usage + 15%
    memory_ceiling_gb: float | None = Field(None, gt=0)  # default: an equal share of a card
    # The breaker's memory cap as a fraction of the ceiling; None is DSec as shipped (no memory path: its
    # accumulation frees no memory under the probe, dsec.decide.caps_for). 1.0 was the default until 2026-12-06 (it
    # met bursts the limit lets past the ceiling); below 1 it acts (accumulation) before the allocation fails.
    memory_pressure_fraction: float | None = Field(None, gt=0, le=1)
    breaker_window_samples: int = Field(3, ge=1)  # samples in the breaker's window (window = samples x interval)
    breaker_recovery_s: float = Field(30.0, gt=0)  # DSec default (BreakerConfig.recovery_s)
    policies: list[str] | None = None  # policy files (relative to the scenario); None: the shipped examples
    placement: bool = True  # history-aware placement (else first-fit, as the baseline)
    breaker: bool = True
    quotas: bool = True
    # Quotas as grants with limits (dsec.quota.elastic "Grant and limit", growth by ramp, idle reclaim); False: the
    # first design — the allocator capped at the grant, grown one step per plan — kept to measure against.
    quota_limits: bool = True
    # The probe's drain before the cap (dsec.probe.recycle): a slow climb into a limit at the ceiling is snapshotted
    # at its last step and restarted from there instead of failing of OOM (nothing rolls back). False: as before
    # 2026-12-06, such a worker fails at the cap.
    memory_drain: bool = True
    # The probe's snapshot ahead of a burst's OOM (dsec.probe.recycle, dsec.quota.trend.burst_at_risk): a learner whose
    # memory rises at a burst's rate and, at that rate, passes its allocator limit or its card's room before the next
    # sample snapshots its group now (snapshot_cost_s), once per burst and bound; if the burst then fails, the restart
    # loses ~nothing. False: as before 2026-12-06 (the OOM rolls the group back to its last periodic snapshot).
    burst_snapshots: bool = True
    device_health: bool = True
    # A design study, not what the control plane does yet (dsec.quota.relief): accumulation for the steepest-ramping
    # worker of a card whose projected usage overflows it, until its burst is over.
    memory_relief: bool = False
    # Room for a burst (dsec.quota.room, the control plane's JudgeConfig.make_room, on as shipped): an actor moves
    # alone off a card that holds a learner and that a burst is about to fill, before anyone's allocation fails; the
    # card takes no new worker for the burst's hold. False: as before 2026-12-07.
    make_room: bool = True
    # Which cards get room: ``learners`` — a card holding a worker whose failure restarts its group (the rule's
    # ``restarts_group``: a learner); ``all`` — every card (an actor's OOM costs about what its move does: measured,
    # docs/benchmarks.md "Room for a burst").
    make_room_for: Literal["learners", "all"] = "learners"
    # Per-worker restarts of actors (restart_scope: worker, the launcher's default for actor groups): a failed actor
    # restarts alone (restart_s on a warm standby, restart_reschedule_s when placement moves it), nothing rolls back.
    # False: every failure restarts the group from its snapshot (the simulator before 2026-12-03).
    restart_actors_alone: bool = True
    # The ladder's top rung (an actor's sampling paused) only where it pays (dsec.decide.pause: the wait it ends
    # against what the actor's samples are worth). False: every actor may reach it (before 2026-12-07).
    pause_when_it_pays: bool = True
    # The job file's ``snapshots.cadence`` (dsec.decide.cadence; the launcher passes each group's history to its
    # learners): ``failure_history`` (the default, in job files too) — each group's interval is Young's
    # sqrt(2 x snapshot_cost_s x MTBF) over the restarts that rolled it back, snapshot_interval_s the prior (30 s to
    # 30 min); ``fixed``: every snapshot_interval_s (the default until 2026-12-04).
    snapshot_cadence: Literal["fixed", "failure_history"] = "failure_history"
    # Whose history the estimate starts from: ``job`` — the other groups' (the launcher's history file), then the
    # group's own; ``group`` — the group's own only, the configured interval as the prior (before 2026-12-04).
    snapshot_history: Literal["job", "group"] = "job"


class Efficiency(_Strict):
    """Statistical efficiency of a step's contribution (1 = as good as an uncompressed, fresh gradient)."""

    # Measured (benchmarks/calibrate_efficiency.py, docs/benchmarks.md "Efficiency discounts from real runs"): PPO
    # CartPole under the probe, 10 seeds, env steps to return 475 vs uncompressed. 4-bit with error feedback: 0.97,
    # 90% interval 0.81-1.22, not told apart from 1, so the assumed 0.97 stays (it happens to equal the median).
    compressed_4bit: float = Field(0.97, ge=0, le=1)
    # Accumulation x4: 0.48 per sample (90% interval 0.33-0.63; 9 of 10 seeds slower, sign test p = 0.02); was an
    # assumed 0.90. A worker's gradient applied every 4th step, the optimizer stepping 4x less often at the same lr.
    accumulated: float = Field(0.48, ge=0, le=1)
    # A group's progress while some of its actors sample nothing (sampling paused, or the process restarting alone),
    # as points (share of the group's actors sampling, share of the progress left), joined linearly with (0, 0) and
    # (1, 1). Measured (benchmarks/calibrate_paused.py, docs/benchmarks.md "What a paused actor costs"): an
    # actor-learner PPO CartPole with 4 paced actors, 10 seeds, seconds to return 475 — 1 of 4 paused: 0.739 (90%
    # interval 0.69-0.79), 2 of 4: 0.432 (0.39-0.48); less than the share of samples left, since the remaining
    # actors' samples also taught less per sample there. None: the model before (a worker that samples nothing
    # counts 0 in the mean of the group's contributions, as a dropped gradient does).
    sampling_progress: list[tuple[float, float]] | None = list(SAMPLING_PROGRESS)  # the product's, as measured

    @model_validator(mode="after")
    def _curve(self) -> Efficiency:
        pts = self.sampling_progress or []
        shares = [x for x, _ in pts]
        progress = [y for _, y in pts]
        if any(not 0.0 < x < 1.0 for x in shares) or shares != sorted(set(shares)):
            raise ValueError("sampling_progress: shares must be increasing, each between 0 and 1 (both excluded)")
        if any(not 0.0 <= y <= 1.0 for y in progress) or progress != sorted(progress):
            raise ValueError("sampling_progress: progress must be non-decreasing, each between 0 and 1")
        return self

    def sampling_curve(self) -> tuple[list[float], list[float]] | None:
        """The curve's x and y points for ``numpy.interp``, ends included; None for the model before."""
        return None if self.sampling_progress is None else curve_points(self.sampling_progress)


class Scenario(_Strict):
    name: str = "scenario"
    description: str = ""
    seed: int = 7
    duration_h: float = Field(24.0, gt=0, le=24 * 30)
    sample_interval_s: float = Field(5.0, gt=0, le=300)  # telemetry + decisions
    policy_interval_s: float = Field(15.0, gt=0)
    cluster: Cluster = Cluster()
    groups: Groups = Groups()
    network: Network = Network()
    faults: Faults = Faults()
    baseline: Baseline = Baseline()
    dsec: Dsec = Dsec()
    efficiency: Efficiency = Efficiency()
    source: str | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _fits(self) -> Scenario:
        slots = self.cluster.nodes * self.cluster.gpus_per_node * self.cluster.workers_per_gpu
        workers = self.groups.count * self.groups.size
        if workers > slots:
            raise ValueError(
                f"groups need {workers} worker slots but the cluster has {slots} "
                f"(nodes x gpus_per_node x workers_per_gpu)"
            )
        if self.groups.size > slots:
            raise ValueError("a group is larger than the cluster")
        return self

    @property
    def workers(self) -> int:
        return self.groups.count * self.groups.size

    @property
    def gpus(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    def quota_base_gb(self) -> float:
        return self.dsec.memory_base_gb or round(self.groups.memory.base_gb * 1.15, 2)

    def ceiling_gb(self) -> float:
        share = self.cluster.gpu_memory_gb / self.cluster.workers_per_gpu
        return self.dsec.memory_ceiling_gb or max(share, self.quota_base_gb())


def with_overrides(sc: Scenario, settings: list[str]) -> Scenario:
    """``sc`` with ``section.field=value`` settings applied (values parsed as YAML), validated like the file."""
    data = sc.model_dump(exclude={"source"})
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError([f"--set {item!r}: expected PATH=VALUE, e.g. dsec.latency_cap_ms=50"])
        node: dict[str, Any] = data
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                raise ConfigError([f"--set {item!r}: {key} is not a scenario field"])
            node = child
        if leaf not in node:
            raise ConfigError([f"--set {item!r}: {key} is not a scenario field"])
        node[leaf] = yaml.safe_load(raw)
    try:
        out = Scenario.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([f"--set: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]) from None
    return out.model_copy(update={"source": sc.source})


def load_scenario(path: str | Path) -> Scenario:
    """The scenario in ``path``; ``ConfigError`` with ``file:line:col: field: message`` per problem."""
    sc = load_file(Scenario, path)
    return sc.model_copy(update={"source": str(path)})
