"""A stand-in for one GPU's memory shared by several processes, for machines without a GPU (benchmarks, tests).

On CPU nothing runs out of device memory, so memory quotas had nothing to prevent: the probe caps the CUDA caching
allocator (``torch.cuda.set_per_process_memory_fraction``) and a CPU process only reports against its quota. This
module stands in for the part of a card that quotas are about, behind the probe's own seams (the allocator limit it
would apply, the memory figure it would report):

* each process holds some memory on the card (what the caching allocator has reserved);
* an allocation fails, **in the allocating process only**, when it would take that process past its per-process limit
  (the fraction the probe sets from its directive) or the card past its memory; the others keep what they hold;
* a process's memory is released when the process ends (the driver frees a dead process's memory);
* nothing is freed by lowering a limit below what a process holds: its next growth fails.

What a process holds on the card is ``base_gb`` (model, optimizer state, the allocator's cache of a step's
activations: reserved from the first optimizer step on) plus the probe's ``DSEC_CHAOS`` memory growth, which with a
card counts as device memory (no host pages touched). Growth is allocated at optimizer steps, by the training
thread, which is where a real allocation fails; the failure is raised there as ``torch.OutOfMemoryError`` (what the
CUDA allocator raises) with a message that says it came from this stand-in.

Accounting: one JSON file per card (``path``), each process's holding under its pid, read and written under an
exclusive ``fcntl`` lock on ``path + ".lock"``; rows of pids that no longer exist are dropped at every allocation.

``DSEC_FAKE_CARD`` configures it, comma-separated ``key=value``::

    DSEC_FAKE_CARD="path=/tmp/card0,memory_gb=80,base_gb=14"
    DSEC_FAKE_CARD="path=/tmp/card0,memory_gb=80,base_gb=14,limits=ignore"   # an allocator nobody caps

``limits=ignore`` stands for a deployment without quotas: the same control plane, the same directives, but the
allocator is never capped (the per-process limit is not applied).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import InvalidInput
from dsec.fsutil import write_atomic

KEYS = ("path", "memory_gb", "base_gb", "limits")


class FakeCardError(InvalidInput, ValueError):
    """DSEC_FAKE_CARD is malformed; the message names the key."""


@dataclass(frozen=True)
class CardSpec:
    path: Path
    memory_gb: float
    base_gb: float = 0.0
    obey_limits: bool = True

    @classmethod
    def parse(cls, spec: str) -> CardSpec:
        items: dict[str, str] = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            key, sep, raw = part.partition("=")
            key = key.strip()
            if not sep or key not in KEYS:
                raise FakeCardError(f"DSEC_FAKE_CARD: {part!r}: expected key=value with a key of {list(KEYS)}")
            if key in items:
                raise FakeCardError(f"DSEC_FAKE_CARD: {key!r} given twice")
            items[key] = raw.strip()
        for key in ("path", "memory_gb"):
            if not items.get(key):
                raise FakeCardError(f"DSEC_FAKE_CARD: {key} is required")
        limits = items.get("limits", "obey")
        if limits not in ("obey", "ignore"):
            raise FakeCardError(f"DSEC_FAKE_CARD: limits={limits!r} must be 'obey' or 'ignore'")
        memory = _gb("memory_gb", items["memory_gb"], positive=True)
        base = _gb("base_gb", items.get("base_gb", "0"))
        if base > memory:
            raise FakeCardError(f"DSEC_FAKE_CARD: base_gb={base:g} exceeds memory_gb={memory:g}")
        return cls(Path(items["path"]), memory, base, limits == "obey")


def _gb(key: str, raw: str, positive: bool = False) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise FakeCardError(f"DSEC_FAKE_CARD: {key}={raw!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise FakeCardError(f"DSEC_FAKE_CARD: {key}={raw!r} must be a finite number {'>' if positive else '>='} 0")
    return value


def out_of_memory(message: str) -> BaseException:
    """What the CUDA allocator raises: ``torch.OutOfMemoryError`` (a RuntimeError). The card is used from the probe's
    torch hooks, so torch is loaded."""
    import torch

    return torch.OutOfMemoryError(message)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FakeCard:
    """This process's view of one shared card (see the module docstring)."""

    def __init__(self, spec: CardSpec, pid: int | None = None) -> None:
        self.spec = spec
        self.pid = os.getpid() if pid is None else pid
        self.held_gb = 0.0
        self.ooms = 0
        # What the other processes held at this process's last allocation (the card's free memory for it is
        # memory_gb - others_gb; CUDA's torch.cuda.mem_get_info gives the same reading on a real card).
        self.others_gb = 0.0
        self._lock = threading.Lock()  # one allocation at a time within this process; the file lock across them

    @classmethod
    def from_env(cls, spec: str | None) -> FakeCard | None:
        if not spec or not spec.strip():
            return None
        return cls(CardSpec.parse(spec))

    @contextlib.contextmanager
    def _locked_rows(self) -> Iterator[dict[int, float]]:
        path = self.spec.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    raw = json.loads(path.read_text() or "{}")
                except FileNotFoundError:
                    raw = {}
                rows = {int(pid): float(gb) for pid, gb in raw.items()}
                before = dict(rows)
                yield rows
                if rows != before:
                    write_atomic(path, json.dumps({str(p): gb for p, gb in rows.items()}).encode())
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def hold(self, want_gb: float, limit_gb: float | None) -> None:
        """Make this process hold ``want_gb`` on the card. Growth past ``limit_gb`` (when limits are obeyed) or past
        the card's memory raises the allocator's out-of-memory error and changes nothing; shrinking always works."""
        if want_gb == self.held_gb:
            return  # nothing to allocate or free (most optimizer steps): the card's file is not read
        with self._lock, self._locked_rows() as rows:
            for pid in [p for p in rows if p != self.pid and not _alive(p)]:
                del rows[pid]  # the driver released a dead process's memory
            held = rows.get(self.pid, 0.0)
            others = self.others_gb = sum(gb for pid, gb in rows.items() if pid != self.pid)
            if want_gb > held:
                grow = want_gb - held
                if self.spec.obey_limits and limit_gb is not None and want_gb > limit_gb:
                    self.ooms += 1
                    raise out_of_memory(
                        f"CUDA out of memory (DSec fake card {self.spec.path.name}). Tried to allocate {grow:.2f} GiB; "
                        f"this process holds {held:.2f} GiB and its allocator limit is {limit_gb:.2f} GiB"
                    )
                if others + want_gb > self.spec.memory_gb:
                    self.ooms += 1
                    raise out_of_memory(
                        f"CUDA out of memory (DSec fake card {self.spec.path.name}). Tried to allocate {grow:.2f} GiB; "
                        f"the card has {self.spec.memory_gb:g} GiB, {others + held:.2f} GiB held "
                        f"({held:.2f} GiB by this process)"
                    )
            rows[self.pid] = want_gb
            self.held_gb = want_gb

    def room_gb(self) -> float:
        """What this process could hold on the card as of its last allocation: the card less the others' holdings."""
        return self.spec.memory_gb - self.others_gb

    def used_gb(self) -> float:
        """Memory held on the card by every live process (a reader's view, like nvidia-smi's)."""
        with self._lock, self._locked_rows() as rows:
            return sum(gb for pid, gb in rows.items() if pid == self.pid or _alive(pid))
