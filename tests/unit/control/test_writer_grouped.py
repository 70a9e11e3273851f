"""``GroupCommitWriter.grouped``: what one thread submits inside the block is written in one transaction when the
block ends; other threads' submissions and exclusive calls keep their order and are not held. A real SQLite store."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.control.store import EventQuery, Store, WriteBatch, open_store
from dsec.control.store.sql import SqlStore
from dsec.control.writer import GroupCommitWriter
from dsec.model import Event, EventType

GIVE_THE_WRITER_A_TURN_S = 0.05  # an idle writer takes a queued batch at once: it would commit it alone


def ev(msg: str) -> Event:
    return Event(ts=1.0, type=EventType.LOG, data={"msg": msg})


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    open_store(url).close()  # migrated
    s = SqlStore(url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def writer(store: SqlStore) -> Iterator[GroupCommitWriter]:
    w = GroupCommitWriter(store, take_dirty=list, mark_dirty=lambda *ids: None, flush_interval_s=60)
    try:
        yield w
    finally:
        w.close()


def stored(store: Store) -> list[str]:
    return [e.data["msg"] for e in store.query_events(EventQuery(limit=100))]


def test_batches_submitted_in_a_block_are_written_together_when_it_ends(
    store: SqlStore, writer: GroupCommitWriter
) -> None:
    with writer.grouped():
        futures = []
        for i in range(5):
            futures.append(writer.submit(WriteBatch(events=[ev(f"e{i}")])))
            time.sleep(GIVE_THE_WRITER_A_TURN_S)
        assert not any(f.done() for f in futures)  # held: nothing reached the writer yet
        assert stored(store) == []
    ids = [f.result(10) for f in futures]
    assert writer.commits == 1  # one transaction for the five, though the writer was idle between them
    assert [len(i) for i in ids] == [1] * 5 and sorted(i[0] for i in ids) == [i[0] for i in ids]
    assert stored(store) == ["e0", "e1", "e2", "e3", "e4"]


def test_without_the_block_an_idle_writer_commits_each_batch_as_it_comes(
    store: SqlStore, writer: GroupCommitWriter
) -> None:
    # What the block is for (and that the test above could fail): the same submissions, not held.
    for i in range(3):
        writer.submit(WriteBatch(events=[ev(f"e{i}")])).result(10)
    assert writer.commits == 3


def test_other_threads_are_not_held_and_blocks_nest(store: SqlStore, writer: GroupCommitWriter) -> None:
    with writer.grouped():
        mine = writer.submit(WriteBatch(events=[ev("mine")]))
        theirs: list[list[int]] = []
        other = threading.Thread(
            target=lambda: theirs.append(writer.submit(WriteBatch(events=[ev("theirs")])).result(10))
        )
        other.start()
        other.join(10)
        assert len(theirs) == 1 and stored(store) == ["theirs"]  # written while this thread's block is open
        with writer.grouped():
            inner = writer.submit(WriteBatch(events=[ev("inner")]))
        time.sleep(GIVE_THE_WRITER_A_TURN_S)
        assert not mine.done() and not inner.done()  # the inner block's end is not the block's end
    mine.result(10)
    inner.result(10)
    assert stored(store) == ["theirs", "mine", "inner"]


def test_a_block_left_by_an_exception_still_sends_what_it_held(store: SqlStore, writer: GroupCommitWriter) -> None:
    with pytest.raises(RuntimeError), writer.grouped():
        held = writer.submit(WriteBatch(events=[ev("held")]))
        raise RuntimeError("the request failed midway")
    assert len(held.result(10)) == 1
    assert stored(store) == ["held"]
    after = writer.submit(WriteBatch(events=[ev("after")]))  # the hold ended with the block
    assert len(after.result(10)) == 1


def test_an_exclusive_call_in_a_block_runs_after_the_batches_submitted_before_it(
    store: SqlStore, writer: GroupCommitWriter
) -> None:
    seen: list[list[str]] = []

    def look(s: Store) -> int:
        seen.append(stored(s))
        return len(seen)

    with writer.grouped():
        before = writer.submit(WriteBatch(events=[ev("before")]))
        call = writer.run_exclusive(look)
        after = writer.submit(WriteBatch(events=[ev("after")]))
        assert call.result(10) == 1  # not held: only the batches before it had to be written first
        assert before.done() and not after.done()
    after.result(10)
    assert seen == [["before"]]
    assert stored(store) == ["before", "after"]
