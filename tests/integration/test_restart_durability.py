"""What survives a restart of the control plane on the same SQLite file; liveness (lost / rejoined);
and the real Reporter end to end: directives arrive and are acked, the reporter is fail-static while
the control plane is down, and re-syncs with a new server on the same port and file."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from conftest import Harness, make_settings, wait_for
from dsec import Reporter, ReporterConfig
from dsec.client import ApiError, Client
from dsec.control.store import EventQuery, open_store

Factory = Callable[..., Harness]


def types_of(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_state_survives_a_restart_on_the_same_file(server: Harness, server_factory: Factory) -> None:
    admin = server.admin
    w1 = server.register("pool-a", role="learner", rank=0, host="h1", pid=11)
    w2 = server.register("pool-b", role="actor", group="g2", rank=3, host="h2", pid=22)
    c1 = server.client(w1.token)
    c2 = server.client(w2.token)

    # Beats with events (committed before the answer) and without (only flushed by the writer).
    c1.heartbeat(
        w1.id,
        1,
        metrics={"loss": 1.5},
        events=[
            {"type": "log", "data": {"msg": "hello", "nested": {"k": [1, 2.5, "x"]}}},
            {"type": "snapshot", "ts": 1234.5, "data": {"step": 100, "bytes": 2**40}},
        ],
    )
    c1.heartbeat(w1.id, 2, metrics={"loss": 1.25})
    directive = admin.set_directive(w1.id, compression_bits=8, precision="bf16", grad_accum_steps=4)
    assert directive["desired_version"] == 2 and directive["acked_version"] == 0
    answer = c1.heartbeat(w1.id, 3, acked_directive_version=1)
    assert answer["directive"]["version"] == 2  # not acked yet: the worker is sent the new version
    assert c1.heartbeat(w1.id, 4, acked_directive_version=2)["directive"] is None
    c1.heartbeat(w1.id, 5, acked_directive_version=2, metrics={"loss": 0.75, "memory_used_gb": 3.5})
    c2.heartbeat(w2.id, 1, events=[{"type": "anomaly", "data": {"score": 0.99}}])
    admin.set_directive(w2.id, snapshot_now="req-1")  # desired 2, never acked
    admin.put_pool("pool-c", memory_base_gb=2, memory_ceiling_gb=3, devices=["gpu0"])
    extra_admin = admin.create_token(kind="admin", label="ops")
    pool_c_token = admin.create_token("pool-c")
    admin.request("PUT", "/v1/devices/gpu0", json={"id": "gpu0", "node": "n0", "memory_gb": 80, "pool": "pool-c"})

    workers_before = {w["id"]: w for w in admin.workers()}
    events_before = admin.all_events()
    pools_before = admin.pools()
    devices_before = admin.request("GET", "/v1/devices")["items"]
    assert {"directive_set", "directive_acked", "log", "snapshot", "anomaly"} <= set(types_of(events_before))

    port = server.port
    server.close()

    again = server_factory(settings=server.settings, port=port)
    a2 = again.admin
    # Workers: identity, counters, metrics, directives (desired and acked) all as before. An active
    # worker gets a fresh lost window after a restart, so only last_beat_at may have moved forward.
    workers_after = {w["id"]: w for w in a2.workers()}
    assert workers_after.keys() == workers_before.keys()
    for wid, before in workers_before.items():
        after = workers_after[wid]
        assert after["last_beat_at"] >= before["last_beat_at"]
        assert {k: v for k, v in after.items() if k != "last_beat_at"} == {
            k: v for k, v in before.items() if k != "last_beat_at"
        }
    d1 = a2.directive(w1.id)
    assert (d1["desired_version"], d1["acked_version"], d1["in_sync"]) == (2, 2, True)
    assert (d1["desired"]["compression_bits"], d1["desired"]["precision"]) == (8, "bf16")
    assert d1["desired"]["grad_accum_steps"] == 4
    d2 = a2.directive(w2.id)
    assert (d2["desired_version"], d2["acked_version"], d2["in_sync"]) == (2, 0, False)
    assert d2["desired"]["snapshot_now"] == "req-1"
    assert workers_after[w1.id]["last_seq"] == 5 and workers_after[w1.id]["beats"] == 5
    assert workers_after[w1.id]["metrics"] == {"loss": 0.75, "memory_used_gb": 3.5}

    # Every acknowledged event, identical (ids, timestamps, data).
    assert a2.all_events() == events_before
    assert a2.pools() == pools_before
    assert a2.request("GET", "/v1/devices")["items"] == devices_before

    # last_seq: a retry of the last beat is still a duplicate, an older one is out of order.
    c1b = again.client(w1.token)
    retry = c1b.heartbeat(w1.id, 5, acked_directive_version=2, metrics={"loss": 99.0})
    assert retry["duplicate"] is True
    with pytest.raises(ApiError) as err:
        c1b.heartbeat(w1.id, 4, acked_directive_version=2)
    assert (err.value.status, err.value.field) == (409, "seq")
    assert a2.worker(w1.id)["metrics"]["loss"] == 0.75
    # The worker that has not acked gets its directive on the next beat.
    assert again.client(w2.token).heartbeat(w2.id, 2, acked_directive_version=1)["directive"]["version"] == 2

    # Tokens: pool tokens still register (and only into their pool); the API-made admin token works.
    w3 = again.register("pool-a", token=server.pool_tokens["pool-a"])
    assert again.register("pool-c", token=pool_c_token).pool == "pool-c"
    with pytest.raises(ApiError) as err:
        again.register("pool-a", token=server.pool_tokens["pool-b"])
    assert (err.value.status, err.value.field) == (403, "pool")
    with Client(again.url, token=extra_admin) as ops:
        assert {p["name"] for p in ops.status()["pools"]} == {"pool-a", "pool-b", "pool-c"}
    assert again.client(w3.token).heartbeat(w3.id, 1)["duplicate"] is False
    # New events continue after the old ids.
    assert min(e["id"] for e in a2.all_events(types=["registered"])[-2:]) > max(e["id"] for e in events_before)


def test_events_and_directives_are_durable_before_the_answer(server: Harness) -> None:
    """No flush interval stands between an acknowledged event or directive and the database file."""
    w = server.register("pool-a")
    reader = open_store(server.database_url)
    try:
        answer = server.client(w.token).heartbeat(w.id, 1, events=[{"type": "alert", "data": {"n": 1}}])
        assert answer["duplicate"] is False
        stored = reader.query_events(EventQuery(worker_id=w.id))
        assert [e.type.value for e in stored] == ["registered", "alert"]
        assert [r.last_seq for r in reader.list_workers() if r.id == w.id] == [1]
        server.admin.set_directive(w.id, compression_bits=4)
        assert {d.worker_id: d.version for d in reader.list_directives()}[w.id] == 2
    finally:
        reader.close()


def test_restart_twice_keeps_counting(server: Harness, server_factory: Factory) -> None:
    """Durability holds across more than one restart, with beats that never carried events."""
    w = server.register("pool-a")
    seq = 0
    h = server
    for _ in range(3):
        with Client(h.url, token=w.token) as c:
            for _ in range(3):
                seq += 1
                assert c.heartbeat(w.id, seq, metrics={"seq": float(seq)})["duplicate"] is False
        h.close()
        h = server_factory(settings=server.settings)
        view = h.admin.worker(w.id)
        assert (view["last_seq"], view["beats"], view["metrics"]) == (seq, seq, {"seq": float(seq)})
    assert types_of(h.admin.all_events(worker_id=w.id)) == ["registered"]


# -- liveness -------------------------------------------------------------------------------------------
def test_silent_worker_becomes_lost_and_rejoins(server_factory: Factory, tmp_path: Any) -> None:
    settings = make_settings(tmp_path / "live", lost_after_beats=2)
    h = server_factory(settings=settings, pools=True)
    interval = 0.1
    window = settings.lost_after_beats * interval
    w = h.register("pool-a", heartbeat_interval_s=interval)
    steady = h.register("pool-a", heartbeat_interval_s=3600)
    registered_at = h.admin.worker(w.id)["registered_at"]

    lost = wait_for(lambda: h.admin.all_events(worker_id=w.id, types=["lost"]), timeout=10, what="lost event")
    assert len(lost) == 1
    assert lost[0]["ts"] - registered_at > window  # not before lost_after_beats * interval
    assert lost[0]["data"]["missed_beats"] == 2 and lost[0]["data"]["silent_s"] >= window  # rounded to ms
    assert lost[0]["pool"] == "pool-a"
    assert h.admin.worker(w.id)["state"] == "lost"
    assert h.admin.worker(steady.id)["state"] == "active"
    assert h.admin.status()["pools"][0]["workers"]["lost"] == 1
    time.sleep(3 * settings.reconcile_interval_s)  # lost is recorded once, not once per pass
    assert len(h.admin.all_events(worker_id=w.id, types=["lost"])) == 1

    answer = h.client(w.token).heartbeat(w.id, 1)
    assert answer["duplicate"] is False
    events = h.admin.all_events(worker_id=w.id)
    assert types_of(events)[:3] == ["registered", "lost", "rejoined"]
    assert events[2]["data"]["silent_s"] >= events[1]["data"]["silent_s"]
    # Active again, unless it went silent long enough since to be lost a second time.
    if h.admin.worker(w.id)["state"] != "active":
        assert types_of(h.admin.all_events(worker_id=w.id))[3:4] == ["lost"]


def test_worker_that_keeps_beating_is_never_lost(server_factory: Factory, tmp_path: Any) -> None:
    h = server_factory(settings=make_settings(tmp_path / "steady", lost_after_beats=3), pools=True)
    # Lost after 1.5 s of silence; it beats every 50 ms for 2 s. (With 0.25 s beats, 0.75 s, a full run on a busy
    # machine once saw it lost: a stall of the test's client, the server or its store's commit; not told apart.)
    w = h.register("pool-a", heartbeat_interval_s=0.5)
    with Client(h.url, token=w.token) as c:
        deadline = time.monotonic() + 2.0
        seq = 0
        while time.monotonic() < deadline:
            seq += 1
            c.heartbeat(w.id, seq)
            time.sleep(0.05)
    assert h.admin.worker(w.id)["state"] == "active"
    assert h.admin.all_events(worker_id=w.id, types=["lost", "rejoined"]) == []


def test_lost_state_survives_a_restart(server_factory: Factory, tmp_path: Any) -> None:
    settings = make_settings(tmp_path / "lost", lost_after_beats=1)
    h = server_factory(settings=settings, pools=True)
    w = h.register("pool-a", heartbeat_interval_s=0.05)
    wait_for(lambda: h.admin.worker(w.id)["state"] == "lost", what="worker lost")
    h.close()
    h2 = server_factory(settings=settings)
    assert h2.admin.worker(w.id)["state"] == "lost"
    assert h2.client(w.token).heartbeat(w.id, 1)["duplicate"] is False
    assert "rejoined" in types_of(h2.admin.all_events(worker_id=w.id))


# -- the real Reporter, end to end --------------------------------------------------------------------
class Directives:
    """An on_directive handler that records what it was given."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, directive: Mapping[str, Any]) -> bool:
        with self._lock:
            self.seen.append(dict(directive))
        return True

    def versions(self) -> list[int]:
        with self._lock:
            return [int(d["version"]) for d in self.seen]


