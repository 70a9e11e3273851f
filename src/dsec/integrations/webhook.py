"""Reference receiver for DSec's webhook protocol (docs/webhooks.md): verify, de-duplicate, dispatch.

An agent runtime (Dify-style) registers with DSec and receives policies at its callback URL, e.g.
``{"policy": "gradient_accumulation", "steps": 4, "target_gpu": "gpu-003a"}``, as signed JSON. This module is what
such a runtime mounts to receive them::

    from dsec.integrations.webhook import WebhookReceiver

    receiver = WebhookReceiver(secret=os.environ["DSEC_WEBHOOK_SECRET"])

    @receiver.on("gradient_accumulation")
    def accumulate(policy: dict) -> None:
        set_accumulation(policy["steps"], gpu=policy.get("target_gpu"))

    app.mount("/dsec", receiver.asgi)     # Starlette/FastAPI; or receiver.wsgi for Flask/Django

Checks, in order (status codes in docs/webhooks.md): signature (HMAC-SHA256 over ``"<timestamp>." + body``, any of
the receiver's secrets, constant-time), timestamp within the replay window (default 300 s), JSON body with a
``policy`` name the receiver handles. A delivery id that was already applied is answered ``200 duplicate`` without
applying it again; a handler that raises answers 500 and leaves the id unapplied, so DSec's retry applies it.
Nothing here needs a web framework.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from dsec.alerts.signing import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, SignatureError, verify

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Any]


class WebhookReceiver:
    def __init__(
        self,
        secret: str | bytes | Sequence[str | bytes],
        *,
        tolerance_s: float = 300.0,
        max_remembered: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.secret = secret
        self.tolerance_s = tolerance_s
        self.max_remembered = max_remembered
        self.clock = clock
        self._handlers: dict[str, Handler] = {}
        self._applied: OrderedDict[str, float] = OrderedDict()  # delivery id -> when applied
        self._lock = threading.Lock()  # one delivery at a time: a redelivery waits for the first to finish
        self.applied = 0
        self.duplicates = 0
        self.rejected = 0

    def on(self, policy: str) -> Callable[[Handler], Handler]:
        """Register the handler of one policy name (decorator)."""

        def register(fn: Handler) -> Handler:
            self._handlers[policy] = fn
            return fn

        return register

    # -- the framework-free core --------------------------------------------------------------------------------
    def handle(self, headers: Mapping[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer) for one request; ``headers`` with case-insensitive lookup done by the caller or
        given in any case."""
        h = {k.lower(): v for k, v in headers.items()}
        try:
            verify(self.secret, h.get(TIMESTAMP_HEADER.lower()), h.get(SIGNATURE_HEADER.lower()), body, self.clock(),
                   self.tolerance_s)  # fmt: skip
        except SignatureError as exc:
            self.rejected += 1
            return 401, {"error": "unauthorized", "message": str(exc)}
        delivery = h.get(DELIVERY_HEADER.lower())
        if not delivery or len(delivery) > 128:
            self.rejected += 1
            return 400, {"error": "invalid", "message": f"missing or invalid {DELIVERY_HEADER} header"}
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            self.rejected += 1
            return 400, {"error": "invalid", "message": f"body is not JSON: {exc}"}
        if not isinstance(payload, dict) or not isinstance(payload.get("policy"), str):
            self.rejected += 1
            return 400, {"error": "invalid", "message": 'expected a JSON object with a string "policy"'}
        handler = self._handlers.get(payload["policy"])
        if handler is None:
            self.rejected += 1
            known = ", ".join(sorted(self._handlers)) or "none"
            return 422, {"error": "unknown_policy", "message": f"policy {payload['policy']!r} is not handled here "
                                                               f"(handled: {known})"}  # fmt: skip
        with self._lock:
            if delivery in self._applied:
                self.duplicates += 1
                return 200, {"status": "duplicate", "delivery": delivery}
            try:
                result = handler(payload)
            except Exception as exc:
                log.exception("webhook handler for %s failed", payload["policy"])
                return 500, {"error": "handler_failed", "message": f"{type(exc).__name__}: {exc}"}
            self._applied[delivery] = self.clock()
            while len(self._applied) > self.max_remembered:
                self._applied.popitem(last=False)
            self.applied += 1
        answer: dict[str, Any] = {"status": "applied", "delivery": delivery}
        if result is not None:
            answer["result"] = result
        return 200, answer

    # -- adapters -----------------------------------------------------------------------------------------------
    async def asgi(
        self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[dict[str, Any]], Any]
    ) -> None:
        """An ASGI application (mount it at any path; POST only)."""
        if scope["type"] != "http":
            return
        if scope.get("method") != "POST":
            await _asgi_answer(send, 405, {"error": "method_not_allowed", "message": "POST only"})
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = bool(message.get("more_body"))
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        status, answer = await asyncio.to_thread(self.handle, headers, b"".join(chunks))
        await _asgi_answer(send, status, answer)

    def wsgi(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """A WSGI application (POST only)."""
        if environ.get("REQUEST_METHOD") != "POST":
            status, answer = 405, {"error": "method_not_allowed", "message": "POST only"}
        else:
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(length) if length else b""
            headers = {k[5:].replace("_", "-"): v for k, v in environ.items() if k.startswith("HTTP_")}
            status, answer = self.handle(headers, body)
        data = json.dumps(answer).encode()
        start_response(f"{status} {_REASONS.get(status, 'Status')}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])  # fmt: skip
        return [data]


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 405: "Method Not Allowed", 422: "Unprocessable Entity",
            500: "Internal Server Error"}  # fmt: skip


async def _asgi_answer(send: Callable[[dict[str, Any]], Any], status: int, answer: dict[str, Any]) -> None:
    data = json.dumps(answer).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``python -m dsec.integrations.webhook --port P --secret S --log FILE``: a standalone receiver that appends
    every applied policy to FILE as a JSON line (an example runtime, and what the tests run as a real process)."""
    import argparse

    import uvicorn

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--secret", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--policies", default="gradient_accumulation,compression,pause_sampling,memory_quota")
    args = ap.parse_args(argv)
    receiver = WebhookReceiver(args.secret)
    for name in args.policies.split(","):

        @receiver.on(name)
        def record(policy: dict[str, Any]) -> None:
            with open(args.log, "a") as fh:
                fh.write(json.dumps(policy) + "\n")

    uvicorn.run(receiver.asgi, host=args.host, port=args.port, log_level="warning", interface="asgi3")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
