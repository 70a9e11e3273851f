"""Where notifications go: the log, signed webhooks, and an in-memory record.

``WebhookSink`` retries what may succeed later (connection errors, timeouts, 5xx, 429) with
exponential backoff and jitter (``dsec.backoff``: many control planes retrying in lockstep would hammer a
recovering receiver) and fails at once on other 4xx, which mean the request itself is wrong (bad
secret, wrong URL). Every request is signed (``dsec.alerts.signing``); the delivery id stays the same
across retries so a receiver can drop the duplicate when an answer got lost after it acted.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import orjson

from dsec.alerts.model import Severity
from dsec.alerts.router import Notification, Sink
from dsec.alerts.signing import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    Secret,
    sign_all,
)
from dsec.backoff import Backoff
from dsec.errors import TransportError

log = logging.getLogger(__name__)

ALERT_EVENT = "alert"


def _dumps(obj: Any) -> bytes:
    # Alert data is free-form: stringify what JSON cannot hold rather than lose the notification.
    return orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS)


class LogSink:
    """One JSON log line per notification: WARNING for warning/critical, INFO for info."""

    def __init__(self, logger_name: str = "dsec.alerts") -> None:
        if not isinstance(logger_name, str) or not logger_name:
            raise ValueError(f"logger_name={logger_name!r} is invalid: expected a non-empty logger name")
        self.logger = logging.getLogger(logger_name)

    def deliver(self, notification: Notification) -> None:
        level = logging.INFO if notification.severity is Severity.INFO else logging.WARNING
        self.logger.log(level, "alert %s", _dumps(notification.to_dict()).decode())

    def __repr__(self) -> str:
        return f"LogSink({self.logger.name!r})"


class RecordingSink:
    """Keeps the latest ``maxlen`` notifications in memory (for the control plane's API and tests)."""

    def __init__(self, maxlen: int | None = 1000) -> None:
        if maxlen is not None and (isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 1):
            raise ValueError(f"maxlen={maxlen!r} is invalid: expected None or an int >= 1")
        self._items: deque[Notification] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def deliver(self, notification: Notification) -> None:
        with self._lock:
            self._items.append(notification)

    @property
    def notifications(self) -> list[Notification]:
        """A snapshot, oldest first."""
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def __repr__(self) -> str:
        return f"RecordingSink({len(self)} notifications)"


class WebhookError(TransportError, RuntimeError):
    """A webhook delivery failed for good; the message says after how many attempts and why."""


def _number(name: str, value: Any, minimum: float, strict: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected a finite number {'>' if strict else '>='} {minimum:g}")
    return float(value)


def _redact(url: httpx.URL) -> str:
    # Webhook URLs often carry a token in the path or query; logs get scheme, host and port only.
    port = f":{url.port}" if url.port is not None else ""
    return f"{url.scheme}://{url.host}{port}/…"


class WebhookSink:
    """POSTs each notification as signed JSON: ``{"group", "alerts", "count", "sent_at"}``.

    ``secret`` may be a list while rotating (every secret signs; see ``signing``). Up to ``retries``
    retries follow the first attempt; ``close()`` interrupts a pending backoff.
    """

    def __init__(
        self,
        url: str,
        secret: Secret | Sequence[Secret],
        timeout_s: float = 2.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        try:
            parsed = httpx.URL(url) if isinstance(url, str) else None
        except httpx.InvalidURL:
            parsed = None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"url={url!r} is invalid: expected an http:// or https:// URL with a host")
        secrets = [secret] if isinstance(secret, (str, bytes)) else list(secret)
        if not secrets or not all(isinstance(s, (str, bytes)) and s for s in secrets):
            raise ValueError("secret is invalid: expected a non-empty string (or a list of them while rotating)")
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 20:
            raise ValueError(f"retries={retries!r} is invalid: expected an int in 0..20")
        self.url = url
        self._secrets = secrets
        self.timeout_s = _number("timeout_s", timeout_s, 0, strict=True)
        self.retries = retries
        self.backoff_s = _number("backoff_s", backoff_s, 0, strict=False)
        self.max_backoff_s = _number("max_backoff_s", max_backoff_s, 0, strict=False)
        self._backoff = Backoff(initial_s=self.backoff_s, factor=2.0, max_s=self.max_backoff_s)
        self._where = _redact(parsed)
        self._rng = rng or random.Random()
        self._closed = threading.Event()
        self._client = httpx.Client(timeout=self.timeout_s, headers={"User-Agent": "dsec-alerts"})
        self.attempts = 0  # HTTP requests made, retries included

    def body(self, notification: Notification) -> bytes:
        return _dumps(
            {
                "group": {"pool": notification.group[0], "name": notification.group[1]},
                "severity": notification.severity.value,
                "alerts": [a.to_dict() for a in notification.alerts],
                "count": notification.count,
                "first_seen": notification.first_seen,
                "sent_at": notification.at,
            }
        )

    def deliver(self, notification: Notification) -> None:
        body = self.body(notification)
        delivery = uuid.uuid4().hex
        last_error = "no attempt made"
        for attempt in range(self.retries + 1):
            if self._closed.is_set():
                raise WebhookError(f"webhook {self._where}: sink closed after {attempt} attempt(s): {last_error}")
            retry_after: float | None = None
            timestamp = int(time.time())  # wall clock: the receiver compares it with its own
            headers = {
                "Content-Type": "application/json",
                TIMESTAMP_HEADER: str(timestamp),
                SIGNATURE_HEADER: sign_all(self._secrets, timestamp, body),
                DELIVERY_HEADER: delivery,
                EVENT_HEADER: ALERT_EVENT,
            }
            self.attempts += 1
            try:
                response = self._client.post(self.url, content=body, headers=headers)
            except httpx.TransportError as exc:  # refused, reset, timed out: the receiver may come back
                last_error = f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if 200 <= status < 300:
                    return
                if status != 429 and status < 500:
                    raise WebhookError(
                        f"webhook {self._where} answered HTTP {status}, not retried: {response.text[:200]!r}"
                    )
                last_error = f"HTTP {status}"
                retry_after = _retry_after(response)
            if attempt == self.retries:
                break
            delay = self._backoff.delay(attempt, self._rng)
            if retry_after is not None:
                delay = max(delay, min(retry_after, self.max_backoff_s))
            if self._closed.wait(delay):
                raise WebhookError(f"webhook {self._where}: sink closed while backing off: {last_error}")
        raise WebhookError(f"webhook {self._where} failed after {self.retries + 1} attempt(s): {last_error}")

    def close(self) -> None:
        self._closed.set()
        self._client.close()

    def __repr__(self) -> str:
        return f"WebhookSink({self._where})"


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After", "")
    try:
        seconds = float(value)
    except ValueError:
        return None  # absent, or an HTTP date: our own backoff applies
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


_WEBHOOK_FIELDS = ("url", "secret", "secret_env", "timeout_s", "retries", "backoff_s", "max_backoff_s")


def sinks_from_config(spec: Mapping[str, Any], where: str = "alerts") -> list[Sink]:
    """Build sinks from ``{"log": true, "webhooks": [{"url": ..., "secret": ...}]}``.

    ``log`` may also be ``{"logger": name}``. A webhook takes ``secret`` or ``secret_env`` (the name of
    an environment variable holding it, so config files need not contain secrets) plus the optional
    ``WebhookSink`` settings. Errors are ``ValueError`` naming the field, e.g. ``alerts.webhooks[0].url``.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}={spec!r} is invalid: expected a mapping with 'log' and/or 'webhooks'")
    unknown = sorted(set(spec) - {"log", "webhooks"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected 'log', 'webhooks'")
    sinks: list[Sink] = []
    log_spec = spec.get("log", False)
    if log_spec is True:
        sinks.append(LogSink())
    elif isinstance(log_spec, Mapping):
        extra = sorted(set(log_spec) - {"logger"})
        if extra:
            raise ValueError(f"{where}.log: unknown field(s) {extra}; expected 'logger'")
        try:
            sinks.append(LogSink(log_spec.get("logger", "dsec.alerts")))
        except ValueError as exc:
            raise ValueError(f"{where}.log.{exc}") from None
    elif log_spec not in (False, None):
        raise ValueError(f"{where}.log={log_spec!r} is invalid: expected true, false or {{logger: name}}")
    hooks = spec.get("webhooks") or []
    if isinstance(hooks, (str, bytes, Mapping)) or not isinstance(hooks, Sequence):
        raise ValueError(f"{where}.webhooks={hooks!r} is invalid: expected a list of {{url, secret}} mappings")
    for i, hook in enumerate(hooks):
        at = f"{where}.webhooks[{i}]"
        if not isinstance(hook, Mapping):
            raise ValueError(f"{at}={hook!r} is invalid: expected a mapping with 'url' and 'secret'")
        extra = sorted(set(hook) - set(_WEBHOOK_FIELDS))
        if extra:
            raise ValueError(f"{at}: unknown field(s) {extra}; expected some of {list(_WEBHOOK_FIELDS)}")
        if "url" not in hook:
            raise ValueError(f"{at}.url is missing")
        opts = {k: hook[k] for k in ("timeout_s", "retries", "backoff_s", "max_backoff_s") if k in hook}
        secret = _webhook_secret(hook, at)
        try:
            sinks.append(WebhookSink(hook["url"], secret, **opts))
        except ValueError as exc:
            raise ValueError(f"{at}.{exc}") from None
    return sinks


def _webhook_secret(hook: Mapping[str, Any], at: str) -> Secret | list[Secret]:
    if ("secret" in hook) == ("secret_env" in hook):
        raise ValueError(f"{at}: give exactly one of 'secret' and 'secret_env'")
    if "secret_env" in hook:
        name = hook["secret_env"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"{at}.secret_env={name!r} is invalid: expected an environment variable name")
        value = os.environ.get(name, "")
        if not value:
            raise ValueError(f"{at}.secret_env: environment variable {name} is unset or empty")
        return value
    secret = hook["secret"]
    if isinstance(secret, str) and secret:
        return secret
    if isinstance(secret, list) and secret and all(isinstance(s, str) and s for s in secret):
        return list(secret)
    # Never echo the value: it is a secret, even when malformed.
    raise ValueError(f"{at}.secret is invalid: expected a non-empty string or a list of them")
