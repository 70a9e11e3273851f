"""The group-commit writer: how requests' batches merge into one transaction, and that one request contradicting the
store does not fail the requests merged with it. A real SQLite store."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.control.store import (
    EventQuery,
    HotRow,
    PlacementRow,
    PolicyRow,
    Store,
    StoreConflict,
    StoreUnavailable,
    WorkerRow,
    WriteBatch,
    open_store,
)
from dsec.control.store.sql import SqlStore
from dsec.control.writer import GroupCommitWriter, merge_batches
from dsec.model import Event, EventType, Pool


def ev(msg: str) -> Event:
    return Event(ts=1.0, type=EventType.LOG, data={"msg": msg})


def placed(job: str) -> PlacementRow:
    return PlacementRow(job, None, {"job": job, "assignments": []}, 1.0)


def test_the_last_change_of_a_pool_or_placement_wins_and_events_keep_their_order() -> None:
    merged = merge_batches(
        [],
        [
            WriteBatch(deleted_pools=["a"], placements=[placed("j1")], events=[ev("1")]),
            WriteBatch(pools=[(Pool("a"), 2.0)], released_placements=["j1", "j2"], events=[ev("2")]),
            WriteBatch(deleted_pools=["b"], placements=[placed("j2")], events=[ev("3")]),
        ],
    )
    assert merged.pools == [(Pool("a"), 2.0)] and merged.deleted_pools == ["b"]
    assert merged.placements == [placed("j2")] and merged.released_placements == ["j1"]
    assert [e.data["msg"] for e in merged.events] == ["1", "2", "3"]


def test_a_request_row_is_newer_than_the_dirty_copy_and_deleted_workers_stay_deleted() -> None:
    def row(wid: str, beats: int) -> WorkerRow:
        return WorkerRow(wid, "p", {}, "active", "h", 0.0, 0.0, 0, 0, beats, {})

    def hot(wid: str) -> HotRow:
        return HotRow(wid, 0.0, 0, 0, 1, {})

    merged = merge_batches(
        [hot("w1"), hot("w2"), hot("w3")], [WriteBatch(workers=[row("w1", 2)]), WriteBatch(deleted_workers=["w2"])]
    )
    assert merged.workers == [row("w1", 2)] and merged.deleted_workers == ["w2"]
    assert merged.hot == [hot("w3")]


class GatedStore(SqlStore):
    """A real SQLite store whose next write, once ``armed``, waits for ``gate``: the requests submitted meanwhile
    queue up and are merged into the following transaction."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.armed = threading.Event()
        self.writing = threading.Event()
        self.gate = threading.Event()
        self.writing_now = False  # a write transaction of this store is under way

    def write(self, batch: WriteBatch) -> list[int]:
        self.writing_now = True
        try:
            if self.armed.is_set():
                self.armed.clear()
                self.writing.set()
                assert self.gate.wait(10)
            return super().write(batch)
        finally:
            self.writing_now = False


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[GatedStore]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    open_store(url).close()  # migrated
    store = GatedStore(url)
    try:
        yield store
    finally:
        store.close()


def test_a_conflicting_request_fails_alone(gated: GatedStore) -> None:
    gated.write(WriteBatch(policies=[PolicyRow(1, "x", "a.yaml", 1.0)]))  # version 1 is taken
    writer = GroupCommitWriter(gated, take_dirty=list, mark_dirty=lambda *ids: None, flush_interval_s=60)
    try:
        gated.armed.set()
        first = writer.submit(WriteBatch(events=[ev("first")]))
        assert gated.writing.wait(10)
        # Both queue while the first transaction runs, so they are merged into the next one.
        conflicting = writer.submit(WriteBatch(policies=[PolicyRow(1, "y", "b.yaml", 2.0)], events=[ev("lost")]))
        innocent = writer.submit(WriteBatch(events=[ev("kept")]))
        gated.gate.set()
        assert len(first.result(10)) == 1
        with pytest.raises(StoreConflict):
            conflicting.result(10)
        assert len(innocent.result(10)) == 1
    finally:
        writer.close()
    assert gated.current_policy() == PolicyRow(1, "x", "a.yaml", 1.0)
    assert [e.data["msg"] for e in gated.query_events(EventQuery(limit=100))] == ["first", "kept"]
    assert writer.failures == 1


