"""The webhook protocol for agent runtimes, end to end: a real control plane pushes signed policies to a real
receiver process (`python -m dsec.integrations.webhook`) on loopback — delivery, retry across receiver downtime,
rejected bad signatures and stale timestamps, no double application on redelivery, permanent refusals not retried,
and the registration / report API with its bad-input answers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Harness, make_settings, wait_for
from dsec.alerts.signing import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from dsec.client import ApiError, Client
from dsec.control.runtimes import RetryPolicy
from dsec.control.server import free_port

SECRET = "runtime-secret-0123456789"
FAST = RetryPolicy(max_attempts=30, base_s=0.1, max_s=0.4, timeout_s=1.0)


class Receiver:
    """The reference receiver as its own process; start/stop at will (downtime), same port and log."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/dsec"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "dsec.integrations.webhook", "--port", str(self.port), "--secret", SECRET,
               "--log", str(self.log)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(up, timeout=30, what="the receiver listening")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def applied(self) -> list[dict[str, Any]]:
        return [json.loads(ln) for ln in self.log.read_text().splitlines()] if self.log.exists() else []


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(free_port(), tmp_path / "applied.jsonl")
    yield r
    r.stop()


@pytest.fixture
def cp(server_factory: Callable[..., Harness], tmp_path: Path) -> Harness:
    # The receivers here are on loopback, and runtimes register with a pool token: both must be allowed explicitly.
    settings = make_settings(
        tmp_path / "cp", webhook_retry=FAST, webhook_allow_private=True, webhook_allowed_hosts=("127.0.0.1",)
    )
    return server_factory(settings=settings, pools=True)


def register(cp: Harness, receiver: Receiver, **over: Any) -> dict[str, Any]:
    c = cp.client(cp.pool_tokens["pool-a"])
    spec = {"name": "dify-1", "type": "dify-agent-runtime", "callback_url": receiver.url, "secret": SECRET, **over}
    return c.register_runtime(**spec)


def delivered(cp: Harness, runtime_id: str, n: int = 1) -> list[dict[str, Any]]:
    return [d for d in cp.admin.deliveries(runtime_id) if d["status"] != "pending"] if n else []


def test_register_report_and_a_policy_delivered_signed(cp: Harness, receiver: Receiver) -> None:
    receiver.start()
    rt = register(cp, receiver)
    assert rt["pool"] == "pool-a" and rt["runtime_token"].startswith("dsr_") and "secret" not in rt
    answer = cp.client(rt["runtime_token"]).runtime_report(
        rt["id"], concurrent_agents=12, avg_llm_latency_ms=850.5, function_calling=True
    )
    assert answer == {"ok": True, "pending_deliveries": 0}
    (listed,) = cp.admin.request("GET", "/v1/runtimes")["items"]
    assert listed["report"] == {"concurrent_agents": 12, "avg_llm_latency_ms": 850.5, "function_calling": True}
    d = cp.admin.push_policy(rt["id"], "gradient_accumulation", steps=4, target_gpu="gpu-003a")
    assert d["status"] == "pending"
    wait_for(lambda: delivered(cp, rt["id"]), timeout=10, what="the delivery")
    (log,) = cp.admin.deliveries(rt["id"])
    assert log["status"] == "delivered" and [a["status"] for a in log["attempts"]] == [200]
    assert log["answer"]["status"] == "applied"
    assert receiver.applied() == [{"policy": "gradient_accumulation", "steps": 4, "target_gpu": "gpu-003a"}]
    wait_for(lambda: cp.admin.all_events(types=["webhook"]), timeout=5, what="the webhook event")
    (ev,) = cp.admin.all_events(types=["webhook"])
    assert ev["data"]["status"] == "delivered" and ev["data"]["attempts"] == 1 and ev["pool"] == "pool-a"


def test_retries_through_receiver_downtime_and_applies_once(cp: Harness, receiver: Receiver) -> None:
    rt = register(cp, receiver)  # the receiver is not running yet
    d = cp.admin.push_policy(rt["id"], "compression", bits=4)
    wait_for(lambda: len(cp.admin.deliveries(rt["id"])[0]["attempts"]) >= 3, timeout=10, what="failed attempts")
    log = cp.admin.deliveries(rt["id"])[0]
    assert log["status"] == "pending" and all(a["status"] is None and a["error"] for a in log["attempts"])
    receiver.start()
    wait_for(lambda: delivered(cp, rt["id"]), timeout=15, what="delivery after the receiver came back")
    log = cp.admin.deliveries(rt["id"])[0]
    assert log["id"] == d["id"] and log["status"] == "delivered" and log["attempts"][-1]["status"] == 200
    assert receiver.applied() == [{"policy": "compression", "bits": 4}]


