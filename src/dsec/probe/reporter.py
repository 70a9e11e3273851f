"""The worker side of the protocol: register, then heartbeat from a daemon thread.

Guarantees to the training code that calls it:
- never blocks: ``observe``/``gauge``/``inc``/``event`` only touch in-memory aggregates under a lock;
- never raises out of the background thread, and never crashes the process;
- bounded memory: events beyond ``max_buffered_events`` are dropped oldest-first and counted;
- fail-static: when the control plane is unreachable the last received directive stays in force;
- reconnects with exponential backoff and jitter; re-registers if the control plane forgot it;
- ``close()`` sends a final beat (flush) and deregisters, within a bounded time.

Metric summaries per beat: ``observe(name, x)`` -> ``name_mean``, ``name_max``, ``name_count`` for the
interval; ``gauge(name, x)`` -> last value; ``inc(name, n)`` -> a cumulative count (``name``).
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dsec.backoff import Backoff
from dsec.client import ApiError, Client, ClientError

log = logging.getLogger(__name__)

# Returns True when the directive is in force now (acked on the next beat), False when it will be
# applied at a later safe point — the caller then acks it with ``Reporter.ack(version)``.
DirectiveHandler = Callable[[Mapping[str, Any]], bool]
Collector = Callable[[], Mapping[str, float]]


@dataclass(frozen=True)
class ReporterConfig:
    endpoint: str
    pool: str
    token: str | None = None
    role: str = "other"
    group: str = "default"
    rank: int = 0
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    device: str | None = None
    heartbeat_interval_s: float = 5.0
    max_buffered_events: int = 1000
    request_timeout_s: float = 2.0
    max_backoff_s: float = 30.0
    close_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        if not 0.05 <= self.heartbeat_interval_s <= 3600:
            raise ValueError(f"heartbeat_interval_s={self.heartbeat_interval_s} is invalid: expected 0.05..3600")
        if self.max_buffered_events < 1:
            raise ValueError(f"max_buffered_events={self.max_buffered_events} is invalid: expected >= 1")


class _Aggregate:
    __slots__ = ("count", "max", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = -math.inf

    def add(self, x: float) -> None:
        self.count += 1
        self.total += x
        if x > self.max:
            self.max = x


class Reporter:
    """Background reporter for one worker process. Thread-safe; a context manager."""

    def __init__(
        self,
        config: ReporterConfig,
        *,
        client: Client | None = None,
        on_directive: DirectiveHandler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._client = client or Client(config.endpoint, timeout=config.request_timeout_s)
        self._on_directive = on_directive
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._rng = random.Random()  # retry jitter
        self._observed: dict[str, _Aggregate] = {}
        self._gauges: dict[str, float] = {}
        self._counters: dict[str, float] = {}
        self._events: deque[dict[str, Any]] = deque(maxlen=config.max_buffered_events)
        self._pending: dict[str, Any] | None = None  # a beat sent but not acknowledged: resent as-is
        self.role = config.role  # registered with; changed by set_role (an inferred role)
        self._role_update: dict[str, Any] | None = None  # sent with the next beat
        self.worker_id: str | None = None
        self._worker_token: str | None = None
        self._seq = 0
        self.directive: dict[str, Any] | None = None  # last directive received (fail-static)
        self.latency_cap_ms: float | None = None  # what the control plane counts this worker's syncs against
        self.applied_version = 0
        self.beats_ok = 0
        self.beats_failed = 0
        self.dropped_events = 0
        self.dropped_nonfinite = 0
        self.last_error: str | None = None
        self._collectors: list[Collector] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the training side: cheap, never blocks ---------------------------------------------------
    def observe(self, name: str, value: float) -> None:
        if not math.isfinite(value):
            self.dropped_nonfinite += 1
            return
        with self._lock:
            agg = self._observed.get(name)
            if agg is None:
                agg = self._observed[name] = _Aggregate()
            agg.add(float(value))

    def gauge(self, name: str, value: float) -> None:
        if not math.isfinite(value):
            self.dropped_nonfinite += 1
            return
        with self._lock:
            self._gauges[name] = float(value)

    def inc(self, name: str, n: float = 1.0) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0.0) + n

    def event(self, type: str, /, urgent: bool = False, **data: Any) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped_events += 1
            self._events.append({"type": type, "ts": time.time(), "data": data})
        if urgent:
            self._wake.set()

    def set_role(self, role: str, evidence: Mapping[str, Any]) -> None:
        """The worker's role changed (inferred): the next beat says so, and a re-registration uses it."""
        with self._lock:
            self.role = role
            self._role_update = {"role": role, "evidence": dict(evidence)}

    def add_collector(self, collector: Collector) -> None:
        """``collector()`` is called once per beat (on the reporter thread); its metrics join the beat."""
        self._collectors.append(collector)

    def ack(self, version: int) -> None:
        """Declare directive ``version`` applied (for handlers that applied it later, at a safe point)."""
        if self.directive is not None and int(self.directive.get("version", 0)) == version:
            self.applied_version = version

    def beat_now(self) -> None:
        """Send the next beat at once instead of at the next interval (sharp anomalies)."""
        self._wake.set()

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> Reporter:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dsec-reporter", daemon=True)
            self._thread.start()
        return self

    def close(self, reason: str = "close") -> None:
        """Flush one last beat and deregister with ``reason`` (bounded by ``close_timeout_s``); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.close_timeout_s)
        try:
            if self.worker_id is not None:
                self._beat_once()
                self._client.deregister(self.worker_id, reason=reason, token=self._worker_token)
        except ClientError as exc:
            log.debug("dsec: final flush failed: %s", exc)
        except Exception:  # never let the probe crash the training process on exit
            log.debug("dsec: final flush failed", exc_info=True)
        finally:
            self._client.close()

    def deregister_now(self, reason: str) -> None:
        """Deregister at once, without a final beat and on a connection of its own (another thread may be stuck in
        the regular close); errors are swallowed. For a process about to die."""
        worker_id, token = self.worker_id, self._worker_token
        if worker_id is None:
            return
        try:
            with Client(self.config.endpoint, timeout=self.config.request_timeout_s) as client:
                client.deregister(worker_id, reason=reason, token=token)
        except Exception:
            log.debug("dsec: deregistration failed", exc_info=True)

    def __enter__(self) -> Reporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def registered(self) -> bool:
        return self.worker_id is not None

    # -- the background thread ------------------------------------------------------------------
    def _run(self) -> None:
        # 0.25 s after the first failure, doubling to max_backoff_s (never above it, even when it is below 0.25 s)
        backoff = Backoff(initial_s=min(0.25, self.config.max_backoff_s), max_s=self.config.max_backoff_s)
        failures = 0
        while not self._stop.is_set():
            try:
                if self.worker_id is None:
                    self._register()
                else:
                    self._beat_once()
                failures = 0
                wait = self.config.heartbeat_interval_s
            except Exception as exc:  # ClientError or a bug: either way keep training alive
                self.beats_failed += 1
                if self.last_error != str(exc):
                    log.warning("dsec: control plane not reachable (%s); training continues, retrying", exc)
                self.last_error = str(exc)
                wait = backoff.delay(failures, self._rng)
                failures += 1
            self._wake.wait(wait)
            self._wake.clear()

    def _register(self) -> None:
        c = self.config
        answer = self._client.register(
            c.pool,
            role=self.role,
            group=c.group,
            rank=c.rank,
            host=c.host,
            pid=c.pid,
            device=c.device,
            heartbeat_interval_s=c.heartbeat_interval_s,
            token=c.token,
        )
        self._worker_token = answer["worker_token"]
        self._seq = 0
        self._pending = None
        self.worker_id = answer["worker_id"]
        self.last_error = None
        # A new registration starts a new directive history (versions restart at 1).
        self.directive = None
        self.applied_version = 0
        self._apply(answer.get("directive"))

    def _take_payload(self) -> dict[str, Any]:
        collected: dict[str, float] = {}
        for collector in self._collectors:
            try:
                collected.update(collector())
            except Exception:  # a broken collector loses its metrics, never the beat
                log.debug("dsec: metric collector failed", exc_info=True)
        collected = {k: float(v) for k, v in collected.items() if math.isfinite(v)}
        with self._lock:
            metrics: dict[str, float] = collected
            metrics.update(self._gauges)
            metrics.update(self._counters)
            for name, agg in self._observed.items():
                if agg.count:
                    metrics[f"{name}_mean"] = agg.total / agg.count
                    metrics[f"{name}_max"] = agg.max
                    metrics[f"{name}_count"] = float(agg.count)
            self._observed.clear()
            events = list(self._events)
            self._events.clear()
            role, self._role_update = self._role_update, None
        self._seq += 1
        return {"seq": self._seq, "metrics": metrics, "events": events, "inferred_role": role}

    def _beat_once(self) -> None:
        if self.worker_id is None:
            return
        if self._pending is None:
            self._pending = self._take_payload()
        p = self._pending
        try:
            answer = self._client.heartbeat(
                self.worker_id,
                p["seq"],
                acked_directive_version=self.applied_version,
                metrics=p["metrics"],
                events=p["events"],
                token=self._worker_token,
                inferred_role=p["inferred_role"],
            )
        except ApiError as exc:
            if exc.status in (401, 403, 404, 409):
                # The control plane no longer knows us (new database, revoked token): start over.
                # The pending beat is dropped; the buffered metrics of later intervals are kept.
                log.warning("dsec: control plane rejected worker %s (%s); re-registering", self.worker_id, exc)
                self.worker_id = None
                self._pending = None
            elif exc.status == 422:
                log.warning("dsec: control plane rejected a beat as invalid, dropping it: %s", exc)
                self._pending = None
            raise
        self._pending = None
        self.beats_ok += 1
        self.last_error = None
        cap = answer.get("latency_cap_ms")
        if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0:
            self.latency_cap_ms = float(cap)
        self._apply(answer.get("directive"))

    def _apply(self, directive: Mapping[str, Any] | None) -> None:
        if not directive or directive.get("version", 0) == self.applied_version:
            return
        if self.directive is not None and directive.get("version") == self.directive.get("version"):
            return  # already handed to the handler; waiting for its safe point
        self.directive = dict(directive)
        ok = True
        if self._on_directive is not None:
            try:
                ok = bool(self._on_directive(self.directive))
            except Exception:
                log.exception("dsec: directive handler failed; version %s not acked", directive.get("version"))
                ok = False
        if ok:
            # Acked in the next beat: the control plane treats it as in force only from then on.
            self.applied_version = int(directive["version"])