def test_a_batch_that_cannot_be_merged_fails_alone_and_the_writer_goes_on(gated: GatedStore) -> None:
    # Only code can build such a batch (a request cannot); before, merging it raised in the writer thread, which
    # died: its request and every later commit waited forever.
    writer = GroupCommitWriter(gated, take_dirty=list, mark_dirty=lambda *ids: None, flush_interval_s=60)
    try:
        gated.armed.set()
        first = writer.submit(WriteBatch(events=[ev("first")]))
        assert gated.writing.wait(10)
        malformed = writer.submit(WriteBatch(workers=[None], events=[ev("lost")]))  # type: ignore[list-item]
        innocent = writer.submit(WriteBatch(events=[ev("kept")]))
        gated.gate.set()
        assert len(first.result(10)) == 1
        with pytest.raises(Exception):  # noqa: B017 - whatever the merge raises, the request gets it
            malformed.result(10)
        assert len(innocent.result(10)) == 1
        assert writer.alive()
        assert len(writer.submit(WriteBatch(events=[ev("after")])).result(10)) == 1
    finally:
        writer.close()
    assert [e.data["msg"] for e in gated.query_events(EventQuery(limit=100))] == ["first", "kept", "after"]


# -- hot rows in parts ------------------------------------------------------------------------------------------------
class RecordingStore(GatedStore):
    """A gated store that records what each transaction carried: (worker rows, hot rows, events)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.transactions: list[tuple[int, int, int]] = []

    def write(self, batch: WriteBatch) -> list[int]:
        ids = super().write(batch)
        self.transactions.append((len(batch.workers), len(batch.hot), len(batch.events)))
        return ids


def full_row(i: int, beats: int = 1) -> WorkerRow:
    return WorkerRow(f"w{i:05d}", "p", {}, "active", "h", 0.0, 0.0, beats, 0, beats, {"m": float(i)})


def hot_row(i: int, beats: int = 1) -> HotRow:
    return HotRow(f"w{i:05d}", float(beats), beats, 0, beats, {"m": float(i)})


def test_hot_rows_go_out_in_parts_and_a_request_waits_for_one_part_only(tmp_path: Path) -> None:
    """2,500 dirty rows with max_hot_rows=1000: three transactions, and a request submitted while the first is
    written rides along with the second instead of waiting for all three. The request rewrote worker 2,400 (in the
    third part) and deleted worker 2,450: the older dirty copies of both do not overwrite that afterwards."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    open_store(url).close()
    store = RecordingStore(url)
    dirty = [[hot_row(i) for i in range(2500)]]
    marked: list[str] = []
    store.write(WriteBatch(workers=[full_row(i, beats=0) for i in range(2500)]))  # registered before
    store.armed.set()  # the writer's first transaction (the first part) waits for the gate
    writer = GroupCommitWriter(
        store, take_dirty=lambda: dirty.pop() if dirty else [], mark_dirty=lambda *ids: marked.extend(ids),
        flush_interval_s=0.01, max_hot_rows=1000,
    )  # fmt: skip
    try:
        assert store.writing.wait(10)
        request = writer.submit(
            WriteBatch(workers=[full_row(2400, beats=5)], deleted_workers=["w02450"], events=[ev("x")])
        )
        store.gate.set()
        assert len(request.result(10)) == 1
    finally:
        writer.close()
        rows = {w.id: w for w in store.list_workers()}
        store.close()
    # The request and its row in the 2nd part; the 3rd without the two workers the request wrote.
    assert store.transactions == [(2500, 0, 0), (0, 1000, 0), (1, 1000, 1), (0, 498, 0)]
    assert rows["w02400"].beats == 5 and "w02450" not in rows
    assert len(rows) == 2499 and not marked
    assert all(w.beats == 1 and w.metrics == {"m": float(int(w.id[1:]))} for w in rows.values() if w.id != "w02400")


