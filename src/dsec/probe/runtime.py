"""The probe: one per process. Ties the reporter, the telemetry, the actuators and the instrumentation.

Registration is triggered by training activity — ``init_process_group``, a DDP model, an optimizer, a
gymnasium environment — or at once by ``dsec.attach()``. Launcher processes that only start others
(torchrun's agent, the parent of ``mp.spawn``) do none of these and so never show up as workers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from dsec import telemetry
from dsec.probe import importhook
from dsec.probe.actuators import Actuators
from dsec.probe.chaos import Chaos, ChaosError
from dsec.probe.config import ProbeConfig
from dsec.probe.device_memory import CudaMemory
from dsec.probe.fake_card import FakeCard, FakeCardError
from dsec.probe.healing import Healing
from dsec.probe.memory import MemoryTrend, memory_metrics
from dsec.probe.recycle import ClimbWatch, MemoryRecycle
from dsec.probe.replicas import ReplicaGuard
from dsec.probe.reporter import Reporter
from dsec.probe.roles import AUTO, RoleInference
from dsec.probe.snapshots import ProbeSnapshots
from dsec.probe.telemetry import Telemetry

log = logging.getLogger(__name__)


class Probe:
    def __init__(self, config: ProbeConfig) -> None:
        self.config = config
        self.telemetry = Telemetry(on_anomaly=self._anomaly)
        # Seams: what memory the process holds, and the window its growth is estimated over.
        self.memory_source: Callable[[], dict[str, float]] = memory_metrics
        self.memory_trend = MemoryTrend()
        self._reporter: Reporter | None = None
        self.actuators = Actuators(
            default_bits=config.default_compression_bits, ack=self._ack, unappliable=self._unappliable
        )
        self._lock = threading.Lock()
        self._rank: int | None = config.rank
        self.torch: Any = None
        self.gym: Any = None
        self._last_anomaly: dict[str, float] = {}
        self._pending_events: list[tuple[str, dict[str, Any]]] = []
        self.activities: set[str] = set()
        self.chaos: Chaos | None = None
        self.replicas = ReplicaGuard(self, check_every=config.drift_check_steps)
        self.snapshots: ProbeSnapshots | None = ProbeSnapshots.from_env(self)
        self.healing: Healing | None = Healing.from_env(self)
        self.roles: RoleInference | None = (
            RoleInference(config.role_actor_env_steps, config.reporter.role) if config.infer_role else None
        )
        try:
            self.chaos = Chaos.from_env(os.environ.get("DSEC_CHAOS"), rank=lambda: self._rank)
        except ChaosError as exc:
            log.error("dsec: fault injection disabled: %s", exc)
        # The stand-in for a shared card's memory (dsec.probe.fake_card), where no GPU is: allocations at optimizer
        # steps, OOMs in this process, the memory figure reported is what it holds on that card.
        self.fake_card: FakeCard | None = None
        try:
            self.fake_card = FakeCard.from_env(os.environ.get("DSEC_FAKE_CARD"))
        except FakeCardError as exc:
            log.error("dsec: fake card disabled: %s", exc)
        self.climb = ClimbWatch(horizon_s=_env_float("DSEC_MEMORY_RECYCLE_HORIZON_S", 2.0))
        self._recycle: tuple[float, float | None, float | None] | None = None  # due: (held, limit, slope)
        self._recycle_failed = False
        # The CUDA device the training code uses, once it initialised CUDA (read for the drain and the burst snapshot;
        # dsec.probe.device_memory). Not with a fake card: the card stands in for it.
        self.cuda_memory: CudaMemory | None = None
        self._cuda_failed = False
        if self.fake_card is not None:
            card = self.fake_card
            self.memory_source = lambda: {telemetry.MEMORY_USED_GB.name: card.held_gb}
            if self.chaos is not None:
                self.chaos.touch_pages = False  # memory growth is the card's (device memory), not host pages

    # -- instrumentation ------------------------------------------------------------------------------
    def install(self) -> None:
        if self.config.instrument_torch:
            importhook.when_imported("torch", self._install_torch)
        if self.config.instrument_gym:
            importhook.when_imported("gymnasium", self._install_gym)

    def _install_torch(self, module: Any) -> None:
        from dsec.probe.torch_hooks import TorchInstrumentation

        inst = TorchInstrumentation(self)
        inst.install(module)
        self.torch = inst

    def _install_gym(self, module: Any) -> None:
        from dsec.probe.gym_hooks import GymInstrumentation

        inst = GymInstrumentation(self)
        inst.install(module)
        self.gym = inst

    def uninstall(self) -> None:
        for inst in (self.torch, self.gym):
            if inst is not None:
                inst.uninstall()

    # -- registration -----------------------------------------------------------------------------------
    @property
    def reporter(self) -> Reporter | None:
        return self._reporter

    def activity(self, what: str) -> None:
        """Training activity seen: register now (once), and start the fault-injection clock."""
        self.activities.add(what)
        if self.chaos is not None:
            self.chaos.arm()
        if self._reporter is None:
            self.start()

    def on_distributed(self, rank: int, world_size: int) -> None:
        self._rank = rank
        self.activity("distributed")

    _REPORTER_FIELDS = ("role", "group", "heartbeat_interval_s", "device", "token")

    def reconfigure(self, **overrides: Any) -> None:
        """Apply ``attach()`` keyword settings before registration; afterwards they are ignored (logged)."""
        changes = {k: v for k, v in overrides.items() if k in self._REPORTER_FIELDS and v is not None}
        rank = overrides.get("rank")
        if not changes and rank is None:
            return
        with self._lock:
            if self._reporter is not None:
                log.info("dsec: already registered; attach() settings %s ignored", sorted(changes))
                return
            if rank is not None:
                self._rank = int(rank)
            role = changes.get("role")
            if role == AUTO:
                changes["role"] = "other"
                if self.roles is None:
                    self.roles = RoleInference(self.config.role_actor_env_steps)
            elif role is not None:
                self.roles = None  # an explicit role is kept
            self.config = replace(
                self.config, reporter=replace(self.config.reporter, **changes), infer_role=self.roles is not None
            )

    def start(self) -> Reporter:
        with self._lock:
            if self._reporter is not None:
                return self._reporter
            rank = self._rank if self._rank is not None else _env_rank()
            cfg = replace(self.config.reporter, rank=rank)
            rep = Reporter(cfg, on_directive=self.actuators.handle)
            rep.add_collector(self._collect)
            for kind, data in self._pending_events:
                rep.event(kind, **data)
            self._pending_events.clear()
            self._reporter = rep.start()
            return rep

    def _ack(self, version: int) -> None:
        if self._reporter is not None:
            self._reporter.ack(version)
            self._reporter.beat_now()  # let the control plane know promptly

    def _unappliable(self, version: int, name: str, requested: Any, reason: str) -> None:
        """A directive field this process cannot carry out: answered at once, the version never acked."""
        log.warning("dsec: directive v%d: %s=%r cannot be applied here: %s", version, name, requested, reason)
        self.event(
            "directive_unappliable", urgent=True, field=name, version=version, requested=requested, reason=reason
        )

    def device_memory_step(self) -> None:
        """Before an optimizer step of the training code: with a fake card, hold what this step needs on it (its
        base plus the memory growth injected so far) under the allocator limit in force; the card's out-of-memory
        error is reported (urgent ``log`` event) and raised into the training code, as CUDA's would be. Then watch
        the climb toward that limit (dsec.probe.recycle) — on the fake card, or on the CUDA device the training code
        uses (dsec.probe.device_memory: the allocator's reserved memory against its cap and the card's free memory)."""
        card = self.fake_card
        if card is not None:
            want = card.spec.base_gb + (self.chaos.ballast_mb / 1024.0 if self.chaos is not None else 0.0)
            limit = self.actuators.allocator_limit_gb()
            try:
                card.hold(want, limit)
            except RuntimeError as exc:
                self.event("log", urgent=True, oom=str(exc), want_gb=round(want, 3), held_gb=round(card.held_gb, 3),
                           limit_gb=limit, step=self._steps())  # fmt: skip
                raise
            cap = limit if card.spec.obey_limits else None  # an allocator nobody caps has no limit to drain before
            self._watch_memory(card.held_gb, card.room_gb(), cap)
            return
        if self._cuda_failed:
            return
        try:
            # The training code's CUDA device, from the step it initialised CUDA on (kept; never initialised here).
            self.cuda_memory = cuda = self.cuda_memory or CudaMemory.of_training()
            if cuda is None:
                return
            held, room = cuda.read()
        except Exception:  # a broken CUDA install or read must not fail the training step: the watch is off then
            log.warning("dsec: cannot read CUDA memory; no drain or burst snapshot from now on", exc_info=True)
            self.cuda_memory, self._cuda_failed = None, True
            return
        # The allocator is capped only where the probe applied the quota (actuators._apply_memory_quota).
        cap = self.actuators.allocator_limit_gb() if self.actuators.memory_fraction_applied is not None else None
        self._watch_memory(held, room, cap)

    def _watch_memory(self, held: float, room: float, cap: float | None) -> None:
        """One reading for the drain before the cap and the snapshot ahead of a burst (dsec.probe.recycle): ``held``
        GB held, ``room`` GB it could hold beside its card-mates, ``cap`` its allocator cap (None: uncapped)."""
        self.climb.observe(time.monotonic(), held)
        if not self._recycle_failed and self.climb.due(cap, self.actuators.memory_ceiling_gb):
            self._recycle = (held, cap, self.climb.slope_gb_per_s())
        # A burst fails at whichever comes first: its allocator limit or the card's free memory.
        elif (
            self.snapshots is not None
            and self.snapshots.snapshotter is not None
            and self.climb.burst_due(bound := min(room, math.inf if cap is None else cap))
        ):
            slope = self.climb.burst_slope_gb_per_s()
            self.snapshots.request("memory_burst")
            message = (f"a burst rising {slope or 0.0:.3f} GB/s toward {bound:.2f} GB (its allocator limit "
                       f"{cap} GB, the card's room {room:.2f} GB; {held:.2f} GB held): a snapshot "
                       "at this step")  # fmt: skip
            self.event("log", memory_burst_snapshot=message, held_gb=round(held, 3), limit_gb=cap,
                       room_gb=round(room, 3), slope_gb_per_s=slope, step=self._steps())  # fmt: skip

    def _steps(self) -> int | None:
        """Optimizer steps this process's state has taken (a restore sets it to the snapshot's step); None: no
        snapshots."""
        return self.snapshots.steps if self.snapshots is not None else None

    def after_optimizer_step(self) -> None:
        """After an optimizer step of the training code: when the climb is due to be recycled, write a snapshot of
        the state now and stop the process (:class:`MemoryRecycle`); the supervisor restarts it from that snapshot.
        Without a snapshot to restart from, the process runs on (and meets its limit as before)."""
        if self._recycle is None:
            return
        held, limit, slope = self._recycle
        self._recycle = None
        seq = self.snapshots.take_final("memory_recycle") if self.snapshots is not None else None
        if seq is None:
            self._recycle_failed = True
            log.warning("dsec: memory climbs into its limit (%.2f of %s GB) but no snapshot could be written; "
                        "running on", held, limit)  # fmt: skip
            return
        message = (f"memory recycle: {held:.2f} GB held, climbing {slope or 0.0:.3f} GB/s into its final allocator "
                   f"limit {limit} GB; snapshot {seq} written, the process stops to be restarted from it")  # fmt: skip
        self.event("log", urgent=True, memory_recycle=message, held_gb=round(held, 3), limit_gb=limit,
                   slope_gb_per_s=slope, snapshot=seq)  # fmt: skip
        raise MemoryRecycle(message)

    def _collect(self) -> dict[str, float]:
        if self.chaos is not None:
            self.chaos.poll(lambda data: self.event("log", urgent=True, **data))
        rep = self._reporter
        if rep is not None and rep.latency_cap_ms is not None:
            self.telemetry.latency_cap_s = rep.latency_cap_ms / 1000.0
        if self.roles is not None and rep is not None:
            self._infer_role(rep)
        out = self.telemetry.collect()
        out.update(self.actuators.state())
        out.update(self.replicas.metrics())
        memory = self.memory_source()
        out.update(memory)
        used = memory.get(telemetry.MEMORY_USED_GB.name)
        growth = None if used is None else self.memory_trend.add(used)
        if growth is not None:
            out[telemetry.MEMORY_GROWTH_GB_PER_H.name] = growth
        return out

    def _infer_role(self, rep: Reporter) -> None:
        """Once per beat, before the beat is taken: the counters so far may make the role clear (dsec.probe.roles);
        the beat then carries it (``inferred_role``) and the control plane records the change."""
        assert self.roles is not None
        t = self.telemetry
        inferred = self.roles.observe(
            env_steps=t.env_steps_total,
            updates=t.updates_total,
            gradient_syncs=t.sync_ops_total,
            has_optimizer="optimizer" in self.activities,
        )
        if inferred is not None:
            log.info("dsec: role inferred: %s (%s)", inferred.role, inferred.evidence.get("rule"))
            rep.set_role(inferred.role, inferred.evidence)

    @property
    def role(self) -> str:
        """The worker's role now: the configured one, or the one inferred so far (``other`` until then)."""
        return self.roles.role if self.roles is not None else self.config.reporter.role

    # -- events -------------------------------------------------------------------------------------------
    def event(self, kind: str, /, urgent: bool = False, **data: Any) -> None:
        rep = self._reporter
        if rep is None:
            self._pending_events.append((kind, data))
        else:
            rep.event(kind, urgent=urgent, **data)

    def _anomaly(self, kind: str, data: dict[str, Any]) -> None:
        # At most one immediate report per kind per heartbeat interval: a storm is one signal.
        now = time.monotonic()
        if now - self._last_anomaly.get(kind, -1e9) < self.config.reporter.heartbeat_interval_s:
            return
        self._last_anomaly[kind] = now
        self.event("anomaly", urgent=True, **{**data, "kind": kind})  # a field named kind in data must not crash it

    def interrupt_reason(self, observed: str | None) -> str | None:
        """Why the episode that just ended counts as interrupted (an info key, or injected), or None."""
        if observed is None and self.chaos is not None:
            return self.chaos.interrupt_reason()
        return observed

    def after_episode(self, reason: str | None = None) -> None:
        # N consecutive interrupted episodes are reported at once, then 2N, 4N, ... (a stuck agent
        # keeps being reported, but a fast one does not flood); the control plane decides what to do.
        n = self.telemetry.consecutive_interrupted
        k, rest = divmod(n, self.config.stuck_episode_threshold)
        if reason is not None and n and rest == 0 and k & (k - 1) == 0:
            self.event("anomaly", urgent=True, kind="episode_stuck", reason=reason, count=n)

    # -- actuator helpers for user code -------------------------------------------------------------------
    def wait_for_sampling(self) -> None:
        # The flag first: it is one attribute read on every environment step, the role a property chain.
        if not self.actuators.sampling_allowed() and self.role == "actor":
            while not self.actuators.wait_for_sampling(timeout=1.0):
                pass

    @contextlib.contextmanager
    def internal_collectives(self) -> Iterator[None]:
        """Collectives DSec makes itself on the script's process group (see Healing.internal)."""
        if self.healing is None:
            yield
            return
        with self.healing.internal():
            yield

    def autocast(self, device_type: str = "cpu") -> AbstractContextManager[None]:
        return self.actuators.autocast(device_type)

    @property
    def rank(self) -> int:
        return self._rank if self._rank is not None else _env_rank()

    def close(self, reason: str = "exit", dying: bool = False) -> None:
        """Flush and deregister with ``reason``. A member terminated by SIGTERM does not leave its healing group as if
        it had finished (it did not), nor does one whose script ended with an uncaught exception (``error``: its
        exit is a failure, reported by the supervisor); ``dying`` (the signal's default action follows): gloo's
        threads need no settling before an interpreter shutdown that will not happen."""
        if self.healing is not None and reason != "sigterm":
            try:
                self.healing.close(leave=reason != "error")
            except Exception:
                log.exception("dsec: leaving the healing group failed")
        if self.snapshots is not None:
            try:
                self.snapshots.close()  # publishes the snapshot in flight; its event goes with the last beat
            except Exception:
                log.exception("dsec: closing the snapshotter failed")
        if self._reporter is not None:
            self._reporter.close(reason)
        if "distributed" in self.activities and not dying:
            from dsec.probe.settle import let_threads_settle

            let_threads_settle()

    # The reporter's metric API, for code that reports extra numbers through the probe.
    def observe(self, name: str, value: float) -> None:
        if self._reporter is not None:
            self._reporter.observe(name, value)

    def gauge(self, name: str, value: float) -> None:
        if self._reporter is not None:
            self._reporter.gauge(name, value)

    def inc(self, name: str, n: float = 1.0) -> None:
        if self._reporter is not None:
            self._reporter.inc(name, n)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # 'nan' / 'inf' parse, and would turn a horizon off or make every climb due
        log.error("dsec: %s=%r is not a finite number; %g applies", name, raw, default)
        return default
    return value


def _env_rank() -> int:
    raw = os.environ.get("RANK", "0")
    return int(raw) if raw.isdigit() else 0
