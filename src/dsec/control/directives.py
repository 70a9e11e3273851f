"""Directive versions: every change is a new version, durable before it is in force."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from dsec.control import errors
from dsec.control.eventlog import DurableLog
from dsec.control.ports import Clock
from dsec.control.state import LiveWorker
from dsec.control.store import WriteBatch
from dsec.decide import Verdict
from dsec.model import Directive, Event, EventType, ModelError, WorkerState

logger = logging.getLogger(__name__)


class Directives:
    def __init__(self, log: DurableLog, clock: Clock) -> None:
        self.log = log
        self.clock = clock

    async def set_directive(
        self, w: LiveWorker, patch: Mapping[str, Any], actor: str, extra_events: Sequence[Event] = ()
    ) -> Directive:
        # Serialised per worker: two concurrent patches must yield two versions, not one lost update.
        async with w.lock:
            return await self._set_directive(w, patch, actor, extra_events)

    async def _set_directive(
        self, w: LiveWorker, patch: Mapping[str, Any], actor: str, extra_events: Sequence[Event] = ()
    ) -> Directive:
        if w.state is WorkerState.DEREGISTERED:
            raise errors.conflict(f"worker_id {w.id!r} has deregistered; directives no longer apply", "worker_id")
        try:
            fields = w.directive.fields.merged(patch)
        except ModelError as exc:
            raise errors.ApiError(422, "invalid", str(exc), str(exc).split("=", 1)[0].split(" ")[0]) from exc
        now = self.clock()
        new = Directive(worker_id=w.id, version=w.directive.version + 1, fields=fields, updated_at=now)
        ev = directive_event(w, new, patch, actor, now)
        await self.log.commit(WriteBatch(directives=[new], events=[ev, *extra_events]))
        self.log.observe(extra_events)
        w.directive = new
        return new


def directive_from(w: LiveWorker, verdict: Verdict, now: float) -> Directive | None:
    """The next directive version carrying a judgment's patch; None when it changes nothing."""
    if not verdict.patch:
        return None
    try:
        fields = w.directive.fields.merged(verdict.patch)
    except ModelError:
        logger.exception("judgment produced an invalid directive for %s: %s", w.id, verdict.patch)
        return None
    if fields == w.directive.fields and not verdict.breaker_issued:
        return None
    # An unchanged directive still gets a new version when the breaker issued it: the breaker moves
    # on only once the worker acks a version carrying its level.
    return Directive(worker_id=w.id, version=w.directive.version + 1, fields=fields, updated_at=now)


def directive_event(w: LiveWorker, d: Directive, patch: Mapping[str, Any], actor: str, now: float) -> Event:
    return Event(
        ts=now,
        type=EventType.DIRECTIVE_SET,
        worker_id=w.id,
        pool=w.pool,
        data={"version": d.version, "changes": dict(patch), "by": actor},
    )
