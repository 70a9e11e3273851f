"""Durable writes and the event history: everything the API acknowledges goes through here first.

Durability rule: anything the API acknowledges that is not re-sent by the worker (a registration, an event, a
directive change) is committed through the group-commit writer *before* the answer and applied to the hot state
only after that commit succeeded. Plain metric beats only touch memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from dsec.control import errors
from dsec.control.state import HotState
from dsec.control.store import EventQuery, Store, StoreError, WriteBatch
from dsec.control.writer import GroupCommitWriter
from dsec.model import Event, EventType


class DurableLog:
    """Commits write batches and records events; counts what committed events mean for the hot state (meltdowns,
    restore reports) and hands alert events to ``on_alert`` once they are durable."""

    def __init__(self, state: HotState, store: Store) -> None:
        self.state = state
        self.store = store
        self.writer: GroupCommitWriter | None = None  # bound once the startup state is loaded
        self.on_alert: Callable[[Event], None] = lambda ev: None

    def bind(self, writer: GroupCommitWriter, on_alert: Callable[[Event], None]) -> None:
        self.writer = writer
        self.on_alert = on_alert

    def iter_events(self, *etypes: EventType, since: float | None = None) -> Iterable[Event]:
        after = 0
        while True:
            page = self.store.query_events(EventQuery(types=etypes, since=since, after_id=after, limit=1000))
            yield from page
            if len(page) < 1000:
                return
            after = page[-1].id or after

    async def commit(self, batch: WriteBatch) -> list[int]:
        assert self.writer is not None, "DurableLog.bind() was not called"
        try:
            return await asyncio.wrap_future(self.writer.submit(batch))
        except StoreError as exc:
            raise errors.unavailable(f"state store unavailable, retry later: {exc}") from exc

    async def prune_events(self, before: float, keep: Sequence[EventType]) -> int:
        """Delete events older than ``before`` (but those of types ``keep``) on the writer's thread, between its
        transactions (``GroupCommitWriter.run_exclusive``); how many were deleted."""
        assert self.writer is not None, "DurableLog.bind() was not called"
        try:
            return await asyncio.wrap_future(self.writer.run_exclusive(lambda store: store.prune_events(before, keep)))
        except StoreError as exc:
            raise errors.unavailable(f"state store unavailable, retry later: {exc}") from exc

    def submit(self, batch: WriteBatch) -> None:
        """Write without waiting (from threads that must not block on the store, e.g. webhook outcomes)."""
        assert self.writer is not None, "DurableLog.bind() was not called"
        self.writer.submit(batch)

    async def record_events(self, events: list[Event]) -> list[int]:
        ids = await self.commit(WriteBatch(events=events))
        self.observe(events)
        return ids

    def observe(self, events: Iterable[Event]) -> None:
        """What committed events change in the hot state (also replayed at startup for meltdowns)."""
        for ev in events:
            self.count(ev)
            if ev.type is EventType.ALERT:
                self.on_alert(ev)
            else:
                self.note_restore(ev)

    def note_restore(self, ev: Event) -> None:
        """A worker's restore time (its latest per pool), for ``decide.pool_recovery_s``; also replayed at startup."""
        if ev.type is EventType.RESTORE and ev.pool and ev.worker_id:
            # Validated at the edge (schemas.EventIn); aggregated per distinct worker (decide.pool_recovery_s).
            restore_s = ev.data.get("restore_s")
            if isinstance(restore_s, (int, float)) and not isinstance(restore_s, bool):
                self.state.restore_reports.setdefault(ev.pool, {})[ev.worker_id] = float(restore_s)

    def count(self, ev: Event) -> None:
        """Meltdown counters, per pool and per worker: from committed events only (also at startup)."""
        if ev.type is EventType.MELTDOWN:
            if ev.pool:
                self.state.meltdowns[ev.pool] += 1
            if ev.worker_id:
                self.state.worker_meltdowns[ev.worker_id] += 1
