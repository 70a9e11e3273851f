"""Policy files: parse, validate with file:line:column errors, and compile into rules the engine runs.

A file (see examples/policies/)::

    policies:
      - name: tighten-latency-cap-on-meltdowns
        when: increase(dsec_melt_down_count[1h]) > 3      # expr.py: a safe PromQL subset over DSec metrics
        for: 0s                                           # how long `when` must hold before the rule fires
        scope: {pools: ["*"]}                             # pool globs; `level: worker` + `role:` for per-worker
        then:
          - knob: latency_cap_ms                          # what to change
            by: -10                                       # or `to: 60`
        bounds: {latency_cap_ms: {min: 60}}               # floors and ceilings (also applied to `to`)
        cooldown: 1h                                      # quiet time after an action, per scope
        max_per: 3/1d                                     # at most 3 actions per day, per scope
        clear_when: increase(dsec_melt_down_count[1h]) <= 1   # hysteresis: re-arm only once this holds
        priority: 0                                       # higher wins when two rules touch one knob
        dry_run: false                                    # record what would happen, change nothing
        labels: {severity: warning}
        annotations: {runbook: "..."}
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dsec import telemetry
from dsec.policy.expr import Expr, ExprError, parse, parse_duration
from dsec.yamlconf import ConfigError, Marked, format_loc, load_marked, locate, validate

# Metrics an expression may read: the server's pool gauges (labelled by pool) and, for worker-level rules, its
# worker ones — the schema's policy metrics (dsec.telemetry, docs/telemetry.md), so an unknown name is an error.
POOL_METRICS = telemetry.policy_metrics(("pool",))
WORKER_METRICS = telemetry.policy_metrics(("pool", "worker"))


@dataclass(frozen=True)
class Knob:
    name: str
    level: str  # pool | worker
    kind: type  # int | float
    lo: float
    hi: float


# What rules may change. Pool knobs live on the pool; worker knobs are directive fields.
KNOBS: dict[tuple[str, str], Knob] = {
    (k.level, k.name): k
    for k in (
        Knob("latency_cap_ms", "pool", float, 1.0, 1e6),
        Knob("bandwidth_cap_mbps", "pool", float, 0.001, 1e6),
        Knob("snapshot_compression_level", "pool", int, 0, 3),
        Knob("snapshot_interval_s", "pool", float, 1.0, 86400.0),
        Knob("memory_base_gb", "pool", float, 0.0, 4096.0),
        Knob("memory_ceiling_gb", "pool", float, 0.0, 4096.0),
        Knob("gpu_quota", "pool", int, 0, 4096),
        Knob("latency_cap_ms", "worker", float, 1.0, 1e7),
        Knob("bandwidth_cap_mbps", "worker", float, 0.001, 1e7),
        # 32 is uncompressed. A worker at the probe's default has null here: a relative ``by`` has no value to
        # start from (outcome "no_value"); ``to`` sets a level.
        Knob("compression_bits", "worker", int, 4, 32),
        Knob("grad_accum_steps", "worker", int, 1, 1024),
        Knob("snapshot_compression_level", "worker", int, 0, 3),
        Knob("snapshot_interval_s", "worker", float, 1.0, 86400.0),
        Knob("memory_ceiling_gb", "worker", float, 0.0, 4096.0),
        Knob("sync_priority", "worker", int, -10, 10),
    )
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ScopeSpec(_Strict):
    level: Literal["pool", "worker"] = "pool"
    pools: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    role: Literal["actor", "learner", "other"] | None = None


class ActionSpec(_Strict):
    knob: str
    by: float | None = None
    to: float | None = None


class BoundSpec(_Strict):
    min: float | None = None
    max: float | None = None


class RuleSpec(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
    when: str = Field(..., min_length=1, max_length=4096)
    for_: str = Field("0s", alias="for")
    scope: ScopeSpec = Field(default_factory=ScopeSpec)
    then: list[ActionSpec] = Field(..., min_length=1)
    bounds: dict[str, BoundSpec] = Field(default_factory=dict)
    cooldown: str = "0s"
    max_per: str | None = None
    clear_when: str | None = Field(None, max_length=4096)
    priority: int = 0
    dry_run: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    @field_validator("for_", "cooldown")
    @classmethod
    def _duration(cls, v: str) -> str:
        parse_duration(str(v))
        return str(v)

    @field_validator("max_per")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        if v is not None:
            parse_rate(v)
        return v


class PolicyFile(_Strict):
    """The file's shape; each rule is validated on its own so that one bad rule does not hide the others."""

    policies: list[Any] = Field(default_factory=list)