def _signed(body: bytes, ts: int, secret: str = SECRET, delivery: str | None = None) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: str(ts),
        SIGNATURE_HEADER: sign(secret, ts, body),
        DELIVERY_HEADER: delivery or uuid.uuid4().hex,
    }


def test_receiver_rejects_bad_signatures_and_stale_timestamps(receiver: Receiver) -> None:
    receiver.start()
    body = json.dumps({"policy": "pause_sampling"}).encode()
    now = int(time.time())
    with httpx.Client(timeout=5) as http:
        r = http.post(receiver.url, content=body, headers=_signed(body, now, secret="another-secret-0123456789"))
        assert r.status_code == 401 and "signature" in r.json()["message"]
        tampered = _signed(body, now)
        r = http.post(receiver.url, content=body.replace(b"pause", b"pauze"), headers=tampered)
        assert r.status_code == 401
        r = http.post(receiver.url, content=body, headers=_signed(body, now - 3600))
        assert r.status_code == 401 and "stale" in r.json()["message"]
        r = http.post(receiver.url, content=body, headers={k: v for k, v in _signed(body, now).items()
                                                           if k != SIGNATURE_HEADER})  # fmt: skip
        assert r.status_code == 401
    assert receiver.applied() == []


def test_redelivery_is_not_applied_twice(receiver: Receiver) -> None:
    receiver.start()
    body = json.dumps({"policy": "memory_quota", "gb": 10}).encode()
    headers = _signed(body, int(time.time()), delivery="d-1")
    with httpx.Client(timeout=5) as http:
        first = http.post(receiver.url, content=body, headers=headers)
        again = http.post(receiver.url, content=body, headers=headers)
        other = http.post(receiver.url, content=body, headers=_signed(body, int(time.time()), delivery="d-2"))
    assert first.json()["status"] == "applied" and again.json()["status"] == "duplicate"
    assert other.json()["status"] == "applied"
    assert receiver.applied() == [{"policy": "memory_quota", "gb": 10}] * 2  # d-1 once, d-2 once


def test_a_permanent_refusal_is_not_retried(cp: Harness, receiver: Receiver) -> None:
    receiver.start()
    rt = register(cp, receiver)
    cp.admin.push_policy(rt["id"], "no_such_policy", level=1)
    wait_for(lambda: delivered(cp, rt["id"]), timeout=10, what="the refusal")
    (log,) = cp.admin.deliveries(rt["id"])
    assert log["status"] == "failed" and [a["status"] for a in log["attempts"]] == [422]
    assert log["answer"]["error"] == "unknown_policy"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"secret": "short"}, "secret"),
        ({"callback_url": "ftp://x/y"}, "callback_url"),
        ({"type": ""}, "type"),
        ({"pool": "pool-b"}, "pool"),
    ],
)
def test_registration_bad_input(cp: Harness, receiver: Receiver, spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as info:
        register(cp, receiver, **spec)
    assert info.value.status in (403, 422) and info.value.field == field


def test_report_and_push_bad_input(cp: Harness, receiver: Receiver) -> None:
    rt = register(cp, receiver)
    with pytest.raises(ApiError) as info:
        cp.client(cp.pool_tokens["pool-a"]).runtime_report(rt["id"], concurrent_agents=1, avg_llm_latency_ms=1.0,
                                                          function_calling=False)  # fmt: skip
    assert info.value.status == 403
    with pytest.raises(ApiError) as info:
        cp.client(rt["runtime_token"]).runtime_report(rt["id"], concurrent_agents=-1, avg_llm_latency_ms=1.0,
                                                      function_calling=False)  # fmt: skip
    assert info.value.status == 422 and info.value.field == "concurrent_agents"
    with pytest.raises(ApiError) as info:
        cp.admin.push_policy("rt-unknown", "compression")
    assert info.value.status == 404 and info.value.field == "runtime_id"
    with pytest.raises(ApiError) as info:
        cp.admin.request("POST", f"/v1/runtimes/{rt['id']}/policies", json={"policy": "x", "nested": {"a": 1}})
    assert info.value.status == 422
    with Client(cp.url) as anonymous, pytest.raises(ApiError) as info:
        anonymous.push_policy(rt["id"], "compression")
    assert info.value.status == 401
