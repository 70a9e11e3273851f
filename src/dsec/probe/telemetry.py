"""What the probe's hooks observe, aggregated in-process into per-interval summaries and health features.

Hooks call the ``record_*`` methods (cheap: a lock and a few additions); the reporter thread calls
``collect()`` once per beat. Counters named ``*_total`` are cumulative; everything else describes the
interval since the previous ``collect()``.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from dsec.health.indicators import Percentiles, RollingCV, TrendSlope, VarianceShift

AnomalyHandler = Callable[[str, dict[str, Any]], None]

# A sync slower than this many times the recent median is a sharp anomaly, reported at once.
SPIKE_FACTOR = 10.0
SPIKE_MIN_S = 0.2


class EnvStepCounter:
    """Steps of one environment, counted by its monitor (see Telemetry.env_step_counter)."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps = 0


class Telemetry:
    def __init__(self, clock: Callable[[], float] = time.monotonic, on_anomaly: AnomalyHandler | None = None) -> None:
        self._clock = clock
        self._on_anomaly = on_anomaly
        self._lock = threading.Lock()
        self._interval_start = clock()
        # gradient sync (DDP buckets through the comm hook) and explicit collectives
        self.sync_ops_total = 0
        self.sync_ok_total = 0
        self.sync_errors_total = 0
        self.sync_slow_total = 0
        # Syncs slower than this do not count as successful (None: only errors fail). Set from the
        # control plane's latency cap for this worker.
        self.latency_cap_s: float | None = None
        self.sync_bytes_total = 0
        self._sync_bytes = 0
        self._sync_count = 0
        self._sync_lat = Percentiles()
        self._sync_recent = Percentiles(max_samples=64)  # for the spike detector's median
        self._sync_median_s: float | None = None
        self._sync_lag = Percentiles()
        self._sync_cost = Percentiles()
        self.collective_ops_total = 0
        self.collective_bytes_total = 0
        self._collective_lat = Percentiles()
        # optimizer
        self.updates_total = 0
        self.skipped_updates_total = 0
        self._step_s_sum = 0.0
        self._step_count = 0
        # Compute time between optimizer steps (compute_ms_*): the wall time from one step to the next minus the
        # time this rank was blocked on its synchronized steps' last gradient bucket — what the device and the
        # process did (forward, backward, optimizer, data and env work), without waiting for peers or the network.
        # Device health judges cards by its median (a slow link or a late peer is not the card's fault; the median
        # leaves out the one interval per update that holds an RL learner's rollout).
        self._compute = Percentiles()
        self._last_update_at: float | None = None
        self._wait_s = 0.0  # blocked on last buckets since the last optimizer step
        self._waits = 0
        self._syncs_at_update = 0  # sync_ops_total at the last optimizer step
        self._grad_norm_last: float | None = None
        self._grad_norm_slope = TrendSlope(window=50)
        # environment
        self._env_steps = 0  # recorded through record_env_steps
        # Counters that vector-env monitors keep themselves (EnvStepCounter): added up when read; a counter whose
        # monitor is gone is folded into _env_steps (the total never goes back).
        self._env_counters: set[EnvStepCounter] = set()
        self._env_gone: list[EnvStepCounter] = []  # counters whose monitor went, folded in by the next reader
        self.episodes_total = 0
        self.terminated_total = 0
        self.truncated_total = 0
        self.interrupted_total = 0
        self.consecutive_interrupted = 0
        self._returns: list[float] = []
        self._lengths: list[int] = []
        self._length_cv = RollingCV(window=50)
        self._return_shift = VarianceShift(recent=20, reference=60)
        # actuator state, reported so the control plane can see what is in force
        self.effective: dict[str, float] = {}

    # -- recording (hot paths) --------------------------------------------------------------------
    def record_sync(self, nbytes: int, latency_s: float, ok: bool, last: bool = False) -> None:
        """One gradient sync. ``last``: it was the last bucket of a synchronized step, whose latency the training
        thread waits out (the earlier buckets overlap the backward pass)."""
        spike = False
        with self._lock:
            if last:
                self._wait_s += latency_s
                self._waits += 1
            self.sync_ops_total += 1
            cap = self.latency_cap_s
            if not ok:
                self.sync_errors_total += 1
            elif cap is not None and latency_s > cap:
                self.sync_slow_total += 1
            else:
                self.sync_ok_total += 1
            self.sync_bytes_total += nbytes
            self._sync_bytes += nbytes
            self._sync_count += 1
            self._sync_lat.add(latency_s)
            median = self._sync_median_s
            if median is not None and latency_s > max(SPIKE_MIN_S, SPIKE_FACTOR * median):
                spike = True
            self._sync_recent.add(latency_s)
            if len(self._sync_recent) >= 64:
                self._sync_median_s = self._sync_recent.take()["p50"]
        if not ok:
            self._anomaly("sync_error", {"bytes": nbytes})
        elif spike:
            self._anomaly(
                "sync_latency_spike",
                {"latency_ms": round(latency_s * 1000, 3), "median_ms": round((median or 0) * 1000, 3)},
            )

    def record_arrival(self, lag_s: float, cost_s: float) -> None:
        """Per synchronized step: how late this rank arrived vs its earliest peer, and the time the
        group lost because of this rank (see ddp.py)."""
        with self._lock:
            self._sync_lag.add(lag_s)
            self._sync_cost.add(cost_s)

    def record_collective(self, kind: str, nbytes: int, latency_s: float, ok: bool) -> None:
        with self._lock:
            self.collective_ops_total += 1
            self.collective_bytes_total += nbytes
            self._collective_lat.add(latency_s)
        if not ok:
            self._anomaly("collective_error", {"op": kind})

    def record_update(
        self, step_s: float, grad_norm: float | None, now: float | None = None, micro_steps: int = 1
    ) -> None:
        """An optimizer step that took ``step_s``, ended at ``now`` (time.perf_counter(); default: now), after
        ``micro_steps`` backward passes (gradient accumulation)."""
        at = time.perf_counter() if now is None else now
        with self._lock:
            self.updates_total += 1
            self._step_s_sum += step_s
            self._step_count += 1
            self._compute_since_update(at, max(1, micro_steps))
            if grad_norm is not None:
                self._grad_norm_last = grad_norm
                if math.isfinite(grad_norm):
                    self._grad_norm_slope.add(grad_norm)
        if grad_norm is not None and not math.isfinite(grad_norm):
            self._anomaly("non_finite_gradient", {"grad_norm": str(grad_norm)})

    def _compute_since_update(self, at: float, micro_steps: int) -> None:
        """Fold the interval since the last optimizer step into compute_ms_* (call with self._lock held), per
        backward pass: a group accumulating gradients (the breaker's level 2) computes as fast per pass as its
        peers, and must not look slower to device health. An interval with syncs of which none was marked ``last``
        (a sync path that does not say which one the training thread waits for) is left out rather than counted
        with its waits as compute."""
        prev, self._last_update_at = self._last_update_at, at
        synced = self.sync_ops_total != self._syncs_at_update
        if prev is not None and (self._waits or not synced):
            self._compute.add(max(0.0, at - prev - self._wait_s) / micro_steps)
        self._wait_s = 0.0
        self._waits = 0
        self._syncs_at_update = self.sync_ops_total

    def record_skipped_update(self) -> None:
        with self._lock:
            self.skipped_updates_total += 1

    def record_env_steps(self, n: int) -> None:
        with self._lock:
            self._env_steps += n

    def env_step_counter(self, owner: object) -> EnvStepCounter:
        """A counter for ``owner`` (one environment's monitor) to bump without a lock — one writer: an environment
        is stepped by one thread at a time (gymnasium's are not thread-safe) — read by ``env_steps_total``. In a
        learner's step a lock and a call per vector step cost ~5 µs each with the caches cold."""
        counter = EnvStepCounter()
        with self._lock:
            self._env_counters.add(counter)
        weakref.finalize(owner, self._fold, counter)
        return counter

    def _fold(self, counter: EnvStepCounter) -> None:
        # No lock here: a finalizer may run inside a garbage collection that an allocation set off on a thread that
        # holds self._lock (collect() allocates under it). list.append is atomic; the next reader folds it in.
        self._env_gone.append(counter)

    def _env_total(self) -> int:
        """Every environment step so far (call with self._lock held)."""
        while self._env_gone:
            counter = self._env_gone.pop()
            self._env_counters.discard(counter)
            self._env_steps += counter.steps
        return self._env_steps + sum(c.steps for c in self._env_counters)

    @property
    def env_steps_total(self) -> int:
        with self._lock:
            return self._env_total()

    def record_episode(self, ret: float, length: int, terminated: bool, truncated: bool, interrupted: bool) -> None:
        with self._lock:
            self.episodes_total += 1
            self.terminated_total += int(terminated)
            self.truncated_total += int(truncated)
            self._returns.append(ret)
            self._lengths.append(length)
            self._length_cv.add(length)
            self._return_shift.add(ret)
            if interrupted:
                self.interrupted_total += 1
                self.consecutive_interrupted += 1
            else:
                self.consecutive_interrupted = 0

    def _anomaly(self, kind: str, data: dict[str, Any]) -> None:
        if self._on_anomaly is not None:
            self._on_anomaly(kind, data)

    # -- once per beat ------------------------------------------------------------------------------
    def collect(self) -> dict[str, float]:
        now = self._clock()
        with self._lock:
            dt = max(1e-9, now - self._interval_start)
            self._interval_start = now
            out: dict[str, float] = {
                "sync_ops_total": self.sync_ops_total,
                "sync_ok_total": self.sync_ok_total,
                "sync_errors_total": self.sync_errors_total,
                "sync_slow_total": self.sync_slow_total,
                "sync_bytes_total": self.sync_bytes_total,
                "grad_upload_bytes_per_s": self._sync_bytes / dt,
                "collective_ops_total": self.collective_ops_total,
                "collective_bytes_total": self.collective_bytes_total,
                "updates_total": self.updates_total,
                "skipped_updates_total": self.skipped_updates_total,
                "env_steps_total": self._env_total(),
                "env_steps_per_s": 0.0,
                "episodes_total": self.episodes_total,
                "terminated_total": self.terminated_total,
                "truncated_total": self.truncated_total,
                "interrupted_total": self.interrupted_total,
                "consecutive_interrupted": self.consecutive_interrupted,
            }
            if self._sync_count:
                out["bytes_per_sync"] = self._sync_bytes / self._sync_count
            for q, v in self._sync_lat.take().items():
                out[f"sync_latency_ms_{q}"] = v * 1000
            for q, v in self._sync_lag.take().items():
                out[f"sync_lag_ms_{q}"] = v * 1000
            for q, v in self._sync_cost.take().items():
                out[f"sync_cost_ms_{q}"] = v * 1000
            for q, v in self._collective_lat.take().items():
                out[f"collective_latency_ms_{q}"] = v * 1000
            if self._step_count:
                out["step_ms_mean"] = self._step_s_sum / self._step_count * 1000
            for q, v in self._compute.take().items():
                out[f"compute_ms_{q}"] = v * 1000
            if self._grad_norm_last is not None:
                out["grad_norm"] = self._grad_norm_last
            slope = self._grad_norm_slope.value()
            if slope is not None:
                out["grad_norm_slope"] = slope
            if self._returns:
                out["episode_return_mean"] = sum(self._returns) / len(self._returns)
                out["episode_length_mean"] = sum(self._lengths) / len(self._lengths)
            cv = self._length_cv.value()
            if cv is not None:
                out["episode_length_cv"] = cv
            shift = self._return_shift.value()
            if shift is not None:
                out["reward_variance_shift"] = shift
            self._returns.clear()
            self._lengths.clear()
            self._sync_bytes = 0
            self._sync_count = 0
            self._step_s_sum = 0.0
            self._step_count = 0
            out.update(self.effective)
        out["env_steps_per_s"] = self._env_rate(out["env_steps_total"], now)
        return out

    _last_env: tuple[float, float] | None = None

    def _env_rate(self, total: float, now: float) -> float:
        prev, self._last_env = self._last_env, (total, now)
        if prev is None or now <= prev[1]:
            return 0.0
        return (total - prev[0]) / (now - prev[1])
