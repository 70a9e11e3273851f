"""Membership of a healing group: epochs, quorum, admission and fencing, as a pure state machine.

A *group* is the ranks of one data-parallel job (logical ranks ``0..world-1``, one process each). Its members train
in *epochs*: an epoch is one process group over a fixed set of members, created from a store hosted by one of them.
Every collective of the job (gradient syncs and the script's own collectives) runs on the current epoch's group,
one at a time and in the same order on every member, so each member can say how many it has *completed*.

- **Start.** Every rank joins (``epoch=0``); when all ``world`` ranks are in, epoch 1 is formed.
- **Failure.** A member whose collective fails, or the supervisor that saw a rank exit, reports the epoch broken
  (``fail``). Surviving members re-join with their completed count; epoch ``e+1`` is formed as soon as every member
  not known dead has joined, or ``join_timeout_s`` after the failure with whoever joined (the rest are dead).
  Members agree on the interrupted collective: let ``M`` be the highest completed count; a member at ``M - 1`` was
  interrupted in a collective someone else finished, so it receives that collective's result from the *source* (a
  member at ``M``) instead of running it again; a member at ``M`` whose collective was interrupted runs it again
  in the new epoch. Collectives are one at a time, so no member can be further behind than ``M - 1``.
- **Admission.** A replacement (a fresh process for a dead rank) joins with ``replacement=True`` and waits. Members
  agree (in their gradient-sync header) that they know of it and, at the next point where their sequence of
  collectives starts over (the replacement's program starts there too), each calls ``admit`` with its completed
  count ``Q``. When every member has, epoch ``e+1`` = members + waiting replacements; the replacements receive the
  model and optimizer state from the source, and everyone continues at collective ``Q``.
- **Fencing.** Every request names the member's rank, *incarnation* (one per process) and epoch. A rank is held by
  one incarnation; a request from another incarnation of a rank whose holder is alive, or from an incarnation
  declared dead, is refused (:class:`Fenced`): that process must stop, it cannot rejoin an old epoch. Epoch numbers
  only grow; the executor persists the highest one so a restarted control plane never reuses a number. A group
  rebuilt after such a restart knows the ranks of a member's view without their incarnations: a replacement for
  one of them declares it dead (replacements are started once the rank's process exited), and an original member
  the group re-formed without is refused by its epoch (older than the group's) instead of its incarnation.

Everything here is a function of (state, request, now): the control plane (control/healing.py) does the waiting,
the persistence and the I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

from dsec.errors import HealingError

UNKNOWN = "?"  # the incarnation of a member known only from another member's view (after an executor restart)


class Phase(str, enum.Enum):
    FORMING = "forming"  # waiting for the initial members
    STABLE = "stable"  # the current epoch's process group works
    BROKEN = "broken"  # the current epoch failed; survivors are joining the next one
    ADMITTING = "admitting"  # members are at the agreed admission point


class Fenced(HealingError):
    """The requesting process may not take part in the group any more (it must stop)."""


class Invalid(HealingError):
    """A request that contradicts the group's state (wrong world size, a rank out of range, ...)."""


@dataclass(frozen=True)
class Join:
    """A member's report when it joins the next epoch."""

    rank: int
    incarnation: str
    address: str  # host:port of the store server this member can host
    completed: int = 0  # collectives of the group's sequence it has completed
    epoch: int = 0  # the epoch it last belonged to (0: none yet)
    view: tuple[int, ...] = ()  # members of that epoch, as it knows them (rebuilds a group the executor lost)
    replacement: bool = False
    device: str | None = None
    pending: str | None = None  # the collective it is blocked at (its signature): members level with it must agree


