"""Agent runtimes (Dify-style) as services: registration, their reports, and signed policy pushes with retries.

- A runtime registers (``POST /v1/runtimes``: name, type, callback URL, secret, pool) and gets a runtime token.
- With that token it reports (``POST /v1/runtimes/{id}/report``): concurrent agent instances, average LLM-call
  latency, whether function calling is on.
- DSec pushes policies to its callback (``POST /v1/runtimes/{id}/policies`` or from code): the JSON body is signed
  with HMAC-SHA256 over ``"<timestamp>." + body`` (``X-DSec-Signature: v1=<hex>``), carries a delivery id
  (``X-DSec-Delivery``, the same on every retry) and is retried with exponential backoff and jitter until the
  receiver answers 2xx, answers a permanent 4xx, or ``max_attempts`` are spent. Every delivery and attempt is kept in
  a delivery log (``GET /v1/runtimes/{id}/deliveries``) and its outcome recorded as a ``webhook`` event.
- Runtimes (with their secrets and token hashes) persist in ``$DSEC_HOME/runtimes.json`` (mode 0600).

The wire protocol, for receivers in other languages, is docs/webhooks.md; ``dsec.integrations.webhook`` is the
reference receiver.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dsec.alerts.signing import DELIVERY_HEADER, EVENT_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from dsec.fsutil import write_atomic

log = logging.getLogger(__name__)

PERMANENT = frozenset(range(400, 500)) - {408, 425, 429}  # the receiver refused it: retrying will not help


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


@dataclass
class Attempt:
    at: float
    status: int | None  # HTTP status, None when no answer (connection refused, timeout)
    error: str | None
    elapsed_ms: float


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
    max_attempts: int = 8
    base_s: float = 0.5
    max_s: float = 30.0
    timeout_s: float = 3.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Before retry ``attempt`` (1 = the first retry): base x 2^(attempt-1), capped, with +-50% jitter."""
        return float(min(self.max_s, self.base_s * 2 ** (attempt - 1)) * rng.uniform(0.5, 1.5))


class RuntimeHub:
    def __init__(
        self,
        path: Path | None,
        retry: RetryPolicy | None = None,
        on_outcome: Callable[[Delivery], None] | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.path = path
        self.retry = retry or RetryPolicy()
        self.on_outcome = on_outcome
        self.clock = clock
        self.rng = rng or random.Random()
        self.runtimes: dict[str, Runtime] = {}
        self.deliveries: dict[str, Delivery] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._client = httpx.Client(timeout=self.retry.timeout_s, headers={"User-Agent": "dsec-webhooks"})
        self._load()
        self._thread = threading.Thread(target=self._run, name="dsec-webhooks", daemon=True)
        self._thread.start()

    # -- registry -----------------------------------------------------------------------------------------------
    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            for item in json.loads(self.path.read_text()):
                self.runtimes[item["id"]] = Runtime(**item)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.error("runtimes not loaded from %s: %s", self.path, exc)

    def _save(self) -> None:
        if self.path is None:
            return
        data = json.dumps([asdict(r) for r in self.runtimes.values()], indent=1).encode()
        write_atomic(self.path, data)
        os.chmod(self.path, 0o600)  # it holds the runtimes' signing secrets

    def register(
        self, name: str, type: str, callback_url: str, secret: str, pool: str | None, token_hash: str
    ) -> Runtime:
        rt = Runtime(f"rt-{uuid.uuid4().hex[:12]}", name, type, callback_url, secret, token_hash, pool, self.clock())
        with self._cond:
            self.runtimes[rt.id] = rt
            self._save()
        return rt

    def record_report(self, rt: Runtime, report: Mapping[str, Any]) -> None:
        with self._cond:
            rt.report = dict(report)
            rt.reported_at = self.clock()
            self._save()

    # -- deliveries ---------------------------------------------------------------------------------------------
    def push(self, runtime_id: str, payload: Mapping[str, Any]) -> Delivery:
        d = Delivery(uuid.uuid4().hex, runtime_id, dict(payload), self.clock())
        with self._cond:
            self.deliveries[d.id] = d
            self._cond.notify_all()
        return d

    def deliveries_of(self, runtime_id: str) -> list[Delivery]:
        with self._cond:
            return sorted(
                (d for d in self.deliveries.values() if d.runtime_id == runtime_id), key=lambda d: d.created_at
            )

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
        try:
            r = self._client.post(rt.callback_url, content=body, headers=headers)
            status = r.status_code
            try:
                answer = r.json()
            except ValueError:
                answer = r.text[:500]
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        attempt = Attempt(self.clock(), status, error, round((time.perf_counter() - t0) * 1e3, 2))
        with self._cond:
            d.attempts.append(attempt)
            d.answer = answer
            if status is not None and 200 <= status < 300:
                outcome = "delivered"
            elif status in PERMANENT or len(d.attempts) >= self.retry.max_attempts:
                outcome = "failed"
            else:
                d.next_at = self.clock() + self.retry.delay(len(d.attempts), self.rng)
                return
        self._finish(d, outcome, answer)

    def _finish(self, d: Delivery, status: str, answer: Any) -> None:
        with self._cond:
            d.status = status
            d.finished_at = self.clock()
            d.answer = answer
        if self.on_outcome is not None:
            try:
                self.on_outcome(d)
            except Exception:
                log.exception("webhook outcome callback failed")

    def wait(self, delivery_id: str, timeout: float = 10.0) -> Delivery:
        """Block until a delivery is delivered or failed (tests, CLIs)."""
        deadline = time.monotonic() + timeout
        while True:
            d = self.deliveries[delivery_id]
            if d.status != "pending" or time.monotonic() > deadline:
                return d
            time.sleep(0.02)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._client.close()
