"""The store contract (dsec.control.store.api.Store), run against every backend.

"sqlite" always runs (a file in tmp_path). "postgres" runs when a PostgreSQL server can be started
here (the ``postgres_url`` fixture, tests/pg_cluster.py); without initdb that parameter is skipped, with the
reason.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dsec.control.server import free_port
from dsec.control.store import (
    EventQuery,
    HotRow,
    PlacementRow,
    PolicyRow,
    RuntimeRow,
    Store,
    StoreConflict,
    StoreError,
    StoreUnavailable,
    TokenRow,
    WorkerRow,
    WriteBatch,
    open_store,
)
from dsec.model import (
    Device,
    DeviceHealth,
    Directive,
    DirectiveFields,
    Event,
    EventType,
    Pool,
    PoolThresholds,
)
from pg_cluster import reset_postgres

# -- helpers ------------------------------------------------------------------------------------------
T0 = 1_700_000_000.123456


def worker_row(wid: str = "w-1", pool: str = "pool-a", **kw: Any) -> WorkerRow:
    base: dict[str, Any] = {
        "id": wid,
        "pool": pool,
        "info": {
            "pool": pool,
            "role": "actor",
            "group": "g",
            "rank": 3,
            "host": "h",
            "pid": 42,
            "device": None,
            "heartbeat_interval_s": 5.0,
        },
        "state": "active",
        "token_hash": "a" * 64,
        "registered_at": T0,
        "last_beat_at": T0 + 1,
        "last_seq": 0,
        "acked_version": 0,
        "beats": 0,
        "metrics": {},
    }
    base.update(kw)
    return WorkerRow(**base)


def directive(wid: str = "w-1", version: int = 1, **fields: Any) -> Directive:
    return Directive(worker_id=wid, version=version, fields=DirectiveFields(**fields), updated_at=T0 + version)


def event(
    etype: EventType = EventType.LOG, ts: float = T0, wid: str | None = "w-1", pool: str | None = "pool-a", **data: Any
) -> Event:
    return Event(ts=ts, type=etype, worker_id=wid, pool=pool, data=data)


def all_events(store: Store, **kw: Any) -> list[Event]:
    return store.query_events(EventQuery(limit=100_000, **kw))


# -- the contract -------------------------------------------------------------------------------------
class TestStoreContract:
    @pytest.fixture(params=["sqlite", "postgres"])
    def store_url(self, request: pytest.FixtureRequest, tmp_path: Path) -> str:
        if request.param == "sqlite":
            return f"sqlite:///{tmp_path / 'store.db'}"
        url: str = request.getfixturevalue("postgres_url")
        reset_postgres(url)
        return url

    @pytest.fixture
    def store(self, store_url: str) -> Iterator[Store]:
        s = open_store(store_url)
        try:
            yield s
        finally:
            s.close()

    # -- lifecycle -------------------------------------------------------------------------------
    def test_a_new_store_is_empty(self, store: Store) -> None:
        assert store.list_pools() == []
        assert store.list_devices() == []
        assert store.list_workers() == []
        assert store.list_directives() == []
        assert store.list_tokens() == []
        assert all_events(store) == []
        assert store.count_events() == 0

    def test_migrate_is_idempotent(self, store: Store, store_url: str) -> None:
        store.put_pool(Pool("pool-a"), T0)
        ids = store.write(WriteBatch(events=[event()]))
        store.migrate()
        store.migrate()
        reopened = open_store(store_url)  # open_store migrates again
        try:
            reopened.migrate()
            assert [p.name for p in reopened.list_pools()] == ["pool-a"]
            assert [e.id for e in all_events(reopened)] == ids
        finally:
            reopened.close()
        assert [p.name for p in store.list_pools()] == ["pool-a"]

    def test_close_is_safe_to_repeat(self, store_url: str) -> None:
        s = open_store(store_url)
        s.close()
        s.close()

    # -- pools ----------------------------------------------------------------------------------------
    def test_pools_put_list_replace_delete(self, store: Store) -> None:
        b = Pool(
            "pool-b",
            devices=("gpu1", "gpu0"),
            thresholds=PoolThresholds(64.0, 40.5),
            memory_base_gb=2.5,
            memory_ceiling_gb=4096.0,
            snapshot_interval_s=30.0,
        )
        a = Pool("pool-a")
        store.put_pool(b, T0)
        store.put_pool(a, T0)
        assert store.list_pools() == [a, b]  # by name, round-tripped exactly
        b2 = replace(b, devices=(), memory_base_gb=3.0)
        store.put_pool(b2, T0 + 1)
        assert store.list_pools() == [a, b2]
        assert store.delete_pool("pool-b") is True
        assert store.delete_pool("pool-b") is False
        assert store.delete_pool("never-existed") is False
        assert store.list_pools() == [a]

    # -- devices --------------------------------------------------------------------------------------
    def test_devices_put_list_upsert(self, store: Store) -> None:
        d1 = Device(
            "gpu1",
            "node-1",
            model="H100",
            memory_gb=80.0,
            numa_node=1,
            nvlink_peers=("gpu0", "gpu2"),
            health=DeviceHealth.DEGRADED,
            pool="pool-a",
        )
        d0 = Device("gpu0", "node-1")
        store.put_devices([d1, d0], T0)
        assert store.list_devices() == [d0, d1]
        d0b = replace(d0, health=DeviceHealth.DRAINED, pool="pool-b")
        store.put_devices([d0b], T0 + 1)
        assert store.list_devices() == [d0b, d1]
        store.put_devices([], T0 + 2)
        assert store.list_devices() == [d0b, d1]

    # -- the batched write path -----------------------------------------------------------------------
    def test_empty_batch_writes_nothing(self, store: Store) -> None:
        assert store.write(WriteBatch()) == []
        assert store.list_workers() == [] and store.count_events() == 0

    def test_workers_are_upserted(self, store: Store) -> None:
        w = worker_row(metrics={"loss": 0.5, "memory_used_gb": 3.25})
        store.write(WriteBatch(workers=[w, worker_row("w-0", pool="pool-b")]))
        assert [r.id for r in store.list_workers()] == ["w-0", "w-1"]
        assert store.list_workers()[1] == w
        w2 = replace(
            w,
            state="lost",
            last_seq=2**62,
            beats=2**40,
            acked_version=7,
            last_beat_at=T0 + 99.5,
            metrics={"loss": 0.25},
        )
        store.write(WriteBatch(workers=[w2]))
        rows = {r.id: r for r in store.list_workers()}
        assert len(rows) == 2
        assert rows["w-1"] == w2
        assert dict(rows["w-1"].info) == dict(w.info)

    def test_hot_rows_write_the_beat_columns_of_existing_workers_only(self, store: Store) -> None:
        w = worker_row(metrics={"loss": 0.5}, state="lost")
        store.write(WriteBatch(workers=[w, worker_row("w-0")]))
        beat = HotRow("w-1", T0 + 7.25, 2**62, 3, 2**40, {"loss": 0.25, "sync_ms": 12.5, "nan": float("nan")})
        gone = HotRow("w-9", T0, 1, 1, 1, {"x": 1.0})  # no such row (forgotten): nothing is written for it
        store.write(WriteBatch(hot=[beat, gone]))
        rows = {r.id: r for r in store.list_workers()}
        assert set(rows) == {"w-0", "w-1"}
        # The beat's columns; the rest of the row (state, info, token) as the last whole-row write left it.
        assert rows["w-1"] == replace(
            w, last_beat_at=T0 + 7.25, last_seq=2**62, acked_version=3, beats=2**40,
            metrics={"loss": 0.25, "sync_ms": 12.5, "nan": None},
        )  # fmt: skip
        assert rows["w-0"] == worker_row("w-0")

    def test_hot_rows_keep_every_float_and_integer_exactly(self, store: Store) -> None:
        """The hot rows go to the database as one JSON array (``SqlStore._write_hot``): every finite double — random
        bit patterns, the extremes, unix times with microseconds — and 64-bit integer comes back bit for bit."""
        rnd = random.Random(20261207)
        extremes = [5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, -1.7976931348623157e308, 1e-7,
                    0.1, 1 / 3, 2.0**53 + 2, T0, -0.0]  # fmt: skip

        def double() -> float:
            while True:
                x: float = struct.unpack("<d", rnd.getrandbits(64).to_bytes(8, "little"))[0]
                if math.isfinite(x):
                    return x

        n = 300
        rows = [worker_row(f"w-{i}") for i in range(n)]
        store.write(WriteBatch(workers=rows))
        hot = [
            HotRow(
                f"w-{i}",
                extremes[i] if i < len(extremes) else (T0 + rnd.random() * 1e6 if i % 2 else double()),
                rnd.getrandbits(63),
                rnd.getrandbits(31),
                rnd.getrandbits(63),
                {f"m{k}": double() for k in range(rnd.randint(0, 8))} | {"edge": extremes[i % len(extremes)]},
            )
            for i in range(n)
        ]
        store.write(WriteBatch(hot=hot))
        back = {r.id: r for r in store.list_workers()}
        for h in hot:
            r = back[h.id]
            got = (r.last_beat_at, r.last_seq, r.acked_version, r.beats, dict(r.metrics))
            assert got == (h.last_beat_at, h.last_seq, h.acked_version, h.beats, dict(h.metrics)), h.id
            if h.last_beat_at != 0.0:  # SQLite stores an integral REAL as an integer: -0.0 reads back 0.0 (so it
                # did before the one-statement form)
                assert struct.pack("<d", r.last_beat_at) == struct.pack("<d", h.last_beat_at), h.id

    def test_directives_are_upserted(self, store: Store) -> None:
        store.write(WriteBatch(directives=[directive("w-1", 1), directive("w-2", 1, precision="bf16")]))
        store.write(
            WriteBatch(
                directives=[
                    directive(
                        "w-1", 2, compression_bits=8, memory_quota_gb=7.0, memory_ceiling_gb=12.0, snapshot_now="req-1"
                    )
                ]
            )
        )
        got = {d.worker_id: d for d in store.list_directives()}
        assert got == {
            "w-1": directive(
                "w-1", 2, compression_bits=8, memory_quota_gb=7.0, memory_ceiling_gb=12.0, snapshot_now="req-1"
            ),
            "w-2": directive("w-2", 1, precision="bf16"),
        }

    def test_compression_bits_null_and_32_round_trip_distinct(self, store: Store) -> None:
        # null is the probe's default, 32 uncompressed: a store that wrote one for the other would flip it
        store.write(WriteBatch(directives=[directive("w-1", 2), directive("w-2", 2, compression_bits=32)]))
        got = {d.worker_id: d.fields.compression_bits for d in store.list_directives()}
        assert got == {"w-1": None, "w-2": 32}

    def test_last_directive_for_a_worker_in_one_batch_wins(self, store: Store) -> None:
        # The group-commit writer concatenates requests' directives; the newest is the last.
        store.write(
            WriteBatch(directives=[directive("w-1", 2, compression_bits=16), directive("w-1", 3, compression_bits=8)])
        )
        assert store.list_directives() == [directive("w-1", 3, compression_bits=8)]

    def test_event_ids_increase_and_are_returned_in_order(self, store: Store) -> None:
        first = store.write(WriteBatch(events=[event(msg=str(i)) for i in range(5)]))
        assert len(first) == 5 and first == sorted(first) and len(set(first)) == 5
        second = store.write(
            WriteBatch(
                workers=[worker_row()],
                directives=[directive()],
                events=[event(EventType.SNAPSHOT, step=1), event(EventType.ALERT)],
            )
        )
        assert len(second) == 2 and second[0] < second[1] and min(second) > max(first)
        stored = all_events(store)
        assert [e.id for e in stored] == first + second
        assert [e.data.get("msg") for e in stored[:5]] == ["0", "1", "2", "3", "4"]
        assert store.count_events() == 7

    def test_many_events_in_one_batch_keep_their_data_and_get_their_own_ids(self, store: Store) -> None:
        """Events go to SQLite as one JSON array (``_insert_events_sqlite``): each comes back with the id it was
        answered, in order, its data as written — escapes, control characters, 64-bit integers, nulls."""
        tricky = ['quote " and \\ backslash', "line\nbreak\ttab", "\x01\x1f ctrl", "\u2028\u2029", "😀 ✓ ünï", ""]
        rnd = random.Random(5)
        evs = [
            Event(
                ts=T0 + rnd.random() * 1e4,
                type=list(EventType)[i % len(EventType)],
                worker_id=None if i % 7 == 0 else f"w-{i}",
                pool=None if i % 5 == 0 else "pool-a",
                data={
                    "i": i,
                    "s": tricky[i % len(tricky)],
                    tricky[i % len(tricky)]: [2**63 - 1, -(2**63), None, 0.1],
                    "f": rnd.random() * 10 ** rnd.randint(-300, 300),
                    "nested": {"t": True, "l": []},
                },
            )
            for i in range(200)
        ]
        ids = store.write(WriteBatch(events=evs[:3])) + store.write(WriteBatch(events=evs[3:]))
        assert ids == sorted(ids) and len(set(ids)) == 200
        back = all_events(store)
        assert [e.id for e in back] == ids
        assert [replace(e, id=None) for e in back] == evs

    def test_events_round_trip(self, store: Store) -> None:
        data = {
            "s": "ünïcødé ✓",
            "i": 2**53,
            "f": 0.1,
            "neg": -1.5,
            "b": True,
            "n": None,
            "list": [1, "two", [3.0]],
            "nested": {"a": {"b": {"c": []}}},
        }
        ev = Event(ts=T0, type=EventType.ANOMALY, worker_id="w-1", pool="pool-a", data=data)
        (eid,) = store.write(WriteBatch(events=[ev]))
        (ctl,) = store.write(WriteBatch(events=[Event(ts=T0 + 1, type=EventType.POOL_CHANGED, pool="pool-a")]))
        got = all_events(store)
        assert got[0] == replace(ev, id=eid)
        assert got[1] == Event(ts=T0 + 1, type=EventType.POOL_CHANGED, worker_id=None, pool="pool-a", data={}, id=ctl)

    def test_a_failed_batch_writes_nothing(self, store: Store) -> None:
        store.write(WriteBatch(workers=[worker_row("w-1")], events=[event()]))
        bad = replace(worker_row("w-2"), state=None)  # type: ignore[arg-type]  # NOT NULL column
        with pytest.raises(StoreError):
            store.write(
                WriteBatch(workers=[worker_row("w-3"), bad], directives=[directive("w-3")], events=[event(msg="lost")])
            )
        assert [w.id for w in store.list_workers()] == ["w-1"]
        assert store.list_directives() == []
        assert store.count_events() == 1
        # ... and the store keeps working afterwards.
        assert len(store.write(WriteBatch(events=[event(msg="after")]))) == 1

    # -- querying events ------------------------------------------------------------------------------
    @pytest.fixture
    def history(self, store: Store) -> list[Event]:
        """12 events over 3 workers, 2 pools and 3 types; ts deliberately not in id order at the end."""
        evs = []
        for i in range(10):
            evs.append(
                event(
                    [EventType.LOG, EventType.ALERT, EventType.SNAPSHOT][i % 3],
                    ts=T0 + i,
                    wid=f"w-{i % 3}",
                    pool="pool-a" if i % 2 == 0 else "pool-b",
                    i=i,
                )
            )
        evs.append(event(EventType.POOL_CHANGED, ts=T0 + 100, wid=None, pool="pool-b", i=10))
        evs.append(event(EventType.LOG, ts=T0 - 100, wid="w-0", pool="pool-a", i=11))
        ids = store.write(WriteBatch(events=evs))
        return [replace(e, id=i) for e, i in zip(evs, ids, strict=True)]

    def _q(self, store: Store, **kw: Any) -> list[int]:
        return [e.data["i"] for e in all_events(store, **kw)]

    def test_query_everything_in_id_order(self, store: Store, history: list[Event]) -> None:
        assert all_events(store) == history

    def test_query_by_worker(self, store: Store, history: list[Event]) -> None:
        assert self._q(store, worker_id="w-0") == [0, 3, 6, 9, 11]
        assert self._q(store, worker_id="w-nope") == []

    def test_query_by_pool(self, store: Store, history: list[Event]) -> None:
        assert self._q(store, pool="pool-b") == [1, 3, 5, 7, 9, 10]
        assert self._q(store, pool="pool-a", worker_id="w-0") == [0, 6, 11]

    def test_query_by_types(self, store: Store, history: list[Event]) -> None:
        assert self._q(store, types=(EventType.ALERT,)) == [1, 4, 7]
        assert self._q(store, types=(EventType.LOG, EventType.POOL_CHANGED)) == [0, 3, 6, 9, 10, 11]
        assert self._q(store, types=(EventType.MELTDOWN,)) == []
        assert self._q(store, types=()) == list(range(12))

    def test_query_by_time_range(self, store: Store, history: list[Event]) -> None:
        # since is inclusive, until exclusive; results stay in id order, not ts order.
        assert self._q(store, since=T0 + 3) == [3, 4, 5, 6, 7, 8, 9, 10]
        assert self._q(store, until=T0 + 3) == [0, 1, 2, 11]
        assert self._q(store, since=T0 + 3, until=T0 + 5) == [3, 4]
        assert self._q(store, since=T0 + 5, until=T0 + 5) == []
        assert self._q(store, since=T0 + 2, until=T0 + 8, pool="pool-a", types=(EventType.SNAPSHOT,)) == [2]

    def test_query_pagination_with_after_id(self, store: Store, history: list[Event]) -> None:
        seen: list[Event] = []
        after = 0
        pages = 0
        while True:
            page = store.query_events(EventQuery(after_id=after, limit=5))
            pages += 1
            assert len(page) <= 5
            seen.extend(page)
            if len(page) < 5:
                break
            after = page[-1].id or 0
        assert seen == history and pages == 3
        assert [e.data["i"] for e in store.query_events(EventQuery(after_id=history[3].id or 0, limit=2))] == [4, 5]
        assert store.query_events(EventQuery(after_id=history[-1].id or 0)) == []
        filtered = store.query_events(EventQuery(worker_id="w-1", after_id=history[4].id or 0, limit=1))
        assert [e.data["i"] for e in filtered] == [7]

    def test_query_limit(self, store: Store, history: list[Event]) -> None:
        assert [e.data["i"] for e in store.query_events(EventQuery(limit=1))] == [0]
        assert len(store.query_events(EventQuery(limit=3))) == 3
        assert len(store.query_events(EventQuery())) == 12  # default limit 100

    # -- tokens ---------------------------------------------------------------------------------------
    def test_tokens_put_list_and_conflict(self, store: Store) -> None:
        pool_tok = TokenRow("b" * 64, "pool-a", "pool", "ci runners", T0)
        admin_tok = TokenRow("c" * 64, None, "admin", "", T0 + 1)
        store.put_token(pool_tok)
        store.put_token(admin_tok)
        assert sorted(store.list_tokens(), key=lambda t: t.token_hash) == [pool_tok, admin_tok]
        with pytest.raises(StoreConflict):
            store.put_token(TokenRow("b" * 64, "pool-b", "pool", "dup", T0 + 2))
        assert len(store.list_tokens()) == 2
        assert {t.token_hash: t for t in store.list_tokens()}["b" * 64] == pool_tok

    def test_tokens_are_deleted_alone_or_with_their_pool(self, store: Store) -> None:
        store.put_pool(Pool("pool-a"), T0)
        store.put_pool(Pool("pool-b"), T0)
        for h, pool, kind in (("a", "pool-a", "pool"), ("b", "pool-a", "pool"), ("c", "pool-b", "pool"),
                              ("d", None, "read")):  # fmt: skip
            store.put_token(TokenRow(h * 64, pool, kind, "", T0))
        assert store.delete_token("d" * 64) is True
        assert store.delete_token("d" * 64) is False
        assert store.delete_pool("pool-a") is True
        assert [t.token_hash for t in store.list_tokens()] == ["c" * 64]

    # -- retention ------------------------------------------------------------------------------------
    def test_prune_events_by_age_keeping_some_types(self, store: Store) -> None:
        old = [event(EventType.LOG, ts=T0), event(EventType.MELTDOWN, ts=T0), event(EventType.ALERT, ts=T0 + 5)]
        new = [event(EventType.LOG, ts=T0 + 10)]
        store.write(WriteBatch(events=old + new))
        assert store.prune_events(T0 + 10, keep=(EventType.MELTDOWN,)) == 2
        assert [(e.type, e.ts) for e in all_events(store)] == [(EventType.MELTDOWN, T0), (EventType.LOG, T0 + 10)]
        assert store.prune_events(T0 + 11) == 2 and all_events(store) == []

    def test_a_batch_deletes_workers_with_their_directives_and_keeps_their_events(self, store: Store) -> None:
        store.write(WriteBatch(workers=[worker_row("w-1"), worker_row("w-2")], directives=[directive("w-1")],
                               events=[event(wid="w-1")]))  # fmt: skip
        # A row of the same batch does not bring a deleted worker back.
        store.write(WriteBatch(workers=[worker_row("w-1", beats=9)], deleted_workers=["w-1"]))
        assert [w.id for w in store.list_workers()] == ["w-2"]
        assert store.list_directives() == []
        assert [e.worker_id for e in all_events(store)] == ["w-1"]

    # -- runtimes -------------------------------------------------------------------------------------
    def test_runtimes_put_list_update_delete(self, store: Store) -> None:
        rt = RuntimeRow("rt-1", "dify-1", "dify", "https://agents.example.com/h", "s" * 32, "e" * 64, "pool-a", T0,
                        {}, None)  # fmt: skip
        store.put_runtime(rt)
        assert store.list_runtimes() == [rt]
        reported = replace(rt, report={"concurrent_agents": 3, "function_calling": True}, reported_at=T0 + 1)
        store.put_runtime(reported)
        assert store.list_runtimes() == [reported]
        assert store.delete_runtime("rt-1") is True and store.delete_runtime("rt-1") is False
        assert store.list_runtimes() == []

    # -- pools, devices, placements and policies in batches, each with its event ---------------------
    def test_a_batch_writes_pools_devices_and_their_events_together(self, store: Store) -> None:
        store.put_token(TokenRow("b" * 64, "pool-b", "pool", "", T0))
        store.put_pool(Pool("pool-b"), T0)
        gpu = Device("gpu0", "node-1", pool="pool-a")
        store.write(
            WriteBatch(
                pools=[(Pool("pool-a", memory_base_gb=2.0), T0)],
                devices=[(gpu, T0)],
                deleted_pools=["pool-b"],
                events=[event(EventType.POOL_CHANGED, wid=None, created=True)],
            )
        )
        assert store.list_pools() == [Pool("pool-a", memory_base_gb=2.0)]
        assert store.list_devices() == [gpu]
        assert store.list_tokens() == []  # the deleted pool's token went with it
        assert [e.type for e in all_events(store)] == [EventType.POOL_CHANGED]

    def test_placements_are_upserted_listed_and_released(self, store: Store) -> None:
        a = PlacementRow("job-a", "pool-a", {"job": "job-a", "assignments": [{"device": "gpu0"}]}, T0)
        b = PlacementRow("job-b", None, {"job": "job-b", "assignments": []}, T0 + 1)
        store.write(WriteBatch(placements=[b, a]))
        assert store.list_placements() == [a, b]
        a2 = replace(a, placement={"job": "job-a", "assignments": [{"device": "gpu1"}]}, placed_at=T0 + 2)
        store.write(WriteBatch(placements=[a2], released_placements=["job-b"]))
        assert store.list_placements() == [a2]

    def test_policy_versions_newest_wins_and_a_taken_version_conflicts(self, store: Store) -> None:
        assert store.current_policy() is None
        v1 = PolicyRow(1, "policies: []\n", "a.yaml", T0)
        v2 = PolicyRow(2, "policies:\n  - ünï\n", "b.yaml", T0 + 1)
        store.write(WriteBatch(policies=[v1]))
        store.write(WriteBatch(policies=[v2]))
        assert store.current_policy() == v2
        with pytest.raises(StoreConflict):
            store.write(WriteBatch(policies=[PolicyRow(2, "other", "c.yaml", T0 + 2)]))
        assert store.current_policy() == v2

    def test_a_failed_change_writes_neither_it_nor_its_event(self, store: Store) -> None:
        store.write(WriteBatch(policies=[PolicyRow(1, "x", "a.yaml", T0)]))
        placed = PlacementRow("job-a", "pool-a", {"job": "job-a"}, T0)
        # The policy version is taken: the pool, the placement and the events of the batch are not written either.
        with pytest.raises(StoreConflict):
            store.write(
                WriteBatch(
                    pools=[(Pool("pool-a"), T0)],
                    placements=[placed],
                    policies=[PolicyRow(1, "y", "b.yaml", T0)],
                    events=[event(EventType.POOL_CHANGED), event(EventType.PLACEMENT), event(EventType.POLICY)],
                )
            )
        assert store.list_pools() == [] and store.list_placements() == [] and store.count_events() == 0
        assert store.current_policy() == PolicyRow(1, "x", "a.yaml", T0)


def test_unopenable_sqlite_path_is_store_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreUnavailable) as err:
        open_store(f"sqlite:///{blocker / 'sub' / 'dsec.db'}")
    assert "a-file" in str(err.value)


def test_unreachable_postgres_is_store_unavailable_and_hides_the_password() -> None:
    pytest.importorskip("psycopg")
    url = f"postgresql+psycopg://dsec:s3cret-pw@127.0.0.1:{free_port()}/dsec?connect_timeout=2"
    with pytest.raises(StoreUnavailable) as err:
        open_store(url)
    assert "s3cret-pw" not in str(err.value)


def test_json_columns_hold_the_values_json_dumps_wrote() -> None:
    """The JSON columns' serializer (orjson) writes what json.dumps wrote, read back by json.loads, except a
    non-finite float: null instead of NaN/Infinity (not JSON)."""
    import json

    from dsec.control.store.sql import json_dumps

    value = {"a": [1, 2.5, True, None, "é\u0000x"], "nested": {"t": (1, 2)}, 3: "int key", "big": 2**63}
    assert json.loads(json_dumps(value)) == json.loads(json.dumps(value))
    assert json.loads(json_dumps({"x": float("nan"), "y": float("inf")})) == {"x": None, "y": None}


def hot_metrics(rnd: random.Random) -> dict[str, float]:
    return {"loss": rnd.random(), "nan": float("nan"), "big": rnd.random() * 1e300, "neg": -rnd.random()}


def test_hot_rows_one_statement_writes_what_the_executemany_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SQLite without ``UPDATE ... FROM`` (older than 3.38) takes the executemany: both write the same rows."""
    import dsec.control.store.sql as sql

    rnd = random.Random(7)
    hot = [
        HotRow(f"w-{i}", T0 + rnd.random() * 1e5, rnd.getrandbits(40), i, rnd.getrandbits(40), hot_metrics(rnd))
        for i in range(50)
    ] + [HotRow("w-gone", T0, 1, 1, 1, {"x": 1.0})]
    out = []
    for one in (True, False):
        monkeypatch.setattr(sql, "_SQLITE_ONE_STATEMENT", one)
        store = open_store(f"sqlite:///{tmp_path / f'{one}.db'}")
        try:
            store.write(WriteBatch(workers=[worker_row(f"w-{i}") for i in range(50)]))
            store.write(WriteBatch(hot=hot))
            out.append(store.list_workers())
        finally:
            store.close()
    assert out[0] == out[1]
    assert {r.id for r in out[0]} == {f"w-{i}" for i in range(50)}  # the gone worker was not brought back
    assert out[0][0].metrics["nan"] is None and out[0][0].last_seq == hot[0].last_seq


