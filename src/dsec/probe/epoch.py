"""What the elastic group (probe/elastic.py) passes around: an epoch's process group, the collective ops submitted
to it, their pending state, and the error for members whose scripts took different paths."""

from __future__ import annotations

import enum
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dsec.errors import HealingError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Epoch:
    """What an op needs to run in the current epoch."""

    epoch: int
    pg: Any  # torch ProcessGroupGloo (a Backend: collectives take lists of tensors)
    members: tuple[int, ...]  # logical ranks in pg-rank order
    rank: int  # this member's logical rank
    world: int  # logical world size (the job's)
    source: int  # the member every other can copy from (the plan's source)
    shadow: bool = False  # a replacement in its first period: its gradients do not count

    @property
    def pg_rank(self) -> int:
        return self.members.index(self.rank)

    def pg_rank_of(self, logical: int, fallback: int) -> int:
        """The pg rank of logical rank ``logical`` (``fallback``'s when it is not a member of this epoch)."""
        return self.members.index(logical if logical in self.members else fallback)


class Op(Protocol):
    """One collective. ``sig`` names it in the group's sequence (None: DSec's own, not part of the script's)."""

    @property
    def sig(self) -> str | None: ...

    def issue(self, ep: Epoch) -> Any: ...  # start it on ep.pg; returns a Work

    def result(self) -> list[torch.Tensor]: ...  # what a member one behind needs (valid after completion)

    def accept(self, tensors: list[torch.Tensor]) -> None: ...  # take the result from the source instead

    def finish(self) -> Any: ...  # after completion or accept: copy outputs, return the op's value


class State(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    HANDED = "handed"  # to the heal thread (failed, aborted, or to be run in the next epoch)


@dataclass
class Pending:
    op: Op
    fut: Any  # torch.futures.Future
    admit: bool = False
    known: bool = False  # the control plane already knows the epoch is broken (it told us)
    state: State = State.PENDING
    epoch: int = 0
    error: str | None = None
    submitted: float = field(default_factory=time.monotonic)


class Diverged(HealingError, RuntimeError):
    """Members' scripts took different paths (different collectives at the same point): healing cannot continue."""


def signature(op: Any) -> str:
    return str(op.sig) if getattr(op, "sig", None) is not None else f"dsec:{type(op).__name__}"


def advertised_host(target: str | None) -> str:
    """The address peers reach this process at: DSEC_HEAL_HOST, else the local address of the route to ``target``
    (the rendezvous host), else 127.0.0.1."""
    if not target:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
