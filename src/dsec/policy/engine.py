"""The policy engine: rule state per scope, guardrails, conflicts — pure, in whatever time it is given.

The control plane calls :meth:`Engine.evaluate` from its reconcile loop with the wall clock; ``dsec policy test``
calls it in virtual time over recorded series. Neither sleeps; nothing here does I/O.

Per (rule, scope) a rule is *inactive*, *pending* (``when`` holds, for less than ``for``) or *firing*. It acts when
it starts firing and, while it keeps firing, again each time ``cooldown`` has passed since its last action (a
cooldown of 0 means once per firing episode). It stops firing when ``clear_when`` holds (hysteresis) or, without
``clear_when``, as soon as ``when`` no longer holds. Every action goes through the guardrails in this order:
suppression (the pool is recovering from a device failure), the rate limit ``max_per``, bounds (the rule's, then
the knob's own range), and conflicts: when rules touch the same knob of the same scope in one evaluation, the
highest ``priority`` wins, then the earliest in the file; the others are reported as ``conflict``. An action that
was suppressed or rate-limited is retried at the next evaluation while the rule still fires.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dsec.policy.expr import Expr
from dsec.policy.rules import WORKER_METRICS, Knob, PolicySet, Rule
from dsec.policy.series import SeriesStore


@dataclass(frozen=True)
class Scope:
    pool: str
    worker: str | None = None
    role: str | None = None

    @property
    def key(self) -> str:
        return self.pool if self.worker is None else f"{self.pool}/{self.worker}"


@dataclass
class RuleState:
    phase: str = "inactive"  # inactive | pending | firing
    since: float | None = None  # when the current phase began
    last_action: float | None = None  # when the rule last acted on this scope (any episode): the cooldown clock
    actions: list[float] = field(default_factory=list)  # times of applied / dry-run changes, for max_per
    digest: str = ""
    acted: bool = False  # it acted (or was overruled) in the current firing episode

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RuleState:
        return cls(
            phase=str(d.get("phase", "inactive")),
            since=d.get("since"),
            last_action=d.get("last_action"),
            acted=bool(d.get("acted", False)),
            actions=[float(t) for t in d.get("actions", [])],
            digest=str(d.get("digest", "")),
        )


@dataclass(frozen=True)
class Decision:
    """What a rule did (or tried to do) to one knob of one scope."""

    rule: str
    scope: Scope
    knob: str
    level: str
    old: float | None
    new: float | None
    outcome: str  # applied | dry_run | at_bound | conflict | rate_limited | suppressed | no_value
    at: float
    evidence: dict[str, Any]
    detail: str = ""

    @property
    def changes(self) -> bool:
        return self.outcome == "applied" and self.new is not None and self.new != self.old

    def to_event(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "scope": self.scope.key,
            "knob": self.knob,
            "level": self.level,
            "old": self.old,
            "new": self.new,
            "outcome": self.outcome,
            "dry_run": self.outcome == "dry_run",
            "evidence": self.evidence,
            **({"detail": self.detail} if self.detail else {}),
        }


@dataclass(frozen=True)
class Transition:
    rule: str
    scope: Scope
    phase: str  # pending | firing | resolved | reset
    at: float
    value: float
    state: RuleState

    def to_event(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "scope": self.scope.key,
            "phase": self.phase,
            "value": None if math.isnan(self.value) else self.value,
            "state": self.state.to_dict(),
        }


KnobReader = Callable[[Scope, Knob], float | None]


class Engine:
    def __init__(self, policies: PolicySet, states: dict[tuple[str, str], RuleState] | None = None) -> None:
        self.policies = policies
        self.states: dict[tuple[str, str], RuleState] = {}
        self.load_states(states or {})

    def load_states(self, states: dict[tuple[str, str], RuleState]) -> None:
        """Adopt persisted states; a rule whose definition changed (other digest) or was removed starts over."""
        digests = {r.name: r.digest for r in self.policies.rules}
        self.states = {k: s for k, s in states.items() if digests.get(k[0]) == s.digest}

    def replace_policies(self, policies: PolicySet) -> None:
        self.policies = policies
        self.load_states(self.states)

    def _value(self, expr: Expr, scope: Scope, series: SeriesStore, now: float, observed: bool = False) -> float:
        def key(metric: str) -> tuple[str, str, str | None]:
            return (metric, scope.pool, scope.worker if metric in _WORKER_LABELLED else None)

        fn = expr.observed if observed else expr.eval
        return fn(lambda m: series.instant(key(m), now), lambda m, w: series.range(key(m), now, w), now)

    def evaluate(
        self,
        now: float,
        scopes: Iterable[Scope],
        series: SeriesStore,
        knob_value: KnobReader,
        suppressed: Callable[[str], bool] = lambda pool: False,
    ) -> tuple[list[Decision], list[Transition]]:
        decisions: list[Decision] = []
        transitions: list[Transition] = []
        claimed: dict[tuple[str, str, str], str] = {}  # (level, scope, knob) -> rule that changed it this round
        scopes = list(scopes)
        for rule in sorted(self.policies.rules, key=lambda r: (-r.priority, r.order)):
            for scope in scopes:
                if (scope.worker is None) != (rule.level == "pool") or not rule.covers(scope.pool):
                    continue
                if rule.role is not None and scope.role != rule.role:
                    continue
                self._step(rule, scope, now, series, knob_value, suppressed, claimed, decisions, transitions)
        return decisions, transitions

    def _step(
        self,
        rule: Rule,
        scope: Scope,
        now: float,
        series: SeriesStore,
        knob_value: KnobReader,
        suppressed: Callable[[str], bool],
        claimed: dict[tuple[str, str, str], str],
        decisions: list[Decision],
        transitions: list[Transition],
    ) -> None:
        sk = (rule.name, scope.key)
        st = self.states.get(sk)
        if st is None:
            st = self.states[sk] = RuleState(digest=rule.digest)
        value = self._value(rule.when, scope, series, now)
        holds = not math.isnan(value) and value != 0.0
        if not self._advance(rule, scope, st, now, value, holds, series, transitions):
            return
        cooled = st.last_action is None or now - st.last_action >= rule.cooldown_s
        # The first action of an episode waits only for the cooldown (which spans episodes: a flapping condition
        # does not act more often); later ones need a cooldown > 0 and the condition itself still true (between
        # `when` and `clear_when` a rule keeps firing but does not keep pushing).
        due = cooled and (not st.acted or (rule.cooldown_s > 0 and holds))
        if not due:
            return
        seen = self._value(rule.when, scope, series, now, observed=True)
        evidence = {"when": rule.when.text, "observed": None if math.isnan(seen) else seen}
        acted = False
        for action in rule.actions:
            d = self._act(
                rule, scope, action.knob, action.by, action.to, now, knob_value, suppressed, claimed, evidence
            )
            decisions.append(d)
            # Overruled (conflict) or already at its bound counts as served: the rule does not retry every round.
            acted = acted or d.outcome in ("applied", "dry_run", "at_bound", "conflict")
            if d.outcome in ("applied", "dry_run"):
                window = rule.max_per[1] if rule.max_per else 0.0
                st.actions = [t for t in st.actions if now - t < window] + [now]
        if acted:
            st.last_action = now
            st.acted = True

    def _advance(
        self,
        rule: Rule,
        scope: Scope,
        st: RuleState,
        now: float,
        value: float,
        holds: bool,
        series: SeriesStore,
        transitions: list[Transition],
    ) -> bool:
        """The rule's phase on ``scope`` after this evaluation (inactive, pending, firing), each change recorded in
        ``transitions``; True when it fires (and may act)."""

        def move(phase: str, shown: str | None = None) -> None:
            st.phase = phase if phase in ("pending", "firing") else "inactive"
            st.since = now if st.phase != "inactive" else None
            st.acted = False
            transitions.append(Transition(rule.name, scope, shown or phase, now, value, RuleState(**asdict(st))))

        if st.phase == "firing":
            if rule.clear_when is not None:
                clear = self._value(rule.clear_when, scope, series, now)
                cleared = not math.isnan(clear) and clear != 0.0
            else:
                cleared = not holds
            if cleared:
                move("inactive", "resolved")
                return False
        elif holds:
            if st.phase == "inactive":
                move("pending")
            if st.since is not None and now - st.since >= rule.for_s:
                move("firing")
        else:
            if st.phase == "pending":
                move("inactive", "reset")
            return False
        return st.phase == "firing"

    def _act(
        self,
        rule: Rule,
        scope: Scope,
        knob: Knob,
        by: float | None,
        to: float | None,
        now: float,
        knob_value: KnobReader,
        suppressed: Callable[[str], bool],
        claimed: dict[tuple[str, str, str], str],
        evidence: dict[str, Any],
    ) -> Decision:
        def decision(outcome: str, old: float | None, new: float | None, detail: str = "") -> Decision:
            return Decision(rule.name, scope, knob.name, knob.level, old, new, outcome, now, evidence, detail)

        old = knob_value(scope, knob)
        if old is None and to is None:
            return decision("no_value", None, None, f"{knob.name} has no value to adjust in {scope.key}")
        if suppressed(scope.pool):
            return decision("suppressed", old, None, f"pool {scope.pool} is recovering from a device failure")
        st = self.states[(rule.name, scope.key)]
        if rule.max_per is not None:
            n, window = rule.max_per
            recent = [t for t in st.actions if now - t < window]
            if len(recent) >= n:
                return decision("rate_limited", old, None, f"{len(recent)} actions in the last {window:g} s (max {n})")
        target = float(to) if to is not None else float(old or 0.0) + float(by or 0.0)
        new = min(knob.hi, max(knob.lo, rule.clamp(knob.name, target)))
        if knob.kind is int:
            new = float(math.floor(new + 0.5))
        if old is not None and new == old:
            return decision("at_bound", old, new, f"{knob.name} is already at {old:g} (bounds hold it there)")
        slot = (knob.level, scope.key, knob.name)
        if slot in claimed:
            return decision("conflict", old, new, f"rule {claimed[slot]!r} changes {knob.name} of {scope.key} first")
        if rule.dry_run:
            return decision("dry_run", old, new)  # changes nothing, so it takes the knob from nobody
        claimed[slot] = rule.name
        return decision("applied", old, new)


_WORKER_LABELLED = frozenset(WORKER_METRICS)
