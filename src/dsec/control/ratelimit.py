"""Request rate limits per token: token buckets, and the ASGI middleware that answers 429 before any route runs.

Hand-written rather than a library (slowapi, limits): the key is the caller's token hash and its kind decides
whether it is limited at all (admin tokens are not: they can mint tokens, so a limit would protect nothing), buckets
must be bounded in number, and the check costs a hash and a dict lookup. Heartbeats never pass here: the heartbeat
shortcut answers them in front of this middleware (and the FastAPI heartbeat route is skipped by path), because a
registered worker's beats are bounded by its own rules (one beat per ``seq``, metric-name and event budgets) and the
ingest path carries ~10k beats/s; batches of heartbeats (``POST /v1/heartbeats``) likewise, item by item. Healing
routes are not limited either (see ``__call__``).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from dsec.control import auth, ingest

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second. ``take`` answers 0 when granted, else the wait in seconds."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = now

    def take(self, n: float, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if n > self.burst:
            return math.inf  # can never be granted at once
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) / self.rate


class RateLimiter:
    """One bucket per key, at most ``max_keys`` (least recently used dropped: a full bucket is what it would get
    anyway, so dropping one costs at most one burst)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic):
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, key: str, n: float = 1.0) -> float:
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now)
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(n, now)

    def forget(self, key: str) -> None:
        self._buckets.pop(key, None)


def too_many(message: str, field: str, retry_after_s: float) -> tuple[dict[str, object], list[tuple[bytes, bytes]]]:
    body: dict[str, object] = {"error": "rate_limited", "message": message, "field": field, "details": []}
    retry = "3600" if math.isinf(retry_after_s) else str(max(1, math.ceil(retry_after_s)))
    return body, [(b"retry-after", retry.encode())]


class RateLimit:
    """Pure ASGI middleware: a request with a limited token over its budget gets 429 with ``Retry-After``."""

    def __init__(self, app: ASGIApp, kind_of: Callable[[str], str | None], limiter: RateLimiter) -> None:
        self.app = app
        self.kind_of = kind_of
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Healing members share their pool's token and hold one long-poll each (a group of thousands re-watches at
        # thousands per second right after a change): bounded by the protocol, like heartbeats, not by this limit.
        if scope["type"] != "http" or _unlimited(scope["path"]):
            await self.app(scope, receive, send)
            return
        token = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                token = auth.bearer(value.decode("latin-1"))
                break
        if token is not None:
            h = auth.hash_token(token)
            kind = self.kind_of(h)
            # Unknown tokens are not counted (each would get a bucket); the route refuses them anyway.
            if kind is not None and kind != "admin":
                wait = self.limiter.take(h)
                if wait > 0:
                    await _answer(send, 429, *too_many(f"too many requests with this {kind} token: retry later",
                                                       "Authorization", wait))  # fmt: skip
                    return
        await self.app(scope, receive, send)


def _unlimited(path: str) -> bool:
    return ingest.match(path) is not None or path == ingest.BATCH_ROUTE or path.startswith("/v1/heal/")


async def _answer(send: Send, status: int, body: dict[str, object], headers: list[tuple[bytes, bytes]]) -> None:
    payload = orjson.dumps(body)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": payload})
