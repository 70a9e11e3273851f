"""A job's start-up as the control plane sees it: how many of its ranks have registered, out of the world sizes of its
groups. ``dsec launch`` draws this as a progress bar while the supervisor already supervises (a rank that fails
during start-up is handled as it would be later)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from dsec.client import ClientError

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often the control plane is asked for the job's workers during the first SLOW_AFTER_S
SLOW_POLL_S, SLOW_AFTER_S = 2.0, 30.0  # then (ranks that take long, or a command that never registers)


def known_workers(client: Any, pool: str) -> set[str]:
    """Ids of the workers registered in ``pool`` now: those of an earlier run, which start-up must not count."""
    return {str(w["id"]) for w in client.workers(pool=pool)}


def registered_ranks(client: Any, job: Any, before: set[str]) -> int:
    """Distinct (group, rank) of ``job`` registered with the control plane by workers not in ``before``."""
    sizes = {g.name: g.world_size for g in job.groups}
    ranks = {
        (w["group"], int(w["rank"]))
        for w in client.workers(pool=job.pool)
        if w["id"] not in before and w["group"] in sizes and 0 <= int(w["rank"]) < sizes[w["group"]]
    }
    return len(ranks)


def wait_for_ranks(
    sup: Any,
    client: Any,
    before: set[str],
    on_progress: Callable[[int, int], None],
    deadline: float | None = None,
) -> bool:
    """Supervise (``sup.step()``) until every rank of the job registered (True), or the job finished or gave up
    first, or ``deadline`` (time.monotonic()) passed (False). ``on_progress(ranks registered, ranks)`` after each
    look at the control plane; a failed look is retried at the next one."""
    total = sum(g.world_size for g in sup.job.groups)
    done, next_look, started = 0, 0.0, time.monotonic()

    def look() -> None:
        nonlocal done
        try:
            done = max(done, registered_ranks(client, sup.job, before))
        except ClientError as exc:
            log.warning("launch: could not count registered ranks (%s); retrying", exc)
        on_progress(done, total)

    while True:
        now = time.monotonic()
        if now >= next_look:
            next_look = now + (POLL_S if now - started < SLOW_AFTER_S else SLOW_POLL_S)
            look()
        if done >= total:
            return True
        if sup.failed or sup.finished() or (deadline is not None and now > deadline):
            # One last look: ranks that registered (and a short job's ranks that also finished) since the previous
            # one count — the bar's last state is then the truth, not the count of up to a poll ago.
            look()
            return bool(done >= total)
        sup.step()
        time.sleep(sup.poll_s)
