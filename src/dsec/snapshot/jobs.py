"""What passes between the caller, the training thread and the snapshot thread: a snapshot request's ticket, the
job the training thread captures for the snapshot thread (snapshotter.py captures, writer.py writes), and the report
of a restore (restorer.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsec.snapshot import codec

if TYPE_CHECKING:
    import torch


@dataclass
class Ticket:
    """A snapshot request. ``done`` is set when it is published (``seq``) or failed (``error``)."""

    requests: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    seq: int | None = None
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    blocking_s: float = 0.0  # take() + waits at the step gate; final once the next optimizer step has begun

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


@dataclass
class RestoreReport:
    seq: int
    step: int | None
    restore_s: float
    lossless: bool
    skipped: list[tuple[int, str]]

    def as_event(self, worker: str) -> dict[str, Any]:
        return {
            "id": f"{worker}/{self.seq}",
            "step": self.step,
            "restore_s": round(self.restore_s, 4),
            "lossless": self.lossless,
            "skipped": [{"id": f"{worker}/{s}", "reason": r} for s, r in self.skipped],
        }


@dataclass
class _Item:
    name: str
    tensor: torch.Tensor
    bits: int
    sqrt: bool
    lazy: bool


@dataclass
class _Job:
    seq: int
    kind: str
    parent: int | None
    base: int
    step: int | None
    mode: codec.Mode  # as captured: a level change while this one is written applies to the next
    meta: dict[str, Any]
    items: list[_Item]
    carried: dict[str, dict[str, Any]]
    ticket: Ticket
    staged: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)
