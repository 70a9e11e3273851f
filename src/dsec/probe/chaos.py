"""Fault injection shipped with the probe, so tests, the demo and users can rehearse faults on real runs.

``DSEC_CHAOS`` holds one or more faults separated by ``;``, each a comma-separated list of ``key=value``::

    DSEC_CHAOS="sync_delay_ms=200,rank=1,after_s=20,for_s=30"
    DSEC_CHAOS="memory_growth_mb_per_s=50,max_mb=1024,after_s=5; interrupt_episodes=collision,rank=0"

Exactly one fault kind per clause:

``sync_delay_ms``          the rank arrives this late at each step's last gradient collective (a straggler)
``memory_growth_mb_per_s`` resident memory grows at this rate (real, touched pages) up to ``max_mb``
                           (default 1024); released when the window ends
``interrupt_episodes``     every episode that ends is reported as interrupted with this reason
``grad_spike``             the rank's local gradient is multiplied by this factor before synchronization

Window keys (all optional): ``rank`` (default: every rank), ``after_s`` (from the start of training — the
first DDP model, optimizer, process group or environment the probe sees — so that a slow start-up on a loaded
machine does not use up the window before there is anything to disturb; default 0),
``for_s`` (default: until exit), ``every_s`` (repeat the window with this period), ``syncs`` (``sync_delay_ms``
only, without ``every_s``: the window lasts at least until this many of the rank's syncs were delayed — on a
loaded machine a window of seconds can fall between a learner's update phases and delay nothing). The probe reports
each window's start and end as ``log`` events carrying the scheduled wall-clock times, which is what
benchmarks measure reaction times from.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsec.errors import InvalidInput

KINDS = ("sync_delay_ms", "memory_growth_mb_per_s", "interrupt_episodes", "grad_spike")
WINDOW_KEYS = ("rank", "after_s", "for_s", "every_s", "max_mb", "syncs")


class ChaosError(InvalidInput, ValueError):
    """DSEC_CHAOS is malformed; the message names the clause and the key."""


@dataclass(frozen=True)
class Fault:
    kind: str
    value: float | str
    rank: int | None = None
    after_s: float = 0.0
    for_s: float = math.inf
    every_s: float | None = None
    max_mb: float = 1024.0
    syncs: int = 0  # sync_delay_ms: the window lasts until at least this many syncs were delayed

    def window_index(self, elapsed: float) -> int | None:
        """Which repetition of the window ``elapsed`` falls in, or None when outside every window."""
        t = elapsed - self.after_s
        if t < 0:
            return None
        k = 0
        if self.every_s is not None:
            k = int(t // self.every_s)
            t -= k * self.every_s
        return k if t < self.for_s else None

    def describe(self) -> str:
        return f"{self.kind}={self.value}" + (f",rank={self.rank}" if self.rank is not None else "")


def _number(clause: str, key: str, raw: str, minimum: float = 0.0) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ChaosError(f"DSEC_CHAOS clause {clause!r}: {key}={raw!r} is not a number") from None
    if not math.isfinite(value) or value < minimum:
        raise ChaosError(f"DSEC_CHAOS clause {clause!r}: {key}={raw!r} must be a finite number >= {minimum:g}")
    return value


def parse(spec: str) -> tuple[Fault, ...]:
    faults = []
    for clause in (c.strip() for c in spec.split(";")):
        if not clause:
            continue
        items: dict[str, str] = {}
        for part in (p.strip() for p in clause.split(",")):
            if not part:
                continue
            key, sep, raw = part.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ChaosError(f"DSEC_CHAOS clause {clause!r}: {part!r} is not key=value")
            if key not in KINDS and key not in WINDOW_KEYS:
                raise ChaosError(
                    f"DSEC_CHAOS clause {clause!r}: unknown key {key!r}; expected one of {list(KINDS + WINDOW_KEYS)}"
                )
            if key in items:
                raise ChaosError(f"DSEC_CHAOS clause {clause!r}: {key!r} given twice")
            items[key] = raw.strip()
        kinds = [k for k in items if k in KINDS]
        if len(kinds) != 1:
            raise ChaosError(f"DSEC_CHAOS clause {clause!r}: expected exactly one fault kind of {list(KINDS)}")
        kind = kinds[0]
        value: float | str = items[kind] if kind == "interrupt_episodes" else _number(clause, kind, items[kind])
        if kind == "interrupt_episodes" and not str(value).replace("_", "").isalnum():
            raise ChaosError(f"DSEC_CHAOS clause {clause!r}: interrupt_episodes={value!r} must be a word (the reason)")
        rank = items.get("rank")
        # isascii: '²'.isdigit() is True but int('²') raises a bare ValueError.
        if rank is not None and not (rank.isascii() and rank.isdigit()):
            raise ChaosError(f"DSEC_CHAOS clause {clause!r}: rank={rank!r} must be a non-negative integer")
        every = _number(clause, "every_s", items["every_s"], 0.001) if "every_s" in items else None
        if every is not None and "for_s" not in items:
            raise ChaosError(f"DSEC_CHAOS clause {clause!r}: every_s={every:g} needs for_s (each window's length)")
        for_s = _number(clause, "for_s", items["for_s"], 0.001) if "for_s" in items else math.inf
        if every is not None and for_s > every:
            raise ChaosError(f"DSEC_CHAOS clause {clause!r}: for_s={for_s:g} must not exceed every_s={every:g}")
        syncs = items.get("syncs")
        if syncs is not None:
            if not (syncs.isascii() and syncs.isdigit()) or int(syncs) < 1:
                raise ChaosError(f"DSEC_CHAOS clause {clause!r}: syncs={syncs!r} must be a positive integer")
            if kind != "sync_delay_ms" or every is not None:
                raise ChaosError(
                    f"DSEC_CHAOS clause {clause!r}: syncs applies to sync_delay_ms without every_s (not {kind}"
                    + (", every_s)" if every is not None else ")")
                )
        faults.append(
            Fault(
                kind=kind,
                value=value,
                rank=int(rank) if rank is not None else None,
                after_s=_number(clause, "after_s", items["after_s"]) if "after_s" in items else 0.0,
                for_s=for_s,
                every_s=every,
                max_mb=_number(clause, "max_mb", items["max_mb"]) if "max_mb" in items else 1024.0,
                syncs=int(syncs) if syncs is not None else 0,
            )
        )
    return tuple(faults)


EventSink = Callable[[dict[str, Any]], None]


class Chaos:
    """The faults of one process. Hooks ask it what to inject; ``poll()`` (once per beat) reports window
    starts and ends and drives memory growth."""

    def __init__(
        self,
        faults: tuple[Fault, ...],
        rank: Callable[[], int | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.faults = faults
        self._rank = rank
        self._clock = clock
        self._t0 = clock()
        self._wall0 = wall()
        self._wall = wall
        self._armed = False
        self._lock = threading.Lock()
        self._announced: dict[int, int | None] = {}
        self._ballast: list[bytes] = []
        self._ballast_mb = 0.0
        # False where the growth is device memory (a fake card counts it; dsec.probe.fake_card): no host pages.
        self.touch_pages = True
        self._target_mb = 0.0  # fractional MB owed: polls faster than 1 MB per poll must still add up
        self._grown_at: float | None = None
        self._delayed: dict[int, int] = {}  # fault index -> syncs it delayed
        self._last_delay: dict[int, float] = {}  # fault index -> elapsed time of its latest delayed sync

    def arm(self) -> None:
        """Training started: windows count from now (once; later calls change nothing)."""
        with self._lock:
            if self._armed:
                return
            self._armed = True
            self._t0 = self._clock()
            self._wall0 = self._wall()

    @classmethod
    def from_env(cls, spec: str | None, rank: Callable[[], int | None]) -> Chaos | None:
        if not spec or not spec.strip():
            return None
        return cls(parse(spec), rank=rank)

    def _window(self, i: int, f: Fault, elapsed: float) -> int | None:
        """Fault ``i``'s window at ``elapsed``: its scheduled one, stretched while it owes delayed syncs."""
        window = f.window_index(elapsed)
        if window is None and f.syncs and elapsed >= f.after_s and self._delayed.get(i, 0) < f.syncs:
            return 0
        return window

    def _active(self, kind: str, rank: int | None = None) -> tuple[int, Fault] | None:
        elapsed = self._clock() - self._t0
        my_rank = self._rank()
        if my_rank is None:
            my_rank = rank  # the hook knows its rank before the probe does
        for i, f in enumerate(self.faults):
            if f.kind != kind or (f.rank is not None and f.rank != my_rank):
                continue
            if self._window(i, f, elapsed) is not None:
                return i, f
        return None

    # -- asked by hooks ------------------------------------------------------------------------------
    def sync_delay_s(self, rank: int | None = None) -> float:
        """The delay before this sync (one call per synchronized step)."""
        found = self._active("sync_delay_ms", rank)
        if found is None:
            return 0.0
        i, f = found
        with self._lock:
            self._delayed[i] = self._delayed.get(i, 0) + 1
            self._last_delay[i] = self._clock() - self._t0
        return float(f.value) / 1000.0

    def grad_factor(self) -> float:
        found = self._active("grad_spike")
        return float(found[1].value) if found is not None else 1.0

    def interrupt_reason(self) -> str | None:
        found = self._active("interrupt_episodes")
        return str(found[1].value) if found is not None else None

    # -- once per beat -------------------------------------------------------------------------------
    def poll(self, emit: EventSink) -> None:
        elapsed = self._clock() - self._t0
        my_rank = self._rank()
        for i, f in enumerate(self.faults):
            if f.rank is not None and f.rank != my_rank:
                continue
            window = self._window(i, f, elapsed)
            if window != self._announced.get(i):
                previous = self._announced.get(i)
                self._announced[i] = window
                if previous is not None:
                    emit(self._event(i, f, "stop", previous))
                if window is not None:
                    emit(self._event(i, f, "start", window))
        self._grow_memory()

    def _event(self, i: int, f: Fault, phase: str, window: int) -> dict[str, Any]:
        start = f.after_s + window * (f.every_s or 0.0)
        # A window stretched by ``syncs`` ended at its last delayed sync, not at its schedule.
        at = start if phase == "start" else max(start + f.for_s, self._last_delay.get(i, 0.0))
        return {"chaos": phase, "fault": f.describe(), "window": window, "at": round(self._wall0 + at, 6)}

    def _grow_memory(self) -> None:
        found = self._active("memory_growth_mb_per_s")
        f = found[1] if found is not None else None
        now = self._clock()
        with self._lock:
            if f is None:
                self._ballast.clear()
                self._ballast_mb = self._target_mb = 0.0
                self._grown_at = None
                return
            if self._grown_at is None:
                self._grown_at = now
                return
            self._target_mb = min(f.max_mb, self._target_mb + float(f.value) * (now - self._grown_at))
            self._grown_at = now
            add = int(self._target_mb - self._ballast_mb)
            if add >= 1:
                if self.touch_pages:
                    # Touched pages, not a zero-filled allocation: resident memory really grows.
                    self._ballast.append(b"\x5a" * (add << 20))
                self._ballast_mb += add

    @property
    def ballast_mb(self) -> float:
        return self._ballast_mb
