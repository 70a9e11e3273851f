"""Runtime callbacks and blocking work, against a real control plane and real receivers on loopback (docs/security.md,
findings 4, 5 and 10's "compile on the loop"). No request leaves loopback: the destinations that must be refused are
refused before anything is sent, and the test receivers count what reaches them."""

from __future__ import annotations

import json
import sqlite3
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, http_receiver, make_settings, wait_for
from dsec.client import ApiError, Client
from dsec.control.app import create_app
from dsec.control.runtimes import RetryPolicy
from dsec.control.server import ServerThread

SECRET = "runtime-secret-0123456789"
FAST = RetryPolicy(max_attempts=3, base_s=0.05, max_s=0.1, timeout_s=2.0)


@contextmanager
def receiver(body: bytes = b'{"status": "applied"}') -> Iterator[tuple[str, list[bytes]]]:
    """A loopback receiver answering every POST 200 with ``body``; yields its port and the bodies it got."""
    got: list[bytes] = []

    def handle(_headers: dict[str, str], payload: bytes) -> tuple[int, dict[str, str], bytes]:
        got.append(payload)
        return 200, {"Content-Type": "application/json"}, body

    with http_receiver(handle) as url:
        yield url.split(":")[2].split("/")[0], got


def register(c: Client, url: str, **over: Any) -> dict[str, Any]:
    return c.register_runtime(**{"name": "rt", "type": "dify", "callback_url": url, "secret": SECRET, **over})


def finished(h: Harness, runtime_id: str) -> list[dict[str, Any]]:
    return [d for d in h.admin.deliveries(runtime_id) if d["status"] != "pending"]