@dataclass(frozen=True)
class Plan:
    """A new epoch, as every member of it receives it."""

    epoch: int
    members: tuple[int, ...]  # logical ranks in process-group order (a member's pg rank is its index)
    store: str  # host:port of the epoch's rendezvous store (the source's)
    completed: int  # the group's completed count at the start of the epoch
    source: int  # the member that sends results and state
    behind: tuple[int, ...] = ()  # members at completed - 1: they receive the interrupted collective's result
    joiners: tuple[int, ...] = ()  # replacements: they receive the model and optimizer state
    dead: tuple[int, ...] = ()  # ranks of the previous epoch that are gone
    reason: str = "start"  # start | failure | admission
    # Members level with each other were blocked at different collectives: their scripts took different paths
    # (a decision on a counter of their own, say). No epoch can pair them again; they must stop.
    diverged: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "members": list(self.members),
            "store": self.store,
            "completed": self.completed,
            "source": self.source,
            "behind": list(self.behind),
            "joiners": list(self.joiners),
            "dead": list(self.dead),
            "reason": self.reason,
            "diverged": self.diverged,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        return cls(
            epoch=int(d["epoch"]),
            members=tuple(int(r) for r in d["members"]),
            store=str(d["store"]),
            completed=int(d["completed"]),
            source=int(d["source"]),
            behind=tuple(int(r) for r in d.get("behind", ())),
            joiners=tuple(int(r) for r in d.get("joiners", ())),
            dead=tuple(int(r) for r in d.get("dead", ())),
            reason=str(d.get("reason", "start")),
            diverged=bool(d.get("diverged", False)),
        )


