"""Agent runtimes (Dify-style) as services: registration, their reports, and signed policy pushes with retries.

- A runtime registers (``POST /v1/runtimes``: name, type, callback URL, secret, pool) and gets a runtime token.
  An admin token registers any callback; a pool token only one whose host is on ``webhook_allowed_hosts``.
- With that token it reports (``POST /v1/runtimes/{id}/report``): concurrent agent instances, average LLM-call
  latency, whether function calling is on.
- DSec pushes policies to its callback (``POST /v1/runtimes/{id}/policies`` or from code): the JSON body is signed
  with HMAC-SHA256 over ``"<timestamp>." + body`` (``X-DSec-Signature: v1=<hex>``), carries a delivery id
  (``X-DSec-Delivery``, the same on every retry) and is retried with exponential backoff and jitter until the
  receiver answers 2xx, answers a permanent 4xx, or ``max_attempts`` are spent. Every delivery and attempt is kept in
  a delivery log (``GET /v1/runtimes/{id}/deliveries``; bounded per runtime and in age) and its outcome recorded as
  a ``webhook`` event. Requests go through ``egress.Egress``: private destinations refused, answers capped.
- Runtimes (with their secrets and token hashes) persist in the state store, written off the event loop; a
  ``runtimes.json`` left by an older version is imported once and removed.

The wire protocol, for receivers in other languages, is docs/webhooks.md; ``dsec.integrations.webhook`` is the
reference receiver.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from dsec.alerts.signing import DELIVERY_HEADER, EVENT_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from dsec.backoff import Backoff
from dsec.control.egress import Egress, EgressRefused
from dsec.control.store import RuntimeRow

log = logging.getLogger(__name__)

PERMANENT = frozenset(range(400, 500)) - {408, 425, 429}  # the receiver refused it: retrying will not help
LOG_ANSWER_BYTES = 4096  # an answer longer than this is logged as its first characters only
LOG_TEXT_CHARS = 500


class RuntimeStore(Protocol):
    def put_runtime(self, runtime: RuntimeRow) -> None: ...
    def list_runtimes(self) -> list[RuntimeRow]: ...
    def delete_runtime(self, runtime_id: str) -> bool: ...


@dataclass
class Runtime:
    id: str
    name: str
    type: str
    callback_url: str
    secret: str
    token_hash: str
    pool: str | None = None
    registered_at: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)
    reported_at: float | None = None

    def to_api(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("secret", "token_hash")}

    def row(self) -> RuntimeRow:
        return RuntimeRow(**asdict(self))

    @classmethod
    def from_row(cls, row: RuntimeRow) -> Runtime:
        return cls(**{**asdict(row), "report": dict(row.report)})


@dataclass
class Attempt:
    at: float
    status: int | None  # HTTP status, None when no answer (connection refused, timeout, refused destination)
    error: str | None
    elapsed_ms: float
    response_bytes: int = 0
    truncated: bool = False  # the answer was longer than webhook_max_response_bytes; the rest was not read


@dataclass(frozen=True)
class DeliveryRetention:
    kept_per_runtime: int = 100
    max_age_s: float = 86_400.0


@dataclass
class Delivery:
    id: str
    runtime_id: str
    payload: dict[str, Any]
    created_at: float
    status: str = "pending"  # pending | delivered | failed
    attempts: list[Attempt] = field(default_factory=list)
    next_at: float = 0.0
    finished_at: float | None = None
    answer: Any = None

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "runtime_id": self.runtime_id,
            "payload": self.payload,
            "status": self.status,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "attempts": [asdict(a) for a in self.attempts],
            "answer": self.answer,
        }


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of a policy push (``Settings.webhook_retry``). The field names are configuration: keep them."""

    max_attempts: int = 8
    base_s: float = 0.5
    max_s: float = 30.0
    timeout_s: float = 3.0

    @property
    def backoff(self) -> Backoff:
        return Backoff(initial_s=self.base_s, factor=2.0, max_s=self.max_s)

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Before retry ``attempt`` (1 = the first retry): base x 2^(attempt-1), capped, with equal jitter
        (dsec.backoff says why)."""
        return self.backoff.delay(attempt - 1, rng)


class RuntimeHub:
    """Runtimes in memory (loaded from ``store``), deliveries in memory, one ``dsec-webhooks`` delivery thread.

    The ``register`` / ``record_report`` / ``remove`` coroutines write the store on a worker thread and change the
    in-memory registry only after that write succeeded."""

    def __init__(
        self,
        store: RuntimeStore | None,
        retry: RetryPolicy | None = None,
        on_outcome: Callable[[Delivery], None] | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        egress: Egress | None = None,
        retention: DeliveryRetention | None = None,
    ) -> None:
        self.store = store
        self.retry = retry or RetryPolicy()
        self.on_outcome = on_outcome
        self.clock = clock
        self.rng = rng or random.Random()
        self.retention = retention or DeliveryRetention()
        self.runtimes: dict[str, Runtime] = {}
        self.deliveries: dict[str, Delivery] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._egress = egress or Egress(timeout_s=self.retry.timeout_s)
        self._thread = threading.Thread(target=self._run, name="dsec-webhooks", daemon=True)
        self._thread.start()

    # -- registry -----------------------------------------------------------------------------------------------
    def load(self, legacy_file: Path | None = None) -> None:
        """Startup: the runtimes in the store; a ``runtimes.json`` of an older version is moved into the store (and
        deleted: it holds signing secrets in a file of its own)."""
        if self.store is None:
            return
        if legacy_file is not None and legacy_file.exists():
            try:
                for item in json.loads(legacy_file.read_text()):
                    self.store.put_runtime(Runtime(**item).row())
                legacy_file.unlink()
                log.info("runtimes moved from %s into the state store", legacy_file)
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.error("runtimes not imported from %s: %s", legacy_file, exc)
        for row in self.store.list_runtimes():
            self.runtimes[row.id] = Runtime.from_row(row)

    async def _save(self, rt: Runtime) -> None:
        if self.store is not None:
            await asyncio.to_thread(self.store.put_runtime, rt.row())

    async def register(
        self, name: str, type: str, callback_url: str, secret: str, pool: str | None, token_hash: str
    ) -> Runtime:
        rt = Runtime(f"rt-{uuid.uuid4().hex[:12]}", name, type, callback_url, secret, token_hash, pool, self.clock())
        await self._save(rt)
        with self._cond:
            self.runtimes[rt.id] = rt
        return rt

    async def record_report(self, rt: Runtime, report: Mapping[str, Any]) -> None:
        updated = Runtime(**{**asdict(rt), "report": dict(report), "reported_at": self.clock()})
        await self._save(updated)
        with self._cond:
            rt.report, rt.reported_at = updated.report, updated.reported_at

    async def remove(self, runtime_id: str) -> bool:
        """Forget a runtime: its token stops working and its pending deliveries fail."""
        if self.store is not None:
            await asyncio.to_thread(self.store.delete_runtime, runtime_id)
        with self._cond:
            found = self.runtimes.pop(runtime_id, None) is not None
            self._cond.notify_all()
        return found

    def has_token(self, token_hash: str) -> bool:
        return any(rt.token_hash == token_hash for rt in list(self.runtimes.values()))

    def of_pool(self, pool: str) -> list[Runtime]:
        with self._cond:
            return [rt for rt in self.runtimes.values() if rt.pool == pool]

    # -- deliveries ---------------------------------------------------------------------------------------------
    def push(self, runtime_id: str, payload: Mapping[str, Any]) -> Delivery:
        d = Delivery(uuid.uuid4().hex, runtime_id, dict(payload), self.clock())
        with self._cond:
            self.deliveries[d.id] = d
            self._prune(runtime_id)
            self._cond.notify_all()
        return d

    def deliveries_of(self, runtime_id: str) -> list[Delivery]:
        with self._cond:
            return sorted(
                (d for d in self.deliveries.values() if d.runtime_id == runtime_id), key=lambda d: d.created_at
            )

    def _prune(self, runtime_id: str) -> None:
        """Keep the newest ``kept_per_runtime`` finished deliveries of a runtime, none older than ``max_age_s``
        (pending ones are never dropped). Called under the lock."""
        cutoff = self.clock() - self.retention.max_age_s
        done = sorted(
            (d for d in self.deliveries.values() if d.runtime_id == runtime_id and d.status != "pending"),
            key=lambda d: d.created_at,
        )
        excess = len(done) - self.retention.kept_per_runtime
        for k, d in enumerate(done):
            if k < excess or (d.finished_at or d.created_at) < cutoff:
                del self.deliveries[d.id]

    def _due(self) -> Delivery | None:
        now = self.clock()
        pending = [d for d in self.deliveries.values() if d.status == "pending"]
        ready = [d for d in pending if d.next_at <= now]
        return min(ready, key=lambda d: (d.next_at, d.created_at)) if ready else None

    def _run(self) -> None:
        while True:
            with self._cond:
                d: Delivery | None = None
                while not self._closed:
                    d = self._due()
                    if d is not None:
                        break
                    waits = [p.next_at - self.clock() for p in self.deliveries.values() if p.status == "pending"]
                    self._cond.wait(timeout=max(0.01, min(waits)) if waits else None)
                if self._closed or d is None:
                    return
                rt = self.runtimes.get(d.runtime_id)
            if rt is None:
                self._finish(d, "failed", None)
                continue
            self._attempt(rt, d)

    def _attempt(self, rt: Runtime, d: Delivery) -> None:
        body = json.dumps(d.payload, separators=(",", ":")).encode()
        ts = int(self.clock())
        headers = {
            "Content-Type": "application/json",
            TIMESTAMP_HEADER: str(ts),
            SIGNATURE_HEADER: sign(rt.secret, ts, body),
            DELIVERY_HEADER: d.id,
            EVENT_HEADER: "policy",
        }
        t0 = time.perf_counter()
        status: int | None = None
        error: str | None = None
        answer: Any = None
        size, truncated, refused = 0, False, False
        try:
            got = self._egress.post(rt.callback_url, body, headers)
            status, size, truncated = got.status, len(got.body), got.truncated
            answer = _logged_answer(got.body, truncated)
        except EgressRefused as exc:
            error, refused = f"refused: {exc}", True
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # an unexpected failure must cost this attempt, not the delivery thread
            log.exception("delivery %s to runtime %s failed unexpectedly", d.id, rt.id)
            error = f"{type(exc).__name__}: {exc}"
        attempt = Attempt(self.clock(), status, error, round((time.perf_counter() - t0) * 1e3, 2), size, truncated)
        with self._cond:
            d.attempts.append(attempt)
            d.answer = answer
            if status is not None and 200 <= status < 300:
                outcome = "delivered"
            elif refused or status in PERMANENT or len(d.attempts) >= self.retry.max_attempts:
                outcome = "failed"  # a refused destination stays refused: retrying would only retry the refusal
            else:
                d.next_at = self.clock() + self.retry.delay(len(d.attempts), self.rng)
                return
        self._finish(d, outcome, answer)

    def _finish(self, d: Delivery, status: str, answer: Any) -> None:
        with self._cond:
            d.status = status
            d.finished_at = self.clock()
            d.answer = answer
            self._prune(d.runtime_id)
        if self.on_outcome is not None:
            try:
                self.on_outcome(d)
            except Exception:
                log.exception("webhook outcome callback failed")

    def wait(self, delivery_id: str, timeout: float = 10.0) -> Delivery:
        """Block until a delivery is delivered or failed (tests, CLIs)."""
        deadline = time.monotonic() + timeout
        d = self.deliveries[delivery_id]
        while d.status == "pending" and time.monotonic() <= deadline:
            time.sleep(0.02)
        return d

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._egress.close()


def _logged_answer(body: bytes, truncated: bool) -> Any:
    """What the delivery log keeps of an answer: small JSON as JSON, anything else as the start of its text."""
    if not truncated and len(body) <= LOG_ANSWER_BYTES:
        try:
            return json.loads(body)
        except ValueError:
            pass
    text = body[: LOG_TEXT_CHARS * 4].decode("utf-8", errors="replace")[:LOG_TEXT_CHARS]
    if len(text.encode()) < len(body) or truncated:
        text += f"... ({len(body)}{'+' if truncated else ''} bytes)"
    return text
