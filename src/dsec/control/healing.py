"""The control plane's side of healing: one membership group per run (heal/membership.py), long-polls, the join
timeout, and a durable record of every epoch.

Routes (``/v1/heal/{run}``; a run is one launch of a group — ``dsec launch`` / ``dsec run --heal`` name it — so a
new launch never meets an old one's members). Members authenticate with their pool's token, supervisors with an
admin token; a run belongs to the pool of its first request.

- ``POST join`` — join the next epoch (or the first); answered with its :class:`Plan` once formed (long-poll; after
  ``poll_s`` without one, ``202 {"status": "waiting"}`` and the member asks again). ``409`` when fenced.
- ``POST admit`` — this member is at the agreed admission point; answered with the new epoch's plan, or
  ``{"status": "broken"}`` when the epoch failed meanwhile (then it joins instead), or ``{"status": "void"}``.
- ``POST fail`` — the epoch is broken (a member's collective failed, or a supervisor saw ``dead_rank`` exit).
- ``POST leave`` — a member finished cleanly.
- ``GET watch?since=V`` — long-poll until the group's version passes ``V``: epoch, phase, waiting replacements.
  A run's versions start at its creation time in milliseconds, so a restarted control plane's are above the
  previous one's and a member's ``V`` from before the restart is answered at once (as is any ``V`` above the
  current version).
- ``GET`` — the group's state (admin or the run's pool).

Every formed epoch, failure, admission and fencing is recorded as a ``heal`` event (``data.run``); at start the
highest epoch of each run is read back, so epoch numbers never repeat across control-plane restarts (a member that
re-joins after a restart rebuilds the membership from its own view).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dsec.control import errors
from dsec.control.errors import ApiError
from dsec.control.heal_bodies import AdmitBody, FailBody, JoinBody, LeaveBody
from dsec.control.store import EventQuery, Store
from dsec.heal.membership import Fenced, Group, Invalid, Join, Phase
from dsec.model import Event, EventType

log = logging.getLogger(__name__)


@dataclass
class _Run:
    run: str
    pool: str
    group_name: str
    group: Group
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    # Start: HealRegistry.first_version() (above any version a previous control plane handed out).
    version: int = 1


class HealRegistry:
    """Membership groups by run, shared by the heal routes. Single event loop: no locks beyond the conditions."""

    def __init__(
        self,
        record: Callable[[list[Event]], Awaitable[Any]],
        clock: Callable[[], float] = time.time,
        join_timeout_s: float = 5.0,
        poll_s: float = 20.0,
        epochs: dict[str, int] | None = None,
    ) -> None:
        self._record = record
        self._clock = clock
        self.join_timeout_s = join_timeout_s
        self.poll_s = poll_s
        self.runs: dict[str, _Run] = {}
        self._epochs = dict(epochs or {})  # run -> highest epoch recorded (from the store at start)

    # -- access -------------------------------------------------------------------------------------------
    def _get(self, run: str, token_pool: str | None, admin: bool) -> _Run:
        """The run, for a caller allowed to see it. Authentication comes first: to a non-admin token an unknown run
        answers like another pool's (403), so runs cannot be probed for."""
        r = self.runs.get(run)
        if r is None:
            if not admin:
                raise errors.forbidden("this token may not act on this run")
            raise errors.not_found("healing run", run, "run")
        self._authorize(r, None, token_pool, admin)
        return r

    def _get_or_create(self, run: str, pool: str, group: str, world: int) -> _Run:
        r = self.runs.get(run)
        if r is None:
            g = Group(world=world, join_timeout_s=self.join_timeout_s, epoch=self._epochs.get(run, 0))
            r = self.runs[run] = _Run(run, pool, group, g, version=self.first_version())
        return r

    def first_version(self) -> int:
        """A new run's first version: the time in milliseconds. A member watching across a control-plane restart
        holds a version of the previous control plane's; counting from 1 again, this one would keep its watch
        waiting (up to the poll time) for the version to pass it while the group broke, and the member (blocked in
        a collective with a live peer) would join too late. Starting above it (a previous control plane cannot have
        made more changes than milliseconds passed) answers its watch at once, with the group as it is now."""
        return max(1, int(self._clock() * 1000))

    @staticmethod
    def _authorize(r: _Run | None, pool: str | None, token_pool: str | None, admin: bool) -> None:
        if admin:
            return
        if token_pool is None:
            raise errors.forbidden("a pool token or an admin token is required")
        if (r is not None and r.pool != token_pool) or (pool is not None and pool != token_pool):
            raise errors.forbidden("this token may not act on this run")

    async def _apply(self, r: _Run, notes: list[dict[str, Any]]) -> None:
        if notes:
            now = self._clock()
            await self._record(
                [
                    Event(ts=now, type=EventType.HEAL, pool=r.pool, data={"run": r.run, "group": r.group_name, **n})
                    for n in notes
                ]
            )
            self._epochs[r.run] = max(self._epochs.get(r.run, 0), r.group.epoch)
        r.version += 1
        async with r.cond:
            r.cond.notify_all()

    async def _wait(
        self, r: _Run, done: Callable[[], Any], timeout: float, gone: Callable[[], Awaitable[bool]] | None = None
    ) -> Any:
        """Wait until ``done()`` is truthy (returned), ticking the group's join timeout; None after ``timeout`` or
        once ``gone()`` says the client hung up (a killed member's long-poll must not live on for its 20 s)."""
        deadline = time.monotonic() + timeout
        while True:
            if gone is not None and await gone():
                return None
            seen = r.version
            value = done()
            if value:
                return value
            notes = r.group.tick(self._clock())
            if notes:
                await self._apply(r, notes)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            due = r.group.deadline()
            if due is not None:
                left = min(left, max(0.01, due - self._clock()))
            if gone is not None:
                left = min(left, 0.5)
            async with r.cond:
                if r.version != seen:
                    continue  # changed while we looked: look again before sleeping
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(r.cond.wait(), left)

    @staticmethod
    def _fenced(exc: Fenced) -> ApiError:
        return ApiError(409, "fenced", str(exc), "incarnation")

    @staticmethod
    def _conflict(exc: Invalid, field: str | None = None) -> ApiError:
        """A valid body the run's state refuses (another world size, a rank beyond it, an epoch ahead of it): 409,
        not 422, since the same body is fine for another run. Without ``field``, the one the message starts with."""
        head = str(exc).split("=", 1)[0].split(" ", 1)[0]
        return errors.conflict(str(exc), field or (head if head in ("world", "rank", "epoch") else "body"))

    # -- operations ---------------------------------------------------------------------------------------------
    async def join(
        self,
        run: str,
        body: JoinBody,
        token_pool: str | None,
        admin: bool,
        gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        self._authorize(self.runs.get(run), body.pool, token_pool, admin)
        r = self._get_or_create(run, body.pool, body.group, body.world)
        j = Join(
            rank=body.rank,
            incarnation=body.incarnation,
            address=body.address,
            completed=body.completed,
            epoch=body.epoch,
            view=tuple(body.view),
            replacement=body.replacement,
            device=body.device,
            pending=body.pending,
        )
        held = r.group.members.get(j.rank)
        if not (held is not None and held.incarnation == j.incarnation and r.group.epoch > j.epoch):
            # Not yet answered: a repeated join (after a 202) is the same request, applied again harmlessly.
            try:
                notes = r.group.join(j, self._clock(), world=body.world)
            except Fenced as exc:
                await self._apply(
                    r, [{"what": "fenced", "rank": j.rank, "incarnation": j.incarnation, "why": str(exc)}]
                )
                raise self._fenced(exc) from None
            except Invalid as exc:
                raise self._conflict(exc) from None
            await self._apply(r, notes)

        def formed() -> dict[str, Any] | None:
            g = r.group
            m = g.members.get(j.rank)
            if g.plan is not None and g.epoch > j.epoch and m is not None and m.incarnation == j.incarnation:
                return {"status": "formed", "plan": g.plan.to_dict(), "version": r.version}
            return None

        plan = await self._wait(r, formed, self.poll_s, gone)
        if plan is None:
            return 202, {"status": "waiting", "view": r.group.view(), "version": r.version}
        return 200, plan

    async def admit(
        self,
        run: str,
        body: AdmitBody,
        token_pool: str | None,
        admin: bool,
        gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> dict[str, Any]:
        r = self._get(run, token_pool, admin)
        start_epoch = r.group.epoch
        try:
            notes = r.group.admit(body.rank, body.incarnation, body.epoch, body.completed, self._clock())
        except Fenced as exc:
            raise self._fenced(exc) from None
        except Invalid as exc:
            raise ApiError(409, "not_member", str(exc), "epoch") from None
        await self._apply(r, notes)

        def settled() -> dict[str, Any] | None:
            g = r.group
            if g.epoch > start_epoch and g.plan is not None and body.rank in g.members:
                return {"status": "formed", "plan": g.plan.to_dict(), "version": r.version}
            if g.phase is Phase.BROKEN:
                return {"status": "broken", "view": g.view(), "version": r.version}
            if g.phase is Phase.STABLE and g.epoch == start_epoch:
                return {"status": "void", "view": g.view(), "version": r.version}
            return None

        out = await self._wait(r, settled, self.poll_s, gone)
        return out or {"status": "waiting", "view": r.group.view(), "version": r.version}

    async def fail(self, run: str, body: FailBody, token_pool: str | None, admin: bool) -> dict[str, Any]:
        r = self.runs.get(run)
        self._authorize(r, body.pool, token_pool, admin)
        if r is None:
            if body.pool is None or body.world is None:
                # Nothing known about this run (it never started, or the control plane lost it and nobody re-joined
                # yet): the members' own joins will rebuild it; there is nothing to break here.
                return {"status": "unknown"}
            r = self._get_or_create(run, body.pool, "default", body.world)
        incarnation = body.dead_incarnation
        if incarnation is None and body.dead_pid is not None and body.dead_rank is not None:
            held = [r.group.members.get(body.dead_rank), r.group.joiners.get(body.dead_rank)]
            found = [j.incarnation for j in held if j is not None and j.incarnation.startswith(f"{body.dead_pid}-")]
            if not found:
                # That process never joined (or was already dropped): nothing of the group's changes.
                return {"status": "unknown_process", "view": r.group.view(), "version": r.version}
            incarnation = found[0]
        try:
            notes = r.group.fail(
                r.group.epoch if body.epoch is None else body.epoch,
                self._clock(),
                dead_rank=body.dead_rank,
                incarnation=incarnation,
                reason=body.reason,
            )
        except Invalid as exc:
            raise self._conflict(exc, "dead_rank") from None
        await self._apply(r, notes)
        return {"status": "ok", "view": r.group.view(), "version": r.version}

    async def leave(self, run: str, body: LeaveBody, token_pool: str | None, admin: bool) -> dict[str, Any]:
        r = self._get(run, token_pool, admin)
        try:
            notes = r.group.leave(body.rank, body.incarnation)
        except Invalid as exc:
            raise self._conflict(exc, "rank") from None
        await self._apply(r, notes)
        return {"status": "ok"}

    async def watch(
        self,
        run: str,
        since: int,
        token_pool: str | None,
        admin: bool,
        timeout: float,
        gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> dict[str, Any]:
        r = self._get(run, token_pool, admin)
        if since <= r.version:  # above it: a version this control plane never handed out, answered at once
            await self._wait(r, lambda: r.version > since, min(timeout, self.poll_s), gone)
        return {"version": r.version, **r.group.view()}

    def state(self, run: str, token_pool: str | None, admin: bool) -> dict[str, Any]:
        r = self._get(run, token_pool, admin)
        plan = r.group.plan.to_dict() if r.group.plan is not None else None
        return {
            "run": r.run,
            "pool": r.pool,
            "group": r.group_name,
            "version": r.version,
            "plan": plan,
            **r.group.view(),
        }


def epochs_from_store(store: Store) -> dict[str, int]:
    """The highest epoch recorded per run (``heal`` events carry ``data.run`` and ``data.epoch``)."""
    out: dict[str, int] = {}
    after = 0
    while True:
        page = store.query_events(EventQuery(types=(EventType.HEAL,), after_id=after, limit=1000))
        for ev in page:
            run, epoch = ev.data.get("run"), ev.data.get("epoch")
            if isinstance(run, str) and isinstance(epoch, int):
                out[run] = max(out.get(run, 0), epoch)
        if len(page) < 1000:
            return out
        after = max(ev.id or 0 for ev in page)
