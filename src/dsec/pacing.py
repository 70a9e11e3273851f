"""Background computation that gives way to requests: checkpoints a long pure-Python pass calls between its steps.

The control plane runs its periodic judgments (~100-300 ms of pure Python at 10,000 workers, every second) on a
thread so that the event loop keeps answering beats meanwhile. But both threads need the GIL, and the interpreter
shares it between them in turns (control/cpu_thread.py makes the turns short): a batch of beats that overlaps a pass
takes up to twice as long, and those batches were the soak's slowest requests. Nothing in CPython gives one thread
priority over another for the GIL, so the pass gives way itself: at each :func:`checkpoint` (the decision core calls
it between steps and every few hundred workers, see :func:`paced`), a thread registered with :func:`giving_way`
sleeps — which hands the GIL to the event loop at once — while a request is in progress (:func:`request`).

Giving way is bounded so that a loop that is never idle (ingest at full speed) cannot starve the pass: a pause lasts
at most :data:`MAX_PAUSE_S`, after a pause the thread runs at least :data:`MIN_RUN_S` before it pauses again, and one
:func:`giving_way` block (one pass) pauses :data:`BUDGET_S` in all at most, then runs to its end without pausing.
Everywhere else (the simulator, tests, the pass run on the event loop for a small fleet), :func:`checkpoint` is one
read of a global and a return: it changes what a pass costs, never what it decides.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import islice
from typing import TypeVar

T = TypeVar("T")

#: How often a paused thread looks again whether requests are still in progress, in seconds.
POLL_S = 0.002
#: The longest a thread gives way at one checkpoint, in seconds.
MAX_PAUSE_S = 0.05
#: After giving way, the least a thread computes before it gives way again, in seconds.
MIN_RUN_S = 0.005
#: The most one :func:`giving_way` block pauses in all, in seconds: a pass is never delayed by more.
BUDGET_S = 0.5
#: Items between two checkpoints of :func:`paced` (at 10,000 workers, ~1 ms of per-worker work).
EVERY = 256

_in_progress = 0  # requests being answered now
_lock = threading.Lock()
_giving_way: dict[int, list[float]] = {}  # thread id -> [when it last resumed (or started), seconds paused so far]


@contextmanager
def request() -> Iterator[None]:
    """Mark a request in progress: threads that give way pause at their checkpoints until none is."""
    global _in_progress
    with _lock:  # one event loop per control plane, but a process may run several (tests): += is not atomic
        _in_progress += 1
    try:
        yield
    finally:
        with _lock:
            _in_progress -= 1


def in_progress() -> int:
    """Requests in progress now (for tests and diagnostics)."""
    return _in_progress


@contextmanager
def giving_way() -> Iterator[None]:
    """Make the calling thread give way to requests at its checkpoints for the duration of the block."""
    ident = threading.get_ident()
    with _lock:
        _giving_way[ident] = [time.perf_counter(), 0.0]
    try:
        yield
    finally:
        with _lock:
            _giving_way.pop(ident, None)


def checkpoint() -> float:
    """Give way to requests in progress if the calling thread is registered (:func:`giving_way`), has run at least
    :data:`MIN_RUN_S` since its last pause and has budget left; the seconds paused (0.0 almost always)."""
    if not _in_progress:  # the common case, and the only check made outside a registered thread's pass
        return 0.0
    mine = _giving_way.get(threading.get_ident())  # only this thread reads or writes its entry
    if mine is None:
        return 0.0
    resumed, paused = mine
    start = time.perf_counter()
    if start - resumed < MIN_RUN_S or paused >= BUDGET_S:
        return 0.0
    limit = min(MAX_PAUSE_S, BUDGET_S - paused)
    now = start
    while _in_progress and now - start < limit:
        time.sleep(POLL_S)  # releases the GIL: the event loop takes it at once
        now = time.perf_counter()
    mine[0], mine[1] = now, paused + (now - start)
    return now - start


def paced(items: Iterable[T], every: int | None = None) -> Iterator[T]:
    """``items``, with a :func:`checkpoint` before every ``every``-th one (the first included; default
    :data:`EVERY`)."""
    n = EVERY if every is None else every
    rest = iter(items)
    while chunk := list(islice(rest, n)):  # a chunk at a time: ~0.02 us an item over plain iteration
        checkpoint()
        yield from chunk
