"""AlertRouter's thread with real sinks: grouping in real time, logging, failures, queue bounds, close."""

from __future__ import annotations

import logging
import socket
import threading

import orjson
import pytest

from conftest import wait_for
from dsec.alerts import Alert, AlertRouter, LogSink, Notification, RecordingSink, Severity, WebhookSink


def alert(worker: str = "w-1", name: str = "episode_stuck", severity: Severity = Severity.WARNING) -> Alert:
    return Alert(name, severity, pool="pool-a", worker_id=worker, summary=f"{name} on {worker}")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GateSink:
    """Holds the router thread inside ``deliver`` until released (to fill the queue deterministically)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def deliver(self, notification: Notification) -> None:
        self.entered.set()
        self.release.wait(5)


def test_router_batches_a_burst_into_one_notification() -> None:
    rec = RecordingSink()
    with AlertRouter([rec], group_wait_s=0.1, group_interval_s=0.3, repeat_interval_s=60) as router:
        for w in ("w-1", "w-2", "w-3"):
            router.submit(alert(w))
        [note] = wait_for(lambda: rec.notifications, timeout=5, what="the batched notification")
        assert [a.worker_id for a in note.alerts] == ["w-1", "w-2", "w-3"]
        router.submit(alert("w-4"))
        wait_for(lambda: len(rec) == 2, timeout=5, what="the second notification")
        second = rec.notifications[1]
        assert second.at - note.at >= 0.3
        assert [a.worker_id for a in second.alerts] == ["w-4"]
        assert router.delivered == 2 and router.failed == 0
    assert not router.alive()


def test_repeats_are_counted_not_sent_and_close_flushes_pending() -> None:
    rec = RecordingSink()
    router = AlertRouter([rec], group_wait_s=30, group_interval_s=30, repeat_interval_s=300)
    for _ in range(5):
        router.submit(alert("w-flap"))
    assert rec.notifications == []  # group_wait is 30 s: nothing goes out on its own yet
    router.close()
    [note] = rec.notifications
    assert len(note.alerts) == 1 and note.count == 4
    assert router.suppressed == 4 and router.delivered == 1
    router.submit(alert("late"))
    assert router.dropped == 1
    router.close()  # idempotent


def test_log_sink_writes_one_json_line_at_the_severity_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dsec.alerts")
    with AlertRouter([LogSink()], group_wait_s=0, group_interval_s=0.1) as router:
        router.submit(alert("w-1", name="oom", severity=Severity.CRITICAL))
        router.submit(alert("w-1", name="slow_env", severity=Severity.INFO))
        wait_for(lambda: len([r for r in caplog.records if r.name == "dsec.alerts"]) == 2, timeout=5)
    records = {r.levelno: r for r in caplog.records if r.name == "dsec.alerts"}
    assert set(records) == {logging.WARNING, logging.INFO}
    critical = orjson.loads(records[logging.WARNING].getMessage().removeprefix("alert "))
    assert critical["group"] == {"pool": "pool-a", "name": "oom"}
    assert critical["severity"] == "critical"
    assert critical["alerts"][0]["summary"] == "oom on w-1"
    info = orjson.loads(records[logging.INFO].getMessage().removeprefix("alert "))
    assert info["alerts"][0]["name"] == "slow_env"


def test_a_failing_sink_is_logged_and_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    rec = RecordingSink()
    dead = WebhookSink(f"http://127.0.0.1:{closed_port()}/hook", "s3cret", retries=0)
    with AlertRouter([dead, rec], group_wait_s=0, group_interval_s=0.1) as router:
        router.submit(alert("w-1"))
        wait_for(lambda: len(rec) == 1, timeout=5, what="delivery to the healthy sink")
        wait_for(lambda: router.failed == 1, timeout=5, what="the failure to be counted")
        assert router.delivered == 1
    assert "alert sink WebhookSink(http://127.0.0.1:" in caplog.text
    assert "failed after 1 attempt(s): ConnectError" in caplog.text


def test_a_full_queue_drops_the_oldest_alerts_and_counts_them() -> None:
    gate, rec = GateSink(), RecordingSink()
    with AlertRouter([gate, rec], group_wait_s=0, group_interval_s=0, max_queue=2) as router:
        router.submit(alert(name="a0"))
        assert gate.entered.wait(5), "the router thread never delivered"
        for i in range(1, 6):  # the thread is stuck in the gate: these queue up, a bounded queue
            router.submit(alert(name=f"a{i}"))
        assert router.dropped == 3
        gate.release.set()
        wait_for(lambda: len(rec) == 3, timeout=5, what="the surviving alerts")
    assert [n.group[1] for n in rec.notifications] == ["a0", "a4", "a5"]


def test_router_rejects_bad_settings_naming_them() -> None:
    with pytest.raises(ValueError, match="max_queue=0"):
        AlertRouter([], max_queue=0)
    with pytest.raises(ValueError, match="group_interval_s=-1"):
        AlertRouter([], group_interval_s=-1)