# -- finding 4: who may make the control plane send requests, and where ----------------------------------------------
def test_a_pool_token_registers_runtimes_only_for_allow_listed_hosts(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = server_factory(settings=make_settings(tmp_path / "a"), pools=True)
    with pytest.raises(ApiError) as info:
        register(h.client(h.pool_tokens["pool-a"]), "https://agents.example.com/hook")
    assert info.value.status == 403 and info.value.field == "callback_url"
    assert h.admin.request("GET", "/v1/runtimes")["items"] == []
    assert register(h.admin, "https://agents.example.com/hook", pool="pool-a")["pool"] == "pool-a"
    allowed = server_factory(
        settings=make_settings(tmp_path / "b", webhook_allowed_hosts=("*.example.com",)), pools=True
    )
    assert register(allowed.client(allowed.pool_tokens["pool-a"]), "https://agents.example.com/h")["pool"] == "pool-a"
    with pytest.raises(ApiError) as info:
        register(allowed.client(allowed.pool_tokens["pool-a"]), "https://example.org/h")
    assert info.value.status == 403


@pytest.mark.parametrize(
    "url",
    [
        "http://user:pw@agents.example.com/hook",
        "http://127.0.0.1:9/hook",
        "http://[::1]:9/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://10.1.2.3/hook",
        "http://[::ffff:127.0.0.1]/hook",
    ],
)
def test_callback_urls_hiding_or_naming_private_hosts_are_refused_at_registration(server: Harness, url: str) -> None:
    with pytest.raises(ApiError) as info:
        register(server.admin, url)
    assert info.value.status == 422 and info.value.field == "callback_url"
    assert server.admin.request("GET", "/v1/runtimes")["items"] == []


def test_private_destinations_are_refused_at_send_time(server_factory: Callable[..., Harness], tmp_path: Path) -> None:
    h = server_factory(settings=make_settings(tmp_path / "a", webhook_retry=FAST), pools=True)
    with receiver() as (port, got):
        # Names, not addresses: they pass registration and resolve to loopback when it is time to send.
        ids = [register(h.admin, f"http://{host}:{port}/hook")["id"] for host in ("localhost", "2130706433")]
        for rid in ids:
            h.admin.push_policy(rid, "compression", bits=4)
        for rid in ids:
            (d,) = wait_for(lambda rid=rid: finished(h, rid), what="the refusal")
            assert d["status"] == "failed" and len(d["attempts"]) == 1, d
            assert d["attempts"][0]["status"] is None and d["attempts"][0]["error"].startswith("refused: ")
            assert "127.0.0.1" in d["attempts"][0]["error"]
        assert got == [], "nothing may reach a loopback receiver"
        # Allowed explicitly (tests, the demo, a receiver on the same host): delivered.
        ok = server_factory(settings=make_settings(tmp_path / "b", webhook_retry=FAST, webhook_allow_private=True))
        rid = register(ok.admin, f"http://localhost:{port}/hook")["id"]
        ok.admin.push_policy(rid, "compression", bits=4)
        (d,) = wait_for(lambda: finished(ok, rid), what="the delivery")
        assert d["status"] == "delivered" and json.loads(got[0]) == {"policy": "compression", "bits": 4}


def test_answers_are_read_up_to_a_cap_and_logged_short(server_factory: Callable[..., Harness], tmp_path: Path) -> None:
    h = server_factory(settings=make_settings(tmp_path / "a", webhook_retry=FAST, webhook_allow_private=True))
    huge = json.dumps({"pad": "x" * (1 << 20)}).encode()
    with receiver(huge) as (port, _got):
        rid = register(h.admin, f"http://127.0.0.1:{port}/hook")["id"]
        h.admin.push_policy(rid, "compression", bits=4)
        (d,) = wait_for(lambda: finished(h, rid), what="the delivery")
    (attempt,) = d["attempts"]
    assert d["status"] == "delivered" and attempt["truncated"] is True
    assert attempt["response_bytes"] == 64 * 1024
    assert isinstance(d["answer"], str) and len(d["answer"]) < 1000 and d["answer"].startswith('{"pad": "xxx')


def test_the_delivery_log_is_bounded(server_factory: Callable[..., Harness], tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "a", webhook_retry=FAST, webhook_allow_private=True, webhook_deliveries_kept=3)
    h = server_factory(settings=settings)
    with receiver() as (port, got):
        rid = register(h.admin, f"http://127.0.0.1:{port}/hook")["id"]
        pushed = [h.admin.push_policy(rid, "compression", bits=i)["id"] for i in range(6)]
        wait_for(lambda: len(got) == 6, what="six deliveries")
        wait_for(lambda: all(d["status"] == "delivered" for d in h.admin.deliveries(rid)), what="their outcomes")
    assert [d["id"] for d in h.admin.deliveries(rid)] == pushed[-3:]


# -- finding 5 (and 10): nothing blocking on the event loop ----------------------------------------------------------
BLOCKING_PY = frozenset({"compile_policies", "write_atomic", "load_marked"})


@contextmanager
def loop_watch(app: Any) -> Iterator[tuple[ServerThread, list[str]]]:
    """Serve ``app`` on a thread whose every call is watched: disk syncs, SQLite calls and policy compilation made on
    the event-loop thread itself are collected (worker threads, where they belong, are not watched)."""
    hits: list[str] = []

    def watch(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            name = getattr(arg, "__name__", "")
            if name in ("fsync", "fdatasync") or isinstance(owner, (sqlite3.Connection, sqlite3.Cursor)):
                hits.append(f"{name} on {type(owner).__name__}")
        elif event == "call" and frame.f_code.co_name in BLOCKING_PY:
            hits.append(frame.f_code.co_name)

    threading.setprofile(watch)
    try:
        server = ServerThread(app)  # only this thread starts while the hook is set
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    try:
        yield server, hits
    finally:
        server.close()


def test_no_disk_sync_store_call_or_policy_compile_on_the_event_loop(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "h", webhook_allow_private=True)
    with loop_watch(create_app(settings)) as (srv, hits), Client(srv.url, token=settings.admin_token) as admin:
        admin.put_pool("pool-a")
        token = admin.create_token("pool-a")
        rt = register(admin, "http://127.0.0.1:9/hook", pool="pool-a")
        for i in range(3):
            admin.runtime_report(rt["id"], token=rt["runtime_token"], concurrent_agents=i, avg_llm_latency_ms=5.0,
                                 function_calling=True)  # fmt: skip
        admin.put_policies(
            "policies:\n  - name: r\n    when: dsec_workers_lost > 100\n    then: [{knob: gpu_quota, by: 1}]\n"
        )
        reg = admin.register("pool-a", token=token)
        admin.heartbeat(reg["worker_id"], 1, events=[{"type": "log"}], token=reg["worker_token"])
        admin.all_events()
        admin.request("GET", "/readyz")
        admin.deregister(reg["worker_id"], token=reg["worker_token"])
        admin.request("DELETE", f"/v1/runtimes/{rt['id']}")
        seen = list(hits)  # before shutdown, which may block: the lifespan closes the store
    assert seen == [], f"blocking work on the event-loop thread: {sorted(set(seen))}"
