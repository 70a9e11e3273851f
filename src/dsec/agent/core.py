"""``dsec agent``: one per machine, between that machine's probes and the control plane.

The agent speaks the worker protocol the probes already speak (``DSEC_ENDPOINT`` points at it; a probe changes
nothing) on a loopback port and/or a unix socket, and:

- **coalesces heartbeats**: each ``POST /v1/workers/{id}/heartbeat`` waits in a per-worker slot; every
  ``flush_ms`` (or as soon as ``max_batch`` workers wait) the slots go to the control plane as one
  ``POST /v1/heartbeats``, and each probe gets its own item's result — the directive fanned back in its answer,
  its errors as the single-beat route would answer them (so a probe re-registers, resends or drops exactly as it
  would talking to the control plane). A batch the control plane refuses as a whole (a stale header token, an old
  control plane without the route) is sent again as single beats;
- **proxies everything else** as it comes (registration, deregistration, directive reads, healing, events), with
  the caller's own token;
- is **fail-static**: when the control plane does not answer, waiting probes get a 503 at once (they keep their
  last directive and resend later, as they do against a control plane that is down) while the agent keeps each
  worker's newest beat and retries with backoff (``dsec.backoff.Backoff``), delivering them when it is back;
- has **bounded memory**: one slot per worker (a newer beat replaces an older unsent one: only the newest
  matters), at most ``max_workers`` slots (the least recently beating dropped first), bounded waiters and bodies.

It holds no credential of its own: every request carries the token of the probe that sent it, and a batch is sent
with one of its own items' worker tokens (docs/protocol.md, "Batched heartbeats").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from dsec.backoff import Backoff
from dsec.control.auth import bearer
from dsec.control.ingest import match as heartbeat_worker_id
from dsec.control.ingest import read_body
from dsec.control.schemas import MAX_BATCH_ITEMS

log = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Answer = tuple[int, dict[str, Any]]

# Headers passed through the proxy, each way.
_REQUEST_HEADERS = (b"authorization", b"content-type", b"accept")
_ANSWER_HEADERS = ("content-type", "retry-after", "allow")


@dataclass(frozen=True)
class AgentConfig:
    upstream: str  # the control plane's URL
    host: str = "127.0.0.1"
    port: int = 8081  # 0: a free port the OS picks (tests)
    uds: str | None = None  # also listen on this unix socket
    listen_tcp: bool = True
    flush_ms: float = 50.0  # a beat waits at most this long for its batch
    max_batch: int = 500  # ... or until this many workers wait
    max_workers: int = 10_000  # slots held (workers with a beat waiting)
    max_waiters: int = 8  # requests waiting on one worker's slot (a probe has one in flight)
    max_body_bytes: int = 1 << 20
    upstream_timeout_s: float = 1.5  # under the probe's 2 s request timeout: it hears the 503, not a timeout
    proxy_timeout_s: float = 60.0  # healing long-polls are held up to 20 s
    backoff: Backoff = field(default_factory=lambda: Backoff(initial_s=0.25, max_s=10.0))

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch <= MAX_BATCH_ITEMS:
            raise ValueError(f"max_batch={self.max_batch} is invalid: expected 1..{MAX_BATCH_ITEMS}")
        if not 0 < self.flush_ms <= 10_000:
            raise ValueError(f"flush_ms={self.flush_ms} is invalid: expected (0, 10000]")
        if self.max_workers < 1 or self.max_waiters < 1:
            raise ValueError("max_workers and max_waiters must be >= 1")
        if not self.listen_tcp and not self.uds:
            raise ValueError("the agent must listen somewhere: a TCP port or a unix socket (uds)")


def _error(status: int, code: str, message: str, field: str | None = None) -> Answer:
    return status, {"error": code, "message": message, "field": field, "details": []}


def _unavailable(why: str) -> Answer:
    return _error(503, "unavailable", f"control plane unreachable through the node agent ({why}); retry later")


@dataclass
class _Slot:
    """A worker's newest beat waiting for its batch, and the requests waiting for its answer."""

    worker_id: str
    token: str
    seq: int
    item: dict[str, Any]
    waiters: list[asyncio.Future[Answer]] = field(default_factory=list)


@dataclass
class AgentStats:
    beats_in: int = 0
    batches_sent: int = 0
    beats_forwarded: int = 0  # items answered by the control plane (in batches or singly)
    singles_sent: int = 0  # beats sent one by one (a batch refused as a whole)
    replaced: int = 0  # older unsent beats replaced by a newer one of the same worker
    evicted: int = 0  # slots dropped to stay within max_workers
    upstream_failures: int = 0
    proxied: int = 0