def test_reporter_end_to_end_fail_static_and_resync(server_factory: Factory, tmp_path: Any) -> None:
    # A lost window of 1 s (20 beats of 0.05 s): a slow CI machine must not make the reporter `lost`.
    server = server_factory(settings=make_settings(tmp_path / "e2e", lost_after_beats=20), pools=True)
    handler = Directives()
    config = ReporterConfig(
        endpoint=server.url,
        pool="pool-a",
        token=server.pool_tokens["pool-a"],
        role="learner",
        rank=2,
        heartbeat_interval_s=0.05,
        max_backoff_s=0.2,
        request_timeout_s=2.0,
        close_timeout_s=5.0,
    )
    reporter = Reporter(config, on_directive=handler)
    h = server
    try:
        reporter.start()
        wait_for(lambda: reporter.registered and reporter.beats_ok >= 2, what="reporter registered")
        wid = reporter.worker_id
        assert wid is not None
        assert handler.versions() == [1]
        view = h.admin.worker(wid)
        assert (view["pool"], view["role"], view["rank"]) == ("pool-a", "learner", 2)
        wait_for(lambda: h.admin.directive(wid)["acked_version"] == 1, what="version 1 acked")

        # A directive pushed through the API arrives and is acked.
        assert h.admin.set_directive(wid, compression_bits=8)["desired_version"] == 2
        wait_for(lambda: reporter.applied_version == 2, what="reporter applies version 2")
        assert reporter.directive is not None and reporter.directive["compression_bits"] == 8
        wait_for(
            lambda: (d := h.admin.directive(wid))["acked_version"] == d["desired_version"] == 2,
            what="API shows version 2 acked",
        )

        # Metrics and events reach the control plane.
        reporter.gauge("memory_used_gb", 3.0)
        reporter.event("log", urgent=True, msg="before outage")
        wait_for(lambda: h.admin.all_events(worker_id=wid, types=["log"]), what="log event")
        wait_for(lambda: h.admin.worker(wid)["metrics"].get("memory_used_gb") == 3.0, what="gauge")

        # The control plane goes away: the reporter keeps the last directive and never raises.
        port, settings = h.port, h.settings
        h.close()
        failed = reporter.beats_failed
        wait_for(lambda: reporter.beats_failed >= failed + 2, what="beats failing while down")
        reporter.observe("step_time_s", 0.1)
        reporter.gauge("memory_used_gb", 4.0)
        reporter.inc("steps", 5)
        reporter.event("alert", msg="during outage")
        reporter.beat_now()
        time.sleep(0.3)
        assert reporter._thread is not None and reporter._thread.is_alive()
        assert reporter.applied_version == 2 and reporter.directive["compression_bits"] == 8
        assert reporter.worker_id == wid and reporter.last_error
        assert handler.versions() == [1, 2]

        # A new control plane on the same port and file: the reporter re-syncs as the same worker.
        h = server_factory(settings=settings, port=port)
        ok = reporter.beats_ok
        wait_for(lambda: reporter.beats_ok > ok + 1 and reporter.last_error is None, what="beats resume")
        assert reporter.worker_id == wid
        assert h.admin.worker(wid)["state"] == "active"
        assert h.admin.set_directive(wid, precision="bf16")["desired_version"] == 3
        wait_for(
            lambda: (d := h.admin.directive(wid))["acked_version"] == d["desired_version"] == 3,
            what="API shows version 3 acked",
        )
        assert reporter.applied_version == 3 and reporter.directive["precision"] == "bf16"
        assert reporter.directive["compression_bits"] == 8  # earlier changes are kept
        # What was reported during the outage arrived once the control plane was back.
        alerts = wait_for(lambda: h.admin.all_events(worker_id=wid, types=["alert"]), what="outage event")
        assert [e["data"] for e in alerts] == [{"msg": "during outage", "source": "worker"}]
        wait_for(lambda: h.admin.worker(wid)["metrics"].get("memory_used_gb") == 4.0, what="outage gauge")
        assert h.admin.worker(wid)["metrics"]["steps"] == 5.0
        assert types_of(h.admin.all_events(worker_id=wid, types=["registered"])) == ["registered"]
        acked = [e["data"]["version"] for e in h.admin.all_events(worker_id=wid, types=["directive_acked"])]
        assert acked == [1, 2, 3]
    finally:
        reporter.close()
    # close() flushed and deregistered.
    assert h.admin.worker(wid)["state"] == "deregistered"
    assert reporter._thread is not None and not reporter._thread.is_alive()