def _validate_rule(raw: Any, marked: Marked, i: int, source: str) -> RuleSpec:
    try:
        return RuleSpec.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ("policies", i, *err["loc"])
            line, col = locate(marked.marks, loc)
            problems.append(f"{source}:{line}:{col}: {format_loc(loc)}: {err['msg']}")
        raise ConfigError(problems) from None


def parse_rate(text: str) -> tuple[int, float]:
    """``3/1h`` -> (3, 3600.0)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\S+)\s*", str(text))
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"{text!r} is not a rate limit: expected COUNT/DURATION, e.g. 3/1h")
    return int(m.group(1)), parse_duration(m.group(2))


@dataclass(frozen=True)
class Action:
    knob: Knob
    by: float | None
    to: float | None


@dataclass(frozen=True)
class Rule:
    name: str
    when: Expr
    for_s: float
    level: str
    pools: tuple[str, ...]
    role: str | None
    actions: tuple[Action, ...]
    bounds: dict[str, tuple[float | None, float | None]]
    cooldown_s: float
    max_per: tuple[int, float] | None
    clear_when: Expr | None
    priority: int
    dry_run: bool
    labels: dict[str, str]
    annotations: dict[str, str]
    order: int
    digest: str  # changes when the rule's definition changes: persisted state of an edited rule is dropped

    def covers(self, pool: str) -> bool:
        return any(fnmatch.fnmatchcase(pool, pat) for pat in self.pools)

    @property
    def history_s(self) -> float:
        """How much metric history the rule reads."""
        return max(self.when.window_s, self.clear_when.window_s if self.clear_when else 0.0)

    def clamp(self, knob: str, value: float) -> float:
        lo, hi = self.bounds.get(knob, (None, None))
        if lo is not None:
            value = max(lo, value)
        if hi is not None:
            value = min(hi, value)
        return value


@dataclass(frozen=True)
class PolicySet:
    rules: tuple[Rule, ...] = ()
    source: str = "<none>"
    text: str = ""
    names: frozenset[str] = field(default_factory=frozenset)

    @property
    def history_s(self) -> float:
        return max((r.history_s for r in self.rules), default=0.0)


def _expr(
    text: str, metrics: tuple[str, ...], other: tuple[str, ...], source: str, pos: tuple[int, int], where: str
) -> Expr:
    try:
        return parse(text, metrics, other)
    except ExprError as exc:
        line, col = pos
        # Plain single-line scalars map exactly; for quoted or folded ones the column is the value's start.
        col = col + exc.offset if "\n" not in text else col
        raise ConfigError([f"{source}:{line}:{col}: {where}: {exc.message} (in: {text})"]) from None


def _value_pos(marked: Marked, loc: tuple[str | int, ...], text: str, source_text: str) -> tuple[int, int]:
    """Line and column where a scalar's text begins (the marks locate a mapping value at its key)."""
    line, col = locate(marked.marks, loc)
    lines = source_text.splitlines()
    if 1 <= line <= len(lines):
        row = lines[line - 1]
        idx = row.find(text, col - 1)
        if idx >= 0:
            return line, idx + 1
    return line, col


def compile_policies(text: str, source: str = "<string>") -> PolicySet:
    """Parse and validate a policy file's text; ConfigError lists every problem as file:line:col: where: what."""
    marked = load_marked(text, source)
    if marked.data is None or marked.data == {}:
        return PolicySet((), source, text)
    spec = validate(PolicyFile, marked, source)
    rules: list[Rule] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(spec.policies):
        base: tuple[str | int, ...] = ("policies", i)
        try:
            r = _validate_rule(raw, marked, i, source)
        except ConfigError as exc:
            problems += exc.problems
            continue

        def at(*loc: str | int, _base: tuple[str | int, ...] = base) -> str:
            line, col = locate(marked.marks, (*_base, *loc))
            return f"{source}:{line}:{col}"

        if r.name in seen:
            problems.append(
                f"{at('name')}: policies[{i}].name: {r.name!r} is already the name of policies[{seen[r.name]}]"
            )
            continue
        seen[r.name] = i
        exprs = _rule_exprs(r, i, marked, text, source, problems)
        actions = _rule_actions(r, i, at, problems)
        bounds = _rule_bounds(r, i, at, problems)
        if len(actions) != len(r.then) or "when" not in exprs or (r.clear_when and "clear_when" not in exprs):
            continue
        rules.append(_rule(r, i, exprs["when"], exprs.get("clear_when"), actions, bounds))
    if problems:
        raise ConfigError(problems)
    return PolicySet(tuple(rules), source, text, frozenset(r.name for r in rules))


