"""CPU-bound work off the event loop, without making the writer's commits wait behind it.

The periodic judgments (~130 ms of pure Python at 10,000 workers, every second) and the cost gauges' refresh run on a
thread so that the event loop keeps answering beats meanwhile. But a thread that only computes holds the GIL until
the interpreter's switch interval (5 ms by default) forces it to let go. Every other thread that gave the GIL up for
a moment — the group-commit writer around each SQLite or PostgreSQL call, the event loop around each ``epoll`` and
``send`` — then waits up to that long to get it back, once per call. A commit of three events makes about nine such
calls: measured on this 2-core machine (a SQLite commit of 3 events on one thread, another thread computing),
1.2 ms alone, ~40 ms beside one computing thread and ~320 ms beside two; with a 0.5 ms switch interval, ~4 ms and
~10 ms. Requests carrying events are answered only once their commit is durable, so those waits were the soak's
slowest requests.

So while such work runs, the switch interval is lowered to :data:`FINE_SWITCH_S` and then put back. The interval is
the interpreter's, for every thread: calls that overlap share one lowering (the first saves the interval, the last
restores it), and an interval already finer than ours is left as it is.

The event loop under load is such a thread too: answering a batch of 500 beats computes for ~20 ms at a time, and
the commit its own items wait for needs the GIL between its SQLite steps. So the control plane keeps the finer
interval for as long as it serves (``create_app``'s lifespan holds a :func:`finer_switching` block): in a traced
soak (10,000 workers, 1,000 beats/s in batches of 500) the commits' median fell from 4.4 to 1.8 ms
(docs/benchmarks.md). A finer interval costs nothing while one thread runs alone: it only bounds how long a thread
that wants the GIL waits for it.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from dsec import pacing

#: The switch interval while CPU-bound work runs beside the event loop and the writer, in seconds.
FINE_SWITCH_S = 0.0005

T = TypeVar("T")

_lock = threading.Lock()
_depth = 0  # how many finer_switching blocks are open, in any thread
_saved = 0.0  # the interval the first of them found


@contextmanager
def finer_switching() -> Iterator[None]:
    """The interpreter's switch interval at most :data:`FINE_SWITCH_S` inside the block; restored when the last open
    block ends (normally or by an exception). One interval for every caller: blocks that overlap share the first
    one's lowering, so a per-call interval could not be honoured."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = sys.getswitchinterval()
            if _saved > FINE_SWITCH_S:
                sys.setswitchinterval(FINE_SWITCH_S)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                sys.setswitchinterval(_saved)


def _run_finer(fn: Callable[..., T], *args: Any) -> T:
    with finer_switching(), pacing.giving_way():
        return fn(*args)


async def run_cpu_bound(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread (``asyncio.to_thread``) with finer GIL switching while it runs, giving way to
    heartbeat requests at the checkpoints ``fn`` reaches (``dsec.pacing``)."""
    return await asyncio.to_thread(_run_finer, fn, *args)