def test_reporter_started_while_the_control_plane_is_down(server_factory: Factory, tmp_path: Any) -> None:
    """The worker starts first; it registers once the control plane comes up, and never raises before."""
    settings = make_settings(tmp_path / "late")
    first = server_factory(settings=settings, pools=True)
    token, port = first.pool_tokens["pool-a"], first.port
    first.close()
    reporter = Reporter(
        ReporterConfig(
            endpoint=f"http://127.0.0.1:{port}",
            pool="pool-a",
            token=token,
            heartbeat_interval_s=0.05,
            max_backoff_s=0.2,
            close_timeout_s=5.0,
        )
    )
    try:
        reporter.start()
        reporter.event("log", msg="early")
        wait_for(lambda: reporter.beats_failed >= 2, what="failed registrations")
        assert not reporter.registered and reporter.directive is None and reporter.last_error
        h = server_factory(settings=settings, port=port)
        wait_for(lambda: reporter.registered and reporter.beats_ok >= 1, what="registration once up")
        wid = reporter.worker_id
        assert h.admin.worker(wid)["pool"] == "pool-a"
        assert reporter.applied_version == 1
        logs = wait_for(lambda: h.admin.all_events(worker_id=wid, types=["log"]), what="buffered event")
        assert [e["data"] for e in logs] == [{"msg": "early", "source": "worker"}]
    finally:
        reporter.close()