class NodeAgent:
    """The agent as an ASGI app (with its lifespan: the upstream client and the flusher start and stop with it)."""

    def __init__(self, config: AgentConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self._transport = transport
        self._slots: OrderedDict[str, _Slot] = OrderedDict()
        self._full = asyncio.Event()
        self._client: httpx.AsyncClient | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._rng = random.Random()
        self.failures = 0  # consecutive upstream failures (0: the control plane answers)
        self.last_error: str | None = None
        self._sender_token: str | None = None  # the last item token a batch was accepted with
        self.stats = AgentStats()

    # -- ASGI -----------------------------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = await read_body(receive, self.config.max_body_bytes)
        if body is None:
            status, answer = _error(413, "too_large", f"request body exceeds {self.config.max_body_bytes} bytes",
                                    "body")  # fmt: skip
            await _respond(send, status, orjson.dumps(answer), {"content-type": "application/json"})
            return
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _REQUEST_HEADERS}
        worker_id = heartbeat_worker_id(path) if method == "POST" else None
        if worker_id is not None:
            status, answer = await self.heartbeat(worker_id, headers.get("authorization"), body)
            await _respond(send, status, orjson.dumps(answer), {"content-type": "application/json"})
        elif method == "GET" and path == "/agent/status":
            await _respond(send, 200, orjson.dumps(self.status()), {"content-type": "application/json"})
        else:
            await self._proxy(scope, headers, body, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def start(self) -> None:
        self._client = httpx.AsyncClient(
            base_url=self.config.upstream.rstrip("/"),
            timeout=self.config.upstream_timeout_s,
            transport=self._transport,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
        )
        self._flusher = asyncio.create_task(self._flush_forever(), name="dsec-agent-flusher")

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        for slot in self._slots.values():
            _answer(slot.waiters, _unavailable("the agent is stopping"))
        self._slots.clear()
        if self._client is not None:
            await self._client.aclose()

    def status(self) -> dict[str, Any]:
        return {
            "upstream": self.config.upstream,
            "upstream_up": self.failures == 0,
            "consecutive_failures": self.failures,
            "last_error": self.last_error,
            "waiting_workers": len(self._slots),
            **self.stats.__dict__,
        }

    # -- heartbeats ------------------------------------------------------------------------------------------------
    async def heartbeat(self, worker_id: str, authorization: str | None, body: bytes) -> Answer:
        """Queue one probe's beat for the next batch and answer what the control plane answered for it."""
        self.stats.beats_in += 1
        token = bearer(authorization)
        if token is None:
            return _error(401, "unauthorized", "missing or malformed Authorization: Bearer <token> header",
                          "Authorization")  # fmt: skip
        try:
            item = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return _error(422, "invalid", f"malformed JSON: {exc}", "body")
        if not isinstance(item, dict):
            return _error(422, "invalid", "the body must be a JSON object (a heartbeat)", "body")
        seq = item.get("seq")
        # What the control plane would refuse anyway; the agent needs seq to order a worker's beats.
        if not isinstance(seq, (int, float)) or isinstance(seq, bool):
            return _error(422, "invalid", "seq: Input should be a valid integer", "seq")
        item["worker_id"], item["token"] = worker_id, token
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        slot = self._slots.get(worker_id)
        if slot is not None and slot.token == token and slot.seq == seq and len(slot.waiters) < self.config.max_waiters:
            slot.waiters.append(waiter)  # a resend of the waiting beat
            self._slots.move_to_end(worker_id)
        else:
            if slot is not None:  # a newer beat (or another token's): it replaces the one not sent yet
                self.stats.replaced += 1
                _answer(slot.waiters, _error(503, "unavailable", "replaced by a newer beat of this worker; resend"))
            self._slots.pop(worker_id, None)
            self._slots[worker_id] = _Slot(worker_id, token, int(seq), item, [waiter])
            while len(self._slots) > self.config.max_workers:
                _, dropped = self._slots.popitem(last=False)
                self.stats.evicted += 1
                _answer(dropped.waiters, _unavailable("too many workers waiting at the agent"))
            if len(self._slots) >= self.config.max_batch:
                self._full.set()
        if self.failures:
            # Fail-static: the probe hears at once that the control plane is away and keeps its last directive;
            # its beat stays here (newest only) and goes out when the control plane answers again.
            _answer([waiter], _unavailable(self.last_error or "no answer"))
        return await waiter

    async def _flush_forever(self) -> None:
        interval = self.config.flush_ms / 1000.0
        while True:
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._full.wait(), interval)
                self._full.clear()
                while self._slots:
                    batch = self._take(self.config.max_batch)
                    try:
                        sent = await self._send(batch)
                    except Exception:  # a bug: this batch's probes hear 503 and resend; the agent goes on
                        log.exception("dsec agent: sending a batch failed")
                        for slot in batch:
                            _answer(slot.waiters, _unavailable("the agent failed to send the batch"))
                        break
                    if not sent:
                        self._requeue(batch)
                        await asyncio.sleep(self.config.backoff.delay(self.failures - 1, self._rng))
                        break
                    if len(self._slots) < self.config.max_batch:
                        break  # a partial batch waits for the next tick
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the flusher die: the probes would hang on their slots
                log.exception("dsec agent: flushing failed; retrying")
                await asyncio.sleep(interval)

    def _take(self, n: int) -> list[_Slot]:
        batch: list[_Slot] = []
        while self._slots and len(batch) < n:
            batch.append(self._slots.popitem(last=False)[1])
        return batch

    def _requeue(self, batch: list[_Slot]) -> None:
        """Unsent slots go back, unless the worker sent a newer beat meanwhile (only the newest matters); their
        waiters were answered 503 already."""
        for slot in reversed(batch):
            slot.waiters = []
            if slot.worker_id in self._slots:
                continue  # a newer beat of this worker came meanwhile
            if len(self._slots) >= self.config.max_workers:
                self.stats.evicted += 1  # the oldest beats are the ones dropped
                continue
            self._slots[slot.worker_id] = slot
            self._slots.move_to_end(slot.worker_id, last=False)

    async def _send(self, batch: list[_Slot]) -> bool:
        """Send one batch; False when the control plane did not answer (each waiter got a 503)."""
        assert self._client is not None
        tokens = {s.token for s in batch}
        header = self._sender_token if self._sender_token in tokens else batch[0].token
        try:
            resp = await self._client.post(
                "/v1/heartbeats",
                content=orjson.dumps({"items": [s.item for s in batch]}),
                headers={"authorization": f"Bearer {header}", "content-type": "application/json"},
            )
        except httpx.HTTPError as exc:
            return self._down(batch, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if resp.status_code >= 500:
            return self._down(batch, f"HTTP {resp.status_code}")
        self.failures, self.last_error = 0, None
        self.stats.batches_sent += 1
        results = _results(resp, len(batch))
        if results is None:
            # Refused as a whole: a header token the control plane no longer knows, a control plane without the
            # batch route, a body over its cap. Each beat goes on its own, answered as the probe would be.
            await asyncio.gather(*(self._send_single(s) for s in batch))
            return True
        self._sender_token = header
        for slot, result in zip(batch, results, strict=True):
            status = int(result.pop("status", 200))
            result.pop("index", None)
            self.stats.beats_forwarded += 1
            _answer(slot.waiters, (status, result))
        return True

    async def _send_single(self, slot: _Slot) -> None:
        assert self._client is not None
        item = {k: v for k, v in slot.item.items() if k not in ("worker_id", "token")}
        self.stats.singles_sent += 1
        try:
            resp = await self._client.post(
                f"/v1/workers/{slot.worker_id}/heartbeat",
                content=orjson.dumps(item),
                headers={"authorization": f"Bearer {slot.token}", "content-type": "application/json"},
            )
            answer = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            _answer(slot.waiters, _unavailable(type(exc).__name__))
            return
        self.stats.beats_forwarded += 1
        _answer(slot.waiters, (resp.status_code, answer if isinstance(answer, dict) else {}))

    def _down(self, batch: list[_Slot], why: str) -> bool:
        if self.failures == 0:
            log.warning("dsec agent: control plane %s not answering (%s); probes keep their directives, retrying",
                        self.config.upstream, why)  # fmt: skip
        self.failures += 1
        self.stats.upstream_failures += 1
        self.last_error = why
        for slot in batch:
            _answer(slot.waiters, _unavailable(why))
        return False

    # -- everything else: proxied as it comes -------------------------------------------------------------------------
    async def _proxy(self, scope: dict[str, Any], headers: dict[str, str], body: bytes, send: Send) -> None:
        assert self._client is not None
        self.stats.proxied += 1
        query = scope.get("query_string", b"").decode("latin-1")
        url = scope["path"] + (f"?{query}" if query else "")
        try:
            resp = await self._client.request(
                scope["method"], url, content=body or None, headers=headers, timeout=self.config.proxy_timeout_s
            )
        except httpx.HTTPError as exc:
            status, answer = _unavailable(type(exc).__name__)
            await _respond(send, status, orjson.dumps(answer), {"content-type": "application/json"})
            return
        out = {k: resp.headers[k] for k in _ANSWER_HEADERS if k in resp.headers}
        await _respond(send, resp.status_code, resp.content, out)


def _results(resp: httpx.Response, n: int) -> list[dict[str, Any]] | None:
    """The batch answer's items, or None when the batch was refused as a whole (or the answer is not one)."""
    if resp.status_code != 200:
        return None
    try:
        items = resp.json().get("items")
    except (ValueError, AttributeError):
        return None
    if not isinstance(items, list) or len(items) != n or not all(isinstance(i, dict) for i in items):
        return None
    return items


def _answer(waiters: list[asyncio.Future[Answer]], answer: Answer) -> None:
    for w in waiters:
        if not w.done():
            w.set_result((answer[0], dict(answer[1])))


async def _respond(send: Send, status: int, payload: bytes, headers: dict[str, str]) -> None:
    head = [(k.encode(), v.encode()) for k, v in headers.items()]
    head.append((b"content-length", str(len(payload)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": payload})
