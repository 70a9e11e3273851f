"""One durable store: placements and applied policies live in the SQL store and come back after a restart; every
change commits with its event in one transaction, or neither is written; a ``policies.yaml`` of an older version is
moved into the store. Real servers on 127.0.0.1 over a real SQLite file (test_takeover.py: PostgreSQL, two
processes)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, make_settings
from dsec.client import ApiError
from dsec.control.store import PolicyRow, WriteBatch, open_store

Factory = Callable[..., Harness]

RULE = """
policies:
  - name: tighten
    when: dsec_melt_down_count >= 3
    for: 5m
    then:
      - knob: latency_cap_ms
        by: -10
"""


def add_devices(h: Harness, *ids: str) -> None:
    for i in ids:
        h.admin.request("PUT", f"/v1/devices/{i}", json={"id": i, "node": "n0", "memory_gb": 80})


def job(name: str, workers: int) -> dict[str, Any]:
    group = {"name": "g", "workers": [{"name": f"{name}-{i}"} for i in range(workers)]}
    return {"name": name, "pool": "pool-a", "groups": [group]}


def held(placement: dict[str, Any]) -> set[str]:
    return {a["device"] for a in placement["assignments"]}


def test_a_restarted_control_plane_keeps_placements_and_does_not_double_book(server_factory: Factory) -> None:
    h = server_factory(pools=True)
    add_devices(h, "gpu0", "gpu1", "gpu2")
    first = h.admin.place(job("job-1", 2))
    assert first["complete"] and len(held(first)) == 2
    settings, port = h.settings, h.port
    h.close()

    again = server_factory(settings=settings, port=port)
    assert again.admin.placement("job-1") == first
    assert [p["job"] for p in again.admin.request("GET", "/v1/placements")["items"]] == ["job-1"]
    # Two more workers, one free device: the devices job-1 holds are not handed out again (a group is placed whole).
    second = again.admin.place(job("job-2", 2))
    assert second["assignments"] == [] and not second["complete"]
    assert {d: second["excluded"][d] for d in held(first)} == dict.fromkeys(held(first), "already runs a worker")
    assert held(again.admin.place(job("job-2", 1))) == {"gpu0", "gpu1", "gpu2"} - held(first)
    # A release is durable too: after the next restart job-1 is gone and its devices are free.
    again.admin.release_placement("job-1")
    again.close()
    third = server_factory(settings=settings, port=port)
    with pytest.raises(ApiError) as err:
        third.admin.placement("job-1")
    assert err.value.status == 404
    assert held(third.admin.place(job("job-3", 2))) == held(first)
    kinds = [("released" if e["data"].get("released") else "placed", e["data"]["job"])
             for e in third.admin.all_events(types=["placement"])]  # fmt: skip
    assert kinds == [("placed", "job-1"), ("placed", "job-2"), ("placed", "job-2"), ("released", "job-1"),
                     ("placed", "job-3")]  # fmt: skip


def test_applied_policies_come_back_from_the_store_with_their_version(server_factory: Factory) -> None:
    h = server_factory(pools=True)
    assert h.admin.policies()["version"] is None
    h.admin.put_policies("policies: []\n", "empty.yaml")
    status = h.admin.put_policies(RULE, "tighten.yaml")
    assert (status["version"], status["source"], [r["name"] for r in status["rules"]]) == (2, "tighten.yaml",
                                                                                           ["tighten"])  # fmt: skip
    # Nothing is written beside the database: the rules are in the store.
    assert not (h.settings.home / "policies.yaml").exists()
    settings, port = h.settings, h.port
    h.close()
    again = server_factory(settings=settings, port=port)
    after = again.admin.policies()
    assert (after["version"], after["source"], [r["name"] for r in after["rules"]]) == (2, "tighten.yaml", ["tighten"])
    loaded = [e["data"] for e in again.admin.all_events(types=["policy"]) if e["data"].get("phase") == "loaded"]
    assert [(d["version"], d["source"]) for d in loaded] == [(1, "empty.yaml"), (2, "tighten.yaml")]
    assert again.admin.put_policies("policies: []\n")["version"] == 3


def test_an_old_policies_file_moves_into_the_store(server_factory: Factory, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    legacy = home / "policies.yaml"
    legacy.write_text(RULE)
    h = server_factory(settings=make_settings(home))
    status = h.admin.policies()
    assert (status["version"], [r["name"] for r in status["rules"]]) == (1, ["tighten"])
    assert not legacy.exists()
    (ev,) = h.admin.all_events(types=["policy"])
    assert ev["data"]["imported_from"] == str(legacy)
    # A file that reappears next to a store holding a version is not imported over it (the store is newer).
    legacy.write_text("policies: []\n")
    settings, port = h.settings, h.port
    h.close()
    again = server_factory(settings=settings, port=port)
    assert [r["name"] for r in again.admin.policies()["rules"]] == ["tighten"]
    assert legacy.exists()


@contextmanager
def events_refused(database_url: str) -> Iterator[None]:
    """Every INSERT into the events table fails until the block ends: a real SQLite trigger writing to a table that
    does not exist, so the database answers an operational error (as when it cannot write), not a conflict."""
    path = database_url.split("///", 1)[1]
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TRIGGER refuse_events BEFORE INSERT ON events BEGIN INSERT INTO nowhere VALUES (1); END")
    try:
        yield
    finally:
        with sqlite3.connect(path) as conn:
            conn.execute("DROP TRIGGER refuse_events")


def stored(h: Harness) -> dict[str, Any]:
    store = open_store(h.database_url)
    try:
        return {
            "pools": sorted(p.name for p in store.list_pools()),
            "placements": [p.job for p in store.list_placements()],
            "policy": store.current_policy(),
            "events": store.count_events(),
        }
    finally:
        store.close()


def test_a_change_whose_event_cannot_be_written_is_not_written_either(server: Harness) -> None:
    add_devices(server, "gpu0")
    server.admin.place(job("kept", 1))
    before = stored(server)
    with events_refused(server.database_url):
        for call in (
            lambda: server.admin.put_pool("pool-new"),
            lambda: server.admin.request("DELETE", "/v1/pools/pool-b"),
            lambda: server.admin.place(job("lost", 1)),
            lambda: server.admin.release_placement("kept"),
            lambda: server.admin.put_policies(RULE),
        ):
            with pytest.raises(ApiError) as err:
                call()
            assert err.value.status == 503
        assert stored(server) == before
    # Nor did the running control plane take them in.
    assert {p["name"] for p in server.admin.pools()} == {"pool-a", "pool-b"}
    assert [p["job"] for p in server.admin.request("GET", "/v1/placements")["items"]] == ["kept"]
    assert server.admin.policies()["rules"] == []
    # And it works again once the store does.
    server.admin.put_pool("pool-new")
    assert stored(server)["pools"] == ["pool-a", "pool-b", "pool-new"]


def test_a_policy_version_taken_by_another_control_plane_is_refused_whole(server: Harness) -> None:
    server.admin.put_policies("policies: []\n", "mine.yaml")
    other = open_store(server.database_url)
    try:
        theirs = PolicyRow(2, RULE, "theirs.yaml", 1.0)
        other.write(WriteBatch(policies=[theirs]))
        with pytest.raises(ApiError) as err:
            server.admin.put_policies(RULE, "late.yaml")
        assert (err.value.status, err.value.field) == (409, "text") and "version 2" in str(err.value)
        assert other.current_policy() == theirs
        loaded = [e for e in server.admin.all_events(types=["policy"]) if e["data"].get("source") == "late.yaml"]
        assert loaded == []
        assert server.admin.policies()["source"] == "mine.yaml"
    finally:
        other.close()


def recovery_gauge(h: Harness) -> str:
    name = 'dsec_snapshot_recovery_time{pool="pool-a"} '
    (line,) = [ln for ln in h.admin.metrics_text().splitlines() if ln.startswith(name)]
    return line.removeprefix(name)


def test_the_pools_recovery_gauge_comes_back_from_the_restore_events(server_factory: Factory) -> None:
    h = server_factory(pools=True)
    for restore_s in (0.5, 1.5):  # restore_min_reporters: 2 workers
        w = h.register("pool-a")
        h.client(w.token).heartbeat(w.id, 1, events=[{"type": "restore", "data": {"restore_s": restore_s}}])
    before = recovery_gauge(h)
    assert float(before) > 0
    settings, port = h.settings, h.port
    h.close()
    again = server_factory(settings=settings, port=port)
    assert recovery_gauge(again) == before