def test_a_failed_part_marks_its_rows_and_the_parts_after_it_dirty_again(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    setup = open_store(url)
    setup.write(WriteBatch(workers=[full_row(i, beats=0) for i in range(2500)]))  # registered before
    setup.close()

    class FailingSecond(SqlStore):
        writes = 0

        def write(self, batch: WriteBatch) -> list[int]:
            FailingSecond.writes += 1
            if FailingSecond.writes == 2:
                raise StoreUnavailable("disk full")
            return super().write(batch)

    store = FailingSecond(url)
    dirty = [[hot_row(i) for i in range(2500)]]
    marked: list[str] = []
    writer = GroupCommitWriter(
        store, take_dirty=lambda: dirty.pop() if dirty else [], mark_dirty=lambda *ids: marked.extend(ids),
        flush_interval_s=0.01, max_hot_rows=1000,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while len(marked) < 1500 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        writer.close()
        written = {w.id for w in store.list_workers() if w.beats == 1}
        store.close()
    assert written == {f"w{i:05d}" for i in range(1000)}  # the first part only
    assert sorted(marked) == [f"w{i:05d}" for i in range(1000, 2500)]  # retried by the next flush


# -- exclusive calls (event retention) --------------------------------------------------------------------------------
def test_an_exclusive_call_runs_on_the_writer_thread_after_the_batches_before_it(gated: GatedStore) -> None:
    """Event retention's DELETE ran on another thread beside the group commit; SQLite has one writer, and under
    registration load a commit failed with "database is locked". Now it runs on the writer's thread, after what was
    submitted before it and before what was submitted after; its error goes to its caller, the writer goes on."""
    writer = GroupCommitWriter(gated, take_dirty=list, mark_dirty=lambda *ids: None, flush_interval_s=60)
    seen: list[tuple[str, bool, list[str]]] = []

    def prune(store: Store) -> int:
        stored = [e.data["msg"] for e in store.query_events(EventQuery(limit=10))]
        seen.append((threading.current_thread().name, gated.writing_now, stored))
        return store.prune_events(before=10.0)  # every event here has ts 1.0

    try:
        gated.armed.set()
        first = writer.submit(WriteBatch(events=[ev("first")]))
        assert gated.writing.wait(10)  # the first transaction is open, held at the gate
        pruned = writer.run_exclusive(prune)
        after = writer.submit(WriteBatch(events=[ev("after")]))
        gated.gate.set()
        assert len(first.result(10)) == 1
        assert pruned.result(10) == 1  # "first" only: "after" waited for the prune
        assert len(after.result(10)) == 1
        with pytest.raises(ZeroDivisionError):
            writer.run_exclusive(lambda store: 1 / 0).result(10)
        assert writer.alive()
    finally:
        writer.close()
    assert seen == [("dsec-writer", False, ["first"])]
    assert [e.data["msg"] for e in gated.query_events(EventQuery(limit=10))] == ["after"]


def test_an_exclusive_call_submitted_while_closing_still_runs(gated: GatedStore) -> None:
    writer = GroupCommitWriter(gated, take_dirty=list, mark_dirty=lambda *ids: None, flush_interval_s=60)
    gated.armed.set()
    writer.submit(WriteBatch(events=[ev("held")]))
    assert gated.writing.wait(10)
    closing = threading.Thread(target=writer.close)
    closing.start()
    late = writer.run_exclusive(lambda store: "ran")
    gated.gate.set()
    closing.join(10)
    assert late.result(10) == "ran"
