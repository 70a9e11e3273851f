"""Where in a group's sequence of collectives a replacement can join.

A replacement runs the training script from its first line, so its first collective is the script's first one,
its second the script's second, and so on. It can only join the survivors at a point where *their* next collectives
are the script's first ones again — where their sequence starts over. Training loops repeat: PPO here does 32
gradient syncs then one all-reduce of statistics per update, a supervised loop one gradient sync per step. So the
members record each collective's *signature* (what it is: gradient sync, or the collective's name, dtype and
reduce op — not its size, which may vary with the data) and find the smallest period ``p`` with which the whole
sequence, from its very first collective, repeats. A joiner is admitted before collective ``n`` only when
``n % p == 0`` and the period is confirmed: at least two full repetitions *and* ``min_history`` collectives past the
first period seen. The second condition guards against inner repetition: PPO's 32 gradient syncs look like a
period of 1 until the statistics all-reduce arrives. It cannot see the future: a loop whose rare collective (an
evaluation every 500 steps, say) has not yet happened when a rank dies looks periodic without it. A script whose
sequence never repeats (data-dependent collectives, a different first iteration) has no admission point: the group
then goes on without the replacement, and the supervisor falls back to restarting the group from its agreed
snapshots. Once a confirmed period is broken, no admission point is trusted any more.

Members hold identical sequences (collectives pair up), so they compute identical periods and admission points;
they still agree on the point through the sync header before acting on it (probe/heal.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PREFIX = 4096  # periods longer than this are not searched for
MIN_HISTORY = 64  # collectives past the first period before a period counts as confirmed


@dataclass
class Sequence:
    """The sequence of collective signatures of a group, from its first collective."""

    prefix: list[str] = field(default_factory=list)  # the first MAX_PREFIX signatures (as if from the first)
    count: int = 0  # collectives this process has recorded
    period: int | None = None  # smallest p with sig[i] == sig[i % p] for every i seen; None: not periodic
    base: int = 0  # the group's index of this member's first collective (a joiner's admission point; else 0)
    inherited: bool = False  # the period came from the source at admission (already confirmed there)
    max_prefix: int = MAX_PREFIX
    min_history: int = MIN_HISTORY

    def add(self, sig: str) -> None:
        n = self.count
        if n >= len(self.prefix) and len(self.prefix) < self.max_prefix:
            self.prefix.append(sig)
        if n == 0 and self.period is None and not self.inherited:
            self.period = 1
        elif self.period is not None and self.prefix[n % self.period] != sig:
            # Before the period is confirmed, a longer one may still explain the history (every original
            # member has the same history). After, the loop changed: no admission point is trustworthy any more,
            # and every member (a joiner knows less history) must come to that same conclusion.
            self.period = None if self.confirmed() else self._search(n, sig)
        self.count = n + 1

    def _search(self, n: int, sig: str) -> int | None:
        """The smallest period longer than the current one that explains the first ``n + 1`` signatures, or None
        when the history needed to check one is gone (longer than the kept prefix)."""
        if n >= self.max_prefix:
            return None
        assert self.period is not None
        for p in range(self.period + 1, n + 1):
            if self.prefix[n % p] == sig and all(self.prefix[i] == self.prefix[i % p] for i in range(p, n)):
                return p
        return n + 1  # no repetition yet: the whole history is one (unconfirmed) period

    def confirmed(self) -> bool:
        if self.period is None:
            return False
        return self.inherited or self.count >= max(2 * self.period, self.period + self.min_history)

    def admission_point(self, index: int) -> bool:
        """True when this member's collective number ``index`` (its own count) would start the sequence over."""
        if not self.confirmed():
            return False
        assert self.period is not None
        return index % self.period == 0

    def next_admission(self, index: int) -> int | None:
        """The first admission point at or after this member's collective ``index`` (None: no confirmed period)."""
        if not self.confirmed():
            return None
        assert self.period is not None
        return index + (-index) % self.period

    @property
    def position(self) -> int:
        """The group's index of this member's next collective (identical on every member)."""
        return self.base + self.count

    def pattern(self) -> list[str]:
        """One period's signatures (what a joiner inherits); empty when there is no confirmed period."""
        if not self.confirmed():
            return []
        assert self.period is not None
        return self.prefix[: self.period]

    @classmethod
    def inherit(cls, pattern: list[str], base: int) -> Sequence:
        """A joiner's sequence: the source's period, and the group's index of the joiner's first collective (an
        admission point, so its own collectives line up with the pattern from its first one)."""
        if not pattern:
            return cls(base=base, period=None, inherited=True)
        return cls(prefix=list(pattern), period=len(pattern), base=base, inherited=True)