def test_events_near_the_largest_rowid_take_their_ids_from_returning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Near SQLite's largest rowid the ids are not counted: the insert takes the ids RETURNING answers. (The largest
    rowid is lowered here to reach that branch.)"""
    import dsec.control.store.sql as sql

    store = open_store(f"sqlite:///{tmp_path / 'max.db'}")
    try:
        counted = store.write(WriteBatch(events=[event(msg=str(i)) for i in range(3)]))
        assert counted == [1, 2, 3]
        monkeypatch.setattr(sql, "_MAX_ROWID", 8)
        calls: list[Any] = []
        real = sql._insert_events_sqlite
        monkeypatch.setattr(sql, "_insert_events_sqlite", lambda conn, evs: calls.append(real(conn, evs)) or calls[-1])
        ids = store.write(WriteBatch(events=[event(msg=str(i)) for i in range(3, 8)]))
        assert calls == [None]  # 4..8 would reach the largest: not counted
        assert ids == [4, 5, 6, 7, 8]
        assert [(e.id, e.data["msg"]) for e in all_events(store)] == [(i + 1, str(i)) for i in range(8)]
    finally:
        store.close()


def test_event_ids_that_cannot_be_counted_fail_the_write_and_write_nothing(tmp_path: Path) -> None:
    """Should the ids not be the largest + 1, + 2, ... (here a trigger inserts a row of its own after each), the write
    fails with a store error and writes nothing, rather than answer ids that may be another row's."""
    store = open_store(f"sqlite:///{tmp_path / 'gaps.db'}")
    try:
        store.write(WriteBatch(events=[event(msg="before")]))
        with store._engine.begin() as conn:  # type: ignore[attr-defined]
            conn.exec_driver_sql(
                "CREATE TRIGGER shadow AFTER INSERT ON events WHEN NEW.type != 'recovery' BEGIN "
                "INSERT INTO events (ts, type, data) VALUES (NEW.ts, 'recovery', '{}'); END"
            )
        with pytest.raises(StoreError, match="should end at id 3"):
            store.write(WriteBatch(workers=[worker_row()], events=[event(msg=str(i)) for i in range(2)]))
        assert [e.data["msg"] for e in all_events(store)] == ["before"]
        assert store.list_workers() == []
    finally:
        store.close()
