"""Group commit: one writer thread turns many requests' writes into few transactions.

Requests that must be durable before they are answered (a registration, a heartbeat carrying events,
a directive change) ``submit`` a batch and await its future. The thread takes everything queued
while the previous transaction was running and writes it in one transaction together with the hot
rows marked dirty since — so under load the number of commits stays roughly constant while the
number of requests per commit grows. Heartbeats without events never wait for the database at all.

Maintenance writes that are not a batch (event retention's DELETE) run on the same thread between two
transactions (``run_exclusive``), so this process never holds two write transactions at once: SQLite has one
writer, and a long DELETE from another thread made a group commit fail with "database is locked" under load.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from dsec.control.store import HotRow, PlacementRow, Store, StoreConflict, WorkerRow, WriteBatch
from dsec.model import Pool

log = logging.getLogger(__name__)

_STOP = object()
T = TypeVar("T")


@dataclass
class _Group:
    """Batches submitted inside one ``grouped`` block, queued as one: the writer takes them into the same
    transaction (with whatever else is queued then)."""

    items: list[tuple[WriteBatch, Future[list[int]]]]


@dataclass
class _Exclusive:
    """A call to run on the writer thread, after the batches queued before it are written."""

    fn: Callable[[Store], Any]
    fut: Future[Any]


class GroupCommitWriter:
    """Owns the only writing connection. ``close()`` flushes everything and joins the thread."""

    def __init__(
        self,
        store: Store,
        take_dirty: Callable[[], list[HotRow]],
        mark_dirty: Callable[..., None],
        flush_interval_s: float = 0.25,
        max_batch: int = 2000,
        max_hot_rows: int = 1000,
    ) -> None:
        self._store = store
        self._take_dirty = take_dirty
        self._mark_dirty = mark_dirty
        self._interval = flush_interval_s
        self._max_batch = max_batch
        self._max_hot_rows = max_hot_rows
        self._queue: queue.Queue[Any] = queue.Queue()
        self._due: list[_Exclusive] = []  # drained exclusive calls, run once the batches before them are written
        self._held = threading.local()  # per thread: the batches submitted inside its open ``grouped`` block
        self.commits = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="dsec-writer", daemon=True)
        self._thread.start()

    def submit(self, batch: WriteBatch) -> Future[list[int]]:
        fut: Future[list[int]] = Future()
        # Running from the start: a caller that stops waiting (a cancelled request or reconcile pass)
        # cannot cancel a write that will happen anyway, so the writer can always settle the future.
        fut.set_running_or_notify_cancel()
        held: list[tuple[WriteBatch, Future[list[int]]]] | None = getattr(self._held, "items", None)
        if held is not None:
            held.append((batch, fut))
        else:
            self._queue.put((batch, fut))
        return fut

    @contextmanager
    def grouped(self) -> Iterator[None]:
        """Batches this thread submits inside the block reach the writer together when it ends, so they are
        written in one transaction, not in as many as the writer could start while they were being submitted.

        For a request that submits many batches in one go: a batch of 500 heartbeats is applied in ~20 ms of
        Python, and its beats that carry events submit a batch each as they come. The writer, idle, took each one
        as it came and committed it nearly alone (~2 batches a commit at 1% of beats carrying events), and every
        commit's SQLite calls took the GIL back from the event loop several times; beats with events cost about a
        third of one process's ingest throughput (benchmarks/beat_ceiling.py, docs/benchmarks.md). With the block,
        about one commit a request. The batches' futures start a little later (when the block ends); the request's
        answer, which waits for all of them, waits about as long as before (its last items' commit came after the
        block's end anyway). Nested blocks are one block; other threads' submissions are not held."""
        if getattr(self._held, "items", None) is not None:
            yield
            return
        self._held.items = []
        try:
            yield
        finally:
            held, self._held.items = self._held.items, None
            if held:
                self._queue.put(_Group(held))

    def run_exclusive(self, fn: Callable[[Store], T]) -> Future[T]:
        """Run ``fn(store)`` on the writer thread once the batches submitted before it are written, with no
        transaction of this writer open beside it; its result (or exception) settles the future."""
        fut: Future[T] = Future()
        fut.set_running_or_notify_cancel()
        held = getattr(self._held, "items", None)
        if held:  # submitted before it inside a ``grouped`` block: written before it runs, as without the block
            self._queue.put(_Group(held))
            self._held.items = []
        self._queue.put(_Exclusive(fn, fut))
        return fut

    def _drain(self, first: Any) -> tuple[list[tuple[WriteBatch, Future[list[int]]]], bool]:
        """The batches queued now (up to ``max_batch``); stops at an exclusive call, which waits in ``_due`` for
        them to be written (the batches after it stay queued until it ran)."""
        items, stop = [], False
        item = first
        while True:
            if item is _STOP:
                stop = True
            elif isinstance(item, _Exclusive):
                self._due.append(item)
                break
            elif isinstance(item, _Group):  # taken whole (one request's writes: at most MAX_BATCH_ITEMS)
                items.extend(item.items)
            elif item is not None:
                items.append(item)
            if len(items) >= self._max_batch:
                break
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        return items, stop

    def _run(self) -> None:
        next_flush = time.monotonic() + self._interval
        stop = False
        while not stop:
            try:
                first = self._queue.get(timeout=max(0.0, next_flush - time.monotonic()))
            except queue.Empty:
                first = None
            items, stop = self._drain(first)
            # Hot rows go out on the timer only. Taking them with every event commit would, under load,
            # rewrite about one row per heartbeat and keep this thread (and the GIL) busy.
            if stop or time.monotonic() >= next_flush:
                next_flush = time.monotonic() + self._interval
                stop = self._flush(items) or stop
            else:
                self._commit(items, [])
            self._run_due()
        # Anything submitted after close() began still gets written (and run).
        while True:
            leftover, _ = self._drain(None)
            self._flush(leftover)
            if not self._due:
                break
            self._run_due()

    def _run_due(self) -> None:
        due, self._due = self._due, []
        for call in due:
            try:
                call.fut.set_result(call.fn(self._store))
            except Exception as exc:  # the caller gets it; the writer goes on
                call.fut.set_exception(exc)

    def _flush(self, items: list[tuple[WriteBatch, Future[list[int]]]]) -> bool:
        """Write the dirty hot rows with ``items``: at most ``max_hot_rows`` per transaction, the requests queued
        meanwhile riding along with the next one. At 10,000 workers one transaction of every dirty row held a
        request carrying events (answered only once committed) for the whole flush, hundreds of ms; now for at most
        one part of it. Returns whether ``close()`` was asked for meanwhile."""
        pending = self._take_dirty()
        # Workers a request of this flush wrote (or deleted): a dirty copy taken before is older than that row, so
        # a later part must not write it over it (within one transaction ``merge_batches`` already prefers it).
        superseded: set[str] = set()
        stop = False
        while True:
            part = [w for w in pending[: self._max_hot_rows] if w.id not in superseded]
            pending = pending[self._max_hot_rows :]
            if not self._commit(items, part):
                self._mark_dirty(*(w.id for w in pending if w.id not in superseded))
                return stop
            if not pending:
                return stop
            for batch, _ in items:
                superseded.update(w.id for w in batch.workers)
                superseded.update(batch.deleted_workers)
            items, stopped = self._drain(None)
            stop = stop or stopped

    def _commit(self, items: list[tuple[WriteBatch, Future[list[int]]]], dirty: list[HotRow]) -> bool:
        """One transaction of ``items`` and the hot rows ``dirty``; False when the rows were not written (they are
        marked dirty again: the next flush retries them)."""
        if not items and not dirty:
            return True
        merged: WriteBatch | None = None
        try:
            # Inside the try: a batch that cannot be merged (a bug that built a malformed one) must fail its own
            # request, not end this thread — every later commit, and the beats behind them, would wait forever.
            merged = merge_batches(dirty, [batch for batch, _ in items])
            ids = self._store.write(merged)
        except Exception as exc:  # the database may be down; callers get the error, hot rows retry
            self._mark_dirty(*(w.id for w in dirty))
            if (merged is None or isinstance(exc, StoreConflict)) and len(items) > 1:
                # One request contradicts the stored state (a policy version another control plane took) or
                # cannot be merged: the requests merged with it are fine on their own, so each is written alone.
                for item in items:
                    self._commit([item], [])
                return False
            self.failures += 1
            if merged is None:
                log.error("a write batch could not be merged (%d requests)", len(items), exc_info=exc)
            else:
                log.warning(
                    "store write failed (%d rows, %d requests): %s",
                    len(merged.workers) + len(merged.hot),
                    len(items),
                    exc,
                )
            for _, fut in items:
                fut.set_exception(exc)
            return False
        self.commits += 1
        offset = 0
        for batch, fut in items:
            n = len(batch.events)
            fut.set_result(ids[offset : offset + n])
            offset += n
        return True

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=30)

    def __enter__(self) -> GroupCommitWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merge_batches(dirty: list[HotRow], batches: list[WriteBatch]) -> WriteBatch:
    """Requests' batches (in submission order) and the dirty hot rows as one batch.

    A request's own row of a worker (not yet applied to the hot state) is newer than the dirty copy taken from it, so
    a worker with a row in a request is not written back from its copy; nor is a worker a request deletes. Pools and
    placements keep only their last change (an upsert or a deletion), so a pool deleted and re-created by two
    requests of the same transaction ends up re-created."""
    rows: dict[str, WorkerRow] = {}
    hot = {h.id: h for h in dirty}
    merged = WriteBatch()
    pools: dict[str, tuple[Pool, float] | None] = {}
    placements: dict[str, PlacementRow | None] = {}
    for batch in batches:
        rows.update((w.id, w) for w in batch.workers)
        hot.update((h.id, h) for h in batch.hot)
        merged.directives.extend(batch.directives)
        merged.events.extend(batch.events)
        merged.deleted_workers.extend(batch.deleted_workers)
        merged.devices.extend(batch.devices)
        merged.policies.extend(batch.policies)
        pools.update((p.name, (p, at)) for p, at in batch.pools)
        pools.update(dict.fromkeys(batch.deleted_pools))
        placements.update((p.job, p) for p in batch.placements)
        placements.update(dict.fromkeys(batch.released_placements))
    # A deleted worker's row must not be written back by the same transaction.
    gone = set(merged.deleted_workers)
    merged.workers = [w for w in rows.values() if w.id not in gone]
    merged.hot = [h for h in hot.values() if h.id not in gone and h.id not in rows]
    merged.directives = [d for d in merged.directives if d.worker_id not in gone]
    merged.pools = [p for p in pools.values() if p is not None]
    merged.deleted_pools = [name for name, p in pools.items() if p is None]
    merged.placements = [p for p in placements.values() if p is not None]
    merged.released_placements = [job for job, p in placements.items() if p is None]
    return merged
