"""Room for a burst: move a card-mate off a card that a burst is about to fill, before anyone runs out of memory.

The control plane's quota pass decides it (``dsec.decide.plan_pool_quotas``, ``JudgeConfig.make_room``, on as
shipped; ``DSEC_MAKE_ROOM=0`` turns it off): a ``room`` event names the actor, placement keeps
the card's free slots out for the burst's hold, and the launcher's supervisor moves that actor alone
(``restart_scope: worker``). The simulator runs the same rule (``dsec.make_room``).

Why: the OOMs left under elastic quotas are bursts that fill a card while its other workers hold their memory
(docs/benchmarks.md, "Why quotas give more OOMs than no quotas"). No limit prevents those; only memory leaving the card
does. Spreading workers over more cards ahead of time leaves that room but exposes more cards to faults and cost
goodput on every seed (the same study). Moving one card-mate away when a burst is seen coming leaves room only where
and when it is needed. The worker moved is an actor whose group restarts it alone: it loses the rollout it had under
way and restarts on another card, while the burst — often a learner's, whose failure would restart its whole group —
goes on. Measured (docs/benchmarks.md "Room for a burst"): rl-128, one simulated day, seeds 7/8/9: 21-25 moves a day,
workers failed of OOM 102/76/98 -> 72/66/75 (88/75/95 with no quotas), learner OOMs 4-5 -> 1, goodput 0.005-0.1% lower.

Rule, per card, at each quota pass: the card's projected usage is the sum over its workers of
``used + max(ramp, 0) x horizon_s``, where ``horizon_s`` is the time until the next chance to act. When it exceeds the
card's memory, one of its workers rises at a burst's rate (``dsec.quota.trend.BURST_RAMP_GB_PER_S``: a leak is the
limit's business, and a card over-committed at rest is placement's) and the card holds a worker whose failure restarts
its group (a learner; where every worker restarts alone, a move costs what the OOM would), the movable card-mate
holding the most memory is moved — one per card and burst hold (``BURST_HOLD_S``, the caller's to keep): the card gets
no second request while it holds room. Movable: an actor that restarts alone, not in a burst of its own. Nothing
movable: nothing is done (the burst may still fit; if not, the allocation fails as before). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsec.quota.trend import BURST_RAMP_GB_PER_S


@dataclass(frozen=True)
class CardMate:
    worker_id: str
    used_gb: float
    ramp_gb_per_s: float
    movable: bool  # an actor its group restarts alone, running, not in a burst (or a burst's hold) of its own
    restarts_group: bool = True  # its failure restarts its whole group (a learner), not itself alone (an actor)


def projected_gb(workers: Sequence[CardMate], horizon_s: float) -> float:
    """What the card's ``workers`` will hold ``horizon_s`` from now at their ramps (growth only)."""
    return sum(w.used_gb + max(w.ramp_gb_per_s, 0.0) * horizon_s for w in workers)


def make_room(capacity_gb: float, workers: Sequence[CardMate], horizon_s: float) -> str | None:
    """The worker to move off one card of ``capacity_gb`` (see the module docstring), or None."""
    if projected_gb(workers, horizon_s) <= capacity_gb:
        return None
    if not any(w.ramp_gb_per_s >= BURST_RAMP_GB_PER_S for w in workers):
        return None
    if not any(w.restarts_group for w in workers):  # every worker here fails and restarts alone: a move costs as much
        return None
    candidates = [w for w in workers if w.movable and w.ramp_gb_per_s < BURST_RAMP_GB_PER_S]
    if not candidates:
        return None
    return max(candidates, key=lambda w: (w.used_gb, w.worker_id)).worker_id