@dataclass
class Group:
    """One healing group's membership. Mutated only through the methods below; each returns what changed as
    ``notes`` (dicts the executor records as events)."""

    world: int
    join_timeout_s: float = 5.0
    epoch: int = 0
    phase: Phase = Phase.FORMING
    members: dict[int, Join] = field(default_factory=dict)  # the current epoch's
    joins: dict[int, Join] = field(default_factory=dict)  # joined the next epoch
    joiners: dict[int, Join] = field(default_factory=dict)  # replacements waiting for admission
    admits: dict[int, int] = field(default_factory=dict)  # rank -> completed count at its admission point
    dead: dict[int, str] = field(default_factory=dict)  # rank -> incarnation declared dead (since the last epoch)
    broken_at: float | None = None
    plan: Plan | None = None  # the current epoch's
    formed_at: float | None = None  # when the current epoch formed
    left: set[int] = field(default_factory=set)  # members that finished (left cleanly)

    def __post_init__(self) -> None:
        if self.world < 1:
            raise Invalid(f"world={self.world} is invalid: expected >= 1")

    # -- checks ---------------------------------------------------------------------------------------------
    def _check_rank(self, rank: int, world: int | None = None) -> None:
        if world is not None and world != self.world:
            raise Invalid(f"world={world} does not match the group's world size {self.world}")
        if not 0 <= rank < self.world:
            raise Invalid(f"rank={rank} is out of range for world size {self.world}")

    def _fence(self, rank: int, incarnation: str) -> None:
        """Refuse an incarnation that was declared dead, or that would take a live member's rank."""
        if self.dead.get(rank) == incarnation:
            raise Fenced(f"rank {rank} ({incarnation}) was declared dead in epoch {self.epoch}: it must stop")
        holder = self.members.get(rank)
        if holder is not None and holder.incarnation not in (incarnation, UNKNOWN) and rank not in self.dead:
            raise Fenced(f"rank {rank} is held by another live process ({holder.incarnation}) in epoch {self.epoch}")

    def is_member(self, rank: int, incarnation: str) -> bool:
        m = self.members.get(rank)
        return m is not None and m.incarnation in (incarnation, UNKNOWN) and rank not in self.dead

    # -- requests -------------------------------------------------------------------------------------------
    def join(self, j: Join, now: float, world: int | None = None) -> list[dict[str, Any]]:
        self._check_rank(j.rank, world)
        notes: list[dict[str, Any]] = []
        if j.epoch > 0 and not self.members and not self.joins:
            # The executor lost the group (a restarted control plane): the member's view rebuilds it. A member
            # of an epoch older than the newest the executor remembers missed later epochs: it is stale.
            if j.epoch < self.epoch:
                raise Fenced(f"rank {j.rank} belongs to epoch {j.epoch}; the group has reached epoch {self.epoch}")
            self.epoch = j.epoch
            self.members = {r: Join(r, UNKNOWN, "", epoch=j.epoch) for r in j.view}
            self.phase = Phase.STABLE
        elif j.epoch > self.epoch:
            raise Invalid(f"epoch {j.epoch} is ahead of the group's epoch {self.epoch}")
        if self.phase is Phase.FORMING and not j.replacement:
            if j.epoch != 0:
                raise Fenced(f"rank {j.rank} joined with epoch {j.epoch} while the group is forming its first epoch")
            prior = self.joins.get(j.rank)
            if prior is not None and prior.incarnation != j.incarnation:
                raise Fenced(f"rank {j.rank} already joined as {prior.incarnation}")
            self.joins[j.rank] = j
            if len(self.joins) == self.world:
                notes.append(self._form("start", now))
            return notes
        self._fence(j.rank, j.incarnation)
        if j.replacement or j.rank not in self.members:
            if j.rank in self.members and j.rank not in self.dead:
                if self.members[j.rank].incarnation != UNKNOWN:
                    raise Fenced(f"rank {j.rank} is still a live member of epoch {self.epoch}")
                # Held only in a peer's view (the executor restarted, so its process is unknown): a replacement is
                # started once the rank's process exited, so the rank is dead and the survivors need not wait for it
                # (nor its join timeout).
                self.dead[j.rank] = UNKNOWN
            elif not j.replacement and 0 < j.epoch < self.epoch:
                # An original member the group re-formed without (declared dead while the executor knew it only
                # from a peer's view, so not by its incarnation): its process is behind the group, it must stop.
                raise Fenced(
                    f"rank {j.rank} belongs to epoch {j.epoch}; the group reached epoch {self.epoch} without it"
                )
            self.joiners[j.rank] = j
            notes.append({"what": "waiting", "rank": j.rank, "incarnation": j.incarnation, "epoch": self.epoch})
            notes.extend(self._maybe_form(now))
            return notes
        if self.phase in (Phase.STABLE, Phase.ADMITTING):
            # It saw its collective fail before anyone told us: the epoch is broken.
            notes.extend(self.fail(self.epoch, now, reason=f"rank {j.rank} joined the next epoch"))
        self.joins[j.rank] = j
        notes.extend(self._maybe_form(now))
        return notes

    def fail(
        self, epoch: int, now: float, dead_rank: int | None = None, incarnation: str | None = None, reason: str = ""
    ) -> list[dict[str, Any]]:
        """Epoch ``epoch`` is broken (a collective failed, or ``dead_rank`` exited). Stale reports change nothing."""
        notes: list[dict[str, Any]] = []
        if dead_rank is not None:
            self._check_rank(dead_rank)
            waiting = self.joiners.get(dead_rank)
            if waiting is not None and (incarnation is None or waiting.incarnation == incarnation):
                # A replacement that died while waiting for admission: nothing else changes.
                del self.joiners[dead_rank]
                notes.append({"what": "joiner_lost", "rank": dead_rank, "reason": reason})
                if incarnation is not None or dead_rank not in self.members:
                    return notes
            holder = self.members.get(dead_rank)
            if holder is not None and (incarnation is None or holder.incarnation in (incarnation, UNKNOWN)):
                self.dead[dead_rank] = holder.incarnation
                self.joins.pop(dead_rank, None)
        if epoch < self.epoch or self.phase is Phase.FORMING:
            notes.extend(self._maybe_form(now))
            return notes
        if self.phase is not Phase.BROKEN:
            self.phase = Phase.BROKEN
            self.broken_at = now
            self.admits.clear()
            notes.append({"what": "broken", "epoch": self.epoch, "dead_rank": dead_rank, "reason": reason})
        notes.extend(self._maybe_form(now))
        return notes

    def admit(self, rank: int, incarnation: str, epoch: int, completed: int, now: float) -> list[dict[str, Any]]:
        """A member reached the agreed admission point at ``completed``."""
        self._check_rank(rank)
        self._fence(rank, incarnation)
        if epoch != self.epoch or not self.is_member(rank, incarnation):
            raise Invalid(f"rank {rank} is not a member of epoch {self.epoch} (it says epoch {epoch})")
        if self.phase is Phase.BROKEN:
            return []  # the caller is told to join the next epoch instead
        self.phase = Phase.ADMITTING
        self.admits[rank] = completed
        live = [r for r in self.members if r not in self.dead]
        if not all(r in self.admits for r in live):
            return []
        points = set(self.admits.values())
        if len(points) != 1:
            return self.fail(self.epoch, now, reason=f"members reached admission at different points {sorted(points)}")
        if not self.joiners:
            # The replacement went away meanwhile: nothing to admit; the epoch goes on.
            self.phase = Phase.STABLE
            self.admits.clear()
            return [{"what": "admission_void", "epoch": self.epoch}]
        q = points.pop()
        # Every member is at the agreed point, about to run the same collective: no one is blocked anywhere. The
        # `pending` kept from the epoch's own forming is stale (a member that was one behind then was blocked at
        # another collective than the source) and would read as a divergence.
        self.joins = {r: replace(self.members[r], completed=q, pending=None) for r in live}
        for r, j in self.joiners.items():
            self.joins[r] = replace(j, completed=q)
        joiners = tuple(sorted(self.joiners))
        self.joiners.clear()
        return [self._form("admission", now, joiners=joiners)]

    def leave(self, rank: int, incarnation: str) -> list[dict[str, Any]]:
        """A member finished cleanly (end of training): it is not waited for, and its exit is no failure."""
        self._check_rank(rank)
        if self.is_member(rank, incarnation):
            self.left.add(rank)
            return [{"what": "left", "rank": rank, "epoch": self.epoch}]
        return []

    def tick(self, now: float) -> list[dict[str, Any]]:
        """Time passing: a broken epoch forms with whoever joined once ``join_timeout_s`` has passed."""
        if self.phase is not Phase.BROKEN or self.broken_at is None or not self.joins:
            return []
        if now - self.broken_at < self.join_timeout_s:
            return []
        for r, m in self.members.items():
            if r not in self.joins and r not in self.dead:
                self.dead[r] = m.incarnation
        return self._maybe_form(now)

    def deadline(self) -> float | None:
        """When :meth:`tick` may next change something (None: nothing pending on time)."""
        if self.phase is Phase.BROKEN and self.broken_at is not None:
            return self.broken_at + self.join_timeout_s
        return None

    # -- forming --------------------------------------------------------------------------------------------
    def expected(self) -> list[int]:
        return sorted(r for r in self.members if r not in self.dead and r not in self.left)

    def _maybe_form(self, now: float) -> list[dict[str, Any]]:
        if self.phase is not Phase.BROKEN or not self.joins:
            return []
        if not all(r in self.joins for r in self.expected()):
            return []
        return [self._form("failure", now)]

    def _form(self, reason: str, now: float, joiners: tuple[int, ...] = ()) -> dict[str, Any]:
        joins = dict(self.joins)
        top = max(j.completed for j in joins.values() if j.rank not in joiners)
        lagging = sorted(r for r, j in joins.items() if r not in joiners and j.completed < top - 1)
        for r in lagging:  # cannot happen when collectives run one at a time; refuse rather than corrupt
            self.dead[r] = joins.pop(r).incarnation
        members = tuple(sorted(joins))
        source = min(r for r in members if r not in joiners and joins[r].completed == top)
        level = {joins[r].pending for r in members if r not in joiners and joins[r].completed == top}
        diverged = len(level - {None}) > 1
        previous = set(self.members)
        self.epoch += 1
        plan = Plan(
            epoch=self.epoch,
            members=members,
            store=joins[source].address,
            completed=top,
            source=source,
            behind=tuple(r for r in members if r not in joiners and joins[r].completed == top - 1),
            joiners=joiners,
            dead=tuple(sorted(r for r in previous if r not in joins)),
            reason=reason,
            diverged=diverged,
        )
        self.members = joins
        self.joins = {}
        self.admits.clear()
        self.dead = {r: inc for r, inc in self.dead.items() if r not in joins}
        self.phase = Phase.STABLE
        self.broken_at = None
        self.plan = plan
        self.formed_at = now
        note: dict[str, Any] = {"what": "formed", **plan.to_dict(), "at": now}
        if lagging:
            note["excluded"] = lagging
        return note

    def view(self) -> dict[str, Any]:
        """What a member watching the group needs: the epoch, its phase, and who waits for admission."""
        return {
            "epoch": self.epoch,
            "phase": self.phase.value,
            "members": sorted(self.members),
            "joiners": sorted(self.joiners),
            "dead": sorted(self.dead),
            "left": sorted(self.left),  # finished cleanly: a later death of theirs is no failure (supervisor)
            "world": self.world,
            "formed_at": self.formed_at,
            "reason": self.plan.reason if self.plan is not None else None,
        }
