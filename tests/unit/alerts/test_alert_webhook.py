"""WebhookSink against a real HTTP receiver on 127.0.0.1 that checks signatures with ``verify``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from conftest import http_receiver, wait_for
from dsec.alerts import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    Alert,
    AlertGrouper,
    AlertRouter,
    LogSink,
    Notification,
    Severity,
    SignatureError,
    WebhookError,
    WebhookSink,
    sinks_from_config,
    verify,
)

SECRET = "receiver-secret"


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    status: int
    error: str = ""


@dataclass
class Receiver:
    """Answers scripted statuses (then 200) to correctly signed POSTs, 401 to the rest; records all."""

    secrets: list[str] = field(default_factory=lambda: [SECRET])
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def handle(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        try:
            verify(self.secrets, headers.get(TIMESTAMP_HEADER), headers.get(SIGNATURE_HEADER), body, now=time.time())
        except SignatureError as exc:
            with self.lock:
                self.requests.append(Received(headers, body, 401, str(exc)))
            return 401, {}, str(exc).encode()
        with self.lock:
            status, extra = self.script.pop(0) if self.script else (200, {})
            self.requests.append(Received(headers, body, status))
        return status, extra, b"bad request" if status == 400 else b""


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rcv = Receiver()
    with http_receiver(rcv.handle, "/hooks/dsec") as url:
        rcv.url = url
        yield rcv


@pytest.fixture
def note() -> Notification:
    g = AlertGrouper(group_wait_s=0)
    g.add(
        Alert("episode_stuck", Severity.CRITICAL, ts=1.0, pool="pool-a", worker_id="w-1", data={"resets": 3}), now=1.0
    )
    g.add(Alert("episode_stuck", Severity.CRITICAL, ts=1.5, pool="pool-a", worker_id="w-1"), now=1.5)
    [n] = g.due(2.0)
    return n


def make_sink(url: str, secret: str | list[str] = SECRET, **kw: Any) -> WebhookSink:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("max_backoff_s", 0.05)
    return WebhookSink(url, secret, **kw)


def test_delivers_a_signed_json_notification(receiver: Receiver, note: Notification) -> None:
    sink = make_sink(receiver.url)
    try:
        sink.deliver(note)
    finally:
        sink.close()
    [req] = receiver.requests
    assert req.status == 200
    body = orjson.loads(req.body)
    assert body["group"] == {"pool": "pool-a", "name": "episode_stuck"}
    assert body["count"] == 1 and body["sent_at"] == 2.0
    assert [a["ts"] for a in body["alerts"]] == [1.5]
    assert req.headers[EVENT_HEADER] == "alert"
    assert len(req.headers[DELIVERY_HEADER]) == 32 and int(req.headers[DELIVERY_HEADER], 16) >= 0
    assert req.headers["Content-Type"] == "application/json"


def test_retries_503_twice_then_succeeds_with_one_delivery_id(receiver: Receiver, note: Notification) -> None:
    receiver.script = [(503, {}), (503, {})]
    sink = make_sink(receiver.url)
    try:
        sink.deliver(note)
    finally:
        sink.close()
    assert [r.status for r in receiver.requests] == [503, 503, 200]
    assert len({r.headers[DELIVERY_HEADER] for r in receiver.requests}) == 1
    assert sink.attempts == 3


def test_429_honours_retry_after_capped_by_max_backoff(receiver: Receiver, note: Notification) -> None:
    receiver.script = [(429, {"Retry-After": "0.2"})]
    sink = make_sink(receiver.url, max_backoff_s=0.3)
    start = time.monotonic()
    try:
        sink.deliver(note)
    finally:
        sink.close()
    assert time.monotonic() - start >= 0.2
    assert [r.status for r in receiver.requests] == [429, 200]


class RecordedWaits(threading.Event):
    """The sink's close event with every backoff wait it asks for recorded; a wait longer than ``clip_s`` is cut
    short, so a sink that ignores its cap fails the assertion instead of sleeping for an hour."""

    def __init__(self, clip_s: float = 2.0) -> None:
        super().__init__()
        self.clip_s = clip_s
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waits.append(timeout)
        return super().wait(min(timeout, self.clip_s))


@pytest.mark.parametrize("status", [429, 503])
def test_a_huge_retry_after_is_capped_by_max_backoff(receiver: Receiver, note: Notification, status: int) -> None:
    receiver.script = [(status, {"Retry-After": "3600"}), (status, {"Retry-After": "86400"})]
    sink = make_sink(receiver.url, backoff_s=0.01, max_backoff_s=0.05)
    sink._closed = waits = RecordedWaits()
    try:
        sink.deliver(note)
    finally:
        sink.close()
    assert [r.status for r in receiver.requests] == [status, status, 200]
    # The receiver asked for an hour and a day: the sink waits its cap (the Retry-After still lifts the backoff
    # of 0.01-0.02 s up to it).
    assert waits.waits == [pytest.approx(0.05), pytest.approx(0.05)]


def test_gives_up_after_the_retries(receiver: Receiver, note: Notification) -> None:
    receiver.script = [(500, {})] * 5
    sink = make_sink(receiver.url, retries=2)
    try:
        with pytest.raises(WebhookError, match=r"failed after 3 attempt\(s\): HTTP 500"):
            sink.deliver(note)
    finally:
        sink.close()
    assert len(receiver.requests) == 3


def test_400_fails_at_once_without_retry(receiver: Receiver, note: Notification) -> None:
    receiver.script = [(400, {})]
    sink = make_sink(receiver.url)
    try:
        with pytest.raises(WebhookError, match=r"answered HTTP 400, not retried: 'bad request'"):
            sink.deliver(note)
    finally:
        sink.close()
    assert len(receiver.requests) == 1


def test_a_wrong_secret_is_rejected_by_the_receiver(receiver: Receiver, note: Notification) -> None:
    sink = make_sink(receiver.url, secret="not-the-secret")
    try:
        with pytest.raises(WebhookError, match="HTTP 401, not retried"):
            sink.deliver(note)
    finally:
        sink.close()
    [req] = receiver.requests
    assert "X-DSec-Signature mismatch" in req.error


def test_rotation_sender_signs_with_old_and_new_secret(receiver: Receiver, note: Notification) -> None:
    sink = make_sink(receiver.url, secret=["old-secret", SECRET])
    try:
        sink.deliver(note)
    finally:
        sink.close()
    [req] = receiver.requests
    assert req.status == 200 and req.headers[SIGNATURE_HEADER].count("v1=") == 2


def test_connection_errors_are_retried_then_reported(note: Notification) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = make_sink(f"http://127.0.0.1:{port}/hook?token=xyz", retries=2)
    try:
        with pytest.raises(WebhookError, match=r"127\.0\.0\.1:\d+/… failed after 3 attempt\(s\): ConnectError") as info:
            sink.deliver(note)
    finally:
        sink.close()
    assert "xyz" not in str(info.value)  # the URL's token is not in errors or logs
    assert sink.attempts == 3


def test_router_to_webhook_end_to_end(receiver: Receiver) -> None:
    with AlertRouter([make_sink(receiver.url)], group_wait_s=0.05, group_interval_s=0.1) as router:
        router.submit(Alert("oom", Severity.CRITICAL, pool="pool-b", worker_id="w-9"))
        wait_for(lambda: receiver.requests, timeout=5, what="the webhook delivery")
        wait_for(lambda: router.delivered == 1, timeout=5)
    body = orjson.loads(receiver.requests[0].body)
    assert body["group"] == {"pool": "pool-b", "name": "oom"} and body["alerts"][0]["worker_id"] == "w-9"


# -- configuration ------------------------------------------------------------------------------------
def test_sinks_from_config_builds_log_and_webhooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOK_SECRET", "from-env")
    sinks = sinks_from_config(
        {
            "log": True,
            "webhooks": [
                {"url": "https://hooks.example/a", "secret": "s", "retries": 1, "timeout_s": 1},
                {"url": "http://127.0.0.1:9/b", "secret_env": "HOOK_SECRET"},
            ],
        }
    )
    try:
        assert [type(s) for s in sinks] == [LogSink, WebhookSink, WebhookSink]
        assert isinstance(sinks[1], WebhookSink) and sinks[1].retries == 1 and sinks[1].timeout_s == 1.0
    finally:
        for s in sinks:
            if isinstance(s, WebhookSink):
                s.close()
    assert sinks_from_config({}) == []
    assert isinstance(sinks_from_config({"log": {"logger": "x.alerts"}})[0], LogSink)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([], r"alerts=\[\] is invalid"),
        ({"slack": {}}, r"alerts: unknown field\(s\) \['slack'\]"),
        ({"log": "yes"}, r"alerts\.log='yes' is invalid"),
        ({"log": {"name": "x"}}, r"alerts\.log: unknown field\(s\) \['name'\]"),
        ({"webhooks": "http://x"}, r"alerts\.webhooks='http://x' is invalid"),
        ({"webhooks": ["http://x"]}, r"alerts\.webhooks\[0\]='http://x' is invalid"),
        ({"webhooks": [{"secret": "s"}]}, r"alerts\.webhooks\[0\]\.url is missing"),
        ({"webhooks": [{"url": "ftp://x", "secret": "s"}]}, r"alerts\.webhooks\[0\]\.url='ftp://x' is invalid"),
        ({"webhooks": [{"url": "http://x"}]}, r"alerts\.webhooks\[0\]: give exactly one of 'secret'"),
        ({"webhooks": [{"url": "http://x", "secret": ""}]}, r"alerts\.webhooks\[0\]\.secret is invalid"),
        ({"webhooks": [{"url": "http://x", "secret_env": "NOPE_UNSET"}]}, r"environment variable NOPE_UNSET"),
        ({"webhooks": [{"url": "http://x", "secret": "s", "timeout_s": -1}]}, r"webhooks\[0\]\.timeout_s=-1 is"),
        ({"webhooks": [{"url": "http://x", "secret": "s", "retries": 1.5}]}, r"webhooks\[0\]\.retries=1\.5 is"),
        ({"webhooks": [{"url": "http://x", "secret": "s", "verify": False}]}, r"unknown field\(s\) \['verify'\]"),
    ],
)
def test_sinks_from_config_names_the_bad_field(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sinks_from_config(spec)
