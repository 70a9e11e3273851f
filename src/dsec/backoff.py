"""How long to wait before retry number ``attempt``: one value type for every retry loop in DSec.

The probe's reporter and heal client, the control plane's policy pushes to agent runtimes and the alert webhook
sink each keep their own loop — one sleeps on an interruptible event, one schedules ``next_at`` in a delivery
thread, one gives up after a deadline, one honours ``Retry-After`` — and ask a :class:`Backoff` for the delay.

Why not tenacity or stamina (both maintained; Apache-2.0 and MIT): they own the loop (a decorator or a
``Retrying`` controller) and DSec's loops differ in exactly what those would own; what they share is this
formula, and tenacity's ``wait_random_exponential`` draws from the global ``random`` so tests could not pass a
seeded generator. One dataclass does not justify a dependency inside every training process.

Why equal jitter (half the delay fixed, half random) rather than full jitter (all of it random): full jitter
spreads a thundering herd slightly better, but draws delays near zero, and the peer DSec retries against is
usually down or overloaded (a restarting control plane, a rate-limited receiver), where an immediate retry is
wasted and adds load. Equal jitter keeps a floor of half the nominal delay and still de-synchronizes a fleet
that failed at the same instant. ``jitter`` sets the random share (0.5 by default; 1.0 is full jitter).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: nominal delay ``min(max_s, initial_s * factor ** attempt)`` for ``attempt`` = 0 (the
    first retry), 1, ...; then a share ``jitter`` of it is drawn at random: the delay lies in
    ``[nominal * (1 - jitter), nominal]``."""

    initial_s: float
    factor: float = 2.0
    max_s: float = 30.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        for name, minimum in (("initial_s", 0.0), ("factor", 1.0), ("max_s", 0.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= minimum):
                raise ValueError(f"{name}={value!r} is invalid: expected a finite number >= {minimum:g}")
        if not (isinstance(self.jitter, (int, float)) and 0.0 <= self.jitter <= 1.0):
            raise ValueError(f"jitter={self.jitter!r} is invalid: expected a share in 0..1 (0.5: equal jitter)")

    def nominal(self, attempt: int) -> float:
        """The delay before jitter; ``attempt`` counts from 0."""
        if attempt < 0:
            raise ValueError(f"attempt={attempt} is invalid: expected >= 0 (0 is the first retry)")
        try:
            grown = self.initial_s * self.factor**attempt
        except OverflowError:  # a loop that has retried for ever: the cap applies (0 stays 0)
            grown = math.inf if self.initial_s > 0 else 0.0
        return float(min(self.max_s, grown))

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait before retry ``attempt`` (0 = the first retry), drawn from ``rng``."""
        nominal = self.nominal(attempt)
        fixed = nominal * (1.0 - self.jitter)
        return fixed + rng.uniform(0.0, nominal - fixed)