def _rule_exprs(r: RuleSpec, i: int, marked: Marked, text: str, source: str, problems: list[str]) -> dict[str, Expr]:
    """Rule ``i``'s ``when`` and ``clear_when`` parsed (the ones that parse); what does not parse, into ``problems``."""
    metrics = POOL_METRICS + (WORKER_METRICS if r.scope.level == "worker" else ())
    other = () if r.scope.level == "worker" else WORKER_METRICS
    exprs: dict[str, Expr] = {}
    for key, expr_text in (("when", r.when), ("clear_when", r.clear_when)):
        if expr_text is None:
            continue
        try:
            pos = _value_pos(marked, ("policies", i, key), expr_text, text)
            exprs[key] = _expr(expr_text, metrics, other, source, pos, f"policies[{i}].{key}")
        except ConfigError as exc:
            problems += exc.problems
    return exprs


def _rule_actions(r: RuleSpec, i: int, at: Callable[..., str], problems: list[str]) -> list[Action]:
    """Rule ``i``'s valid actions; the others' problems into ``problems``."""
    actions: list[Action] = []
    for j, a in enumerate(r.then):
        knob = KNOBS.get((r.scope.level, a.knob))
        if knob is None:
            names = sorted(k.name for (lvl, _), k in KNOBS.items() if lvl == r.scope.level)
            problems.append(
                f"{at('then', j, 'knob')}: policies[{i}].then[{j}].knob: unknown {r.scope.level} knob {a.knob!r}: "
                f"expected one of {', '.join(names)}"
            )
            continue
        if (a.by is None) == (a.to is None):
            problems.append(f"{at('then', j)}: policies[{i}].then[{j}]: give exactly one of `by` or `to`")
            continue
        if a.to is not None and not knob.lo <= a.to <= knob.hi:
            problems.append(f"{at('then', j, 'to')}: policies[{i}].then[{j}].to: {a.to:g} is outside "
                            f"{a.knob}'s range {knob.lo:g}..{knob.hi:g}")  # fmt: skip
            continue
        actions.append(Action(knob, a.by, a.to))
    return actions


def _rule_bounds(
    r: RuleSpec, i: int, at: Callable[..., str], problems: list[str]
) -> dict[str, tuple[float | None, float | None]]:
    """Rule ``i``'s valid bounds, knob -> (min, max); the others' problems into ``problems``."""
    bounds: dict[str, tuple[float | None, float | None]] = {}
    for name, b in r.bounds.items():
        if (r.scope.level, name) not in KNOBS:
            problems.append(f"{at('bounds', name)}: policies[{i}].bounds.{name}: unknown {r.scope.level} knob")
        elif b.min is not None and b.max is not None and b.min > b.max:
            problems.append(f"{at('bounds', name)}: policies[{i}].bounds.{name}: min {b.min:g} > max {b.max:g}")
        else:
            bounds[name] = (b.min, b.max)
    return bounds


def _rule(
    r: RuleSpec,
    i: int,
    when: Expr,
    clear: Expr | None,
    actions: list[Action],
    bounds: dict[str, tuple[float | None, float | None]],
) -> Rule:
    """The compiled rule ``i`` (all its parts valid)."""
    digest = hashlib.sha256(json.dumps(r.model_dump(by_alias=True), sort_keys=True).encode()).hexdigest()[:16]
    return Rule(
        name=r.name,
        when=when,
        for_s=parse_duration(r.for_),
        level=r.scope.level,
        pools=tuple(r.scope.pools),
        role=r.scope.role,
        actions=tuple(actions),
        bounds=bounds,
        cooldown_s=parse_duration(r.cooldown),
        max_per=parse_rate(r.max_per) if r.max_per else None,
        clear_when=clear,
        priority=r.priority,
        dry_run=r.dry_run,
        labels=dict(r.labels),
        annotations=dict(r.annotations),
        order=i,
        digest=digest,
    )


def load_policies(path: str | Path) -> PolicySet:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror}"]) from exc
    return compile_policies(text, str(p))
