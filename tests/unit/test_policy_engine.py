"""dsec.policy: policy files (every problem as file:line:col), the expression language, the engine's phases and
guardrails in virtual time, persisted rule state, the series store, and what-if replay of the shipped examples."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest

from dsec.policy import (
    KNOBS,
    POOL_METRICS,
    WORKER_METRICS,
    Decision,
    Engine,
    PolicySet,
    RuleState,
    Scope,
    SeriesStore,
    Transition,
    compile_policies,
    load_policies,
)
from dsec.policy.expr import ExprError, parse, parse_duration, range_value
from dsec.policy.replay import replay
from dsec.policy.rules import Knob
from dsec.policy.series import Key
from dsec.yamlconf import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "policies"
T0 = 1_800_000_000.0  # the example series starts here
MIN = 60.0
HOUR = 3600.0
LOST: Key = ("dsec_workers_lost", "pool-0", None)
ALL_METRICS = POOL_METRICS + WORKER_METRICS


def policies(text: str) -> PolicySet:
    return compile_policies(textwrap.dedent(text), "p.yaml")


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        compile_policies(textwrap.dedent(text), "p.yaml")
    assert str(exc.value) == "\n".join(exc.value.problems)
    return exc.value.problems


def store(*series: tuple[Key, Iterable[tuple[float, float]]]) -> SeriesStore:
    s = SeriesStore(retention_s=1e9)
    for key, points in series:
        s.add_series(key, points)
    return s


def steps(key: Key, changes: Iterable[tuple[float, float]]) -> tuple[Key, list[tuple[float, float]]]:
    """A step function: (minute, value) change points; an instant metric reads the newest one."""
    return key, [(T0 + m * MIN, v) for m, v in changes]


def per_minute(key: Key, values: Iterable[float]) -> tuple[Key, list[tuple[float, float]]]:
    return key, [(T0 + i * MIN, v) for i, v in enumerate(values)]


class Sim:
    """Engine.evaluate in virtual minutes from T0, with knob values that follow the applied decisions."""

    def __init__(
        self,
        ps: PolicySet | str,
        series: SeriesStore,
        scopes: Iterable[Scope] = (Scope("pool-0"),),
        knobs: dict[tuple[str, str], float] | None = None,
        states: dict[tuple[str, str], RuleState] | None = None,
    ) -> None:
        self.ps = policies(ps) if isinstance(ps, str) else ps
        self.engine = Engine(self.ps, states)
        self.series = series
        self.scopes = list(scopes)
        self.knobs = dict(knobs or {})  # (scope key, knob) -> value
        self.suppressed: set[str] = set()
        self.decisions: list[Decision] = []
        self.transitions: list[Transition] = []

    def read(self, scope: Scope, knob: Knob) -> float | None:
        return self.knobs.get((scope.key, knob.name))

    def at(self, minute: float) -> tuple[list[Decision], list[Transition]]:
        ds, ts = self.engine.evaluate(
            T0 + minute * MIN, self.scopes, self.series, self.read, lambda pool: pool in self.suppressed
        )
        for d in ds:
            if d.changes and d.new is not None:
                self.knobs[(d.scope.key, d.knob)] = d.new
        self.decisions += ds
        self.transitions += ts
        return ds, ts

    def run(self, first: int, last: int) -> SeriesStore:
        for m in range(first, last + 1):
            self.at(m)
        return self.series

    def log(self) -> list[tuple[float, str, str, str, float | None, float | None]]:
        return [((d.at - T0) / MIN, d.rule, d.scope.key, d.outcome, d.old, d.new) for d in self.decisions]

    def phases(self) -> list[tuple[float, str, str, str]]:
        return [((t.at - T0) / MIN, t.rule, t.scope.key, t.phase) for t in self.transitions]

    def state(self, rule: str, scope: str = "pool-0") -> RuleState:
        return self.engine.states[(rule, scope)]


# == 1. policy files: every problem as file:line:col: where: what ===========================================
def test_valid_file_compiles_with_defaults_and_every_field() -> None:
    ps = policies(
        """\
        policies:
          - name: minimal
            when: dsec_workers_lost > 2
            then: [{knob: gpu_quota, by: -1}]
          - name: full.rule-1
            when: increase(dsec_melt_down_count[1h]) > 3
            for: 1h30m
            scope: {level: worker, pools: ["pool-*", gpu-a], role: actor}
            then:
              - knob: latency_cap_ms
                by: -10
              - knob: compression_bits
                to: 8
            bounds: {latency_cap_ms: {min: 60, max: 500}}
            cooldown: 1h
            max_per: 3/1d
            clear_when: avg_over_time(dsec_breaker_level[2h]) <= 1
            priority: 7
            dry_run: true
            labels: {severity: warning}
            annotations: {runbook: "see docs"}
        """
    )
    assert ps.names == frozenset({"minimal", "full.rule-1"}) and ps.source == "p.yaml"
    a, b = ps.rules
    assert (a.for_s, a.level, a.pools, a.role, a.cooldown_s, a.max_per, a.clear_when, a.priority, a.dry_run) == (
        0.0, "pool", ("*",), None, 0.0, None, None, 0, False
    )  # fmt: skip
    assert a.actions[0].knob == KNOBS[("pool", "gpu_quota")] and (a.actions[0].by, a.actions[0].to) == (-1, None)
    assert (a.order, b.order) == (0, 1)
    assert b.for_s == 5400.0 and b.level == "worker" and b.pools == ("pool-*", "gpu-a") and b.role == "actor"
    assert [(x.knob.name, x.knob.level, x.by, x.to) for x in b.actions] == [
        ("latency_cap_ms", "worker", -10, None),
        ("compression_bits", "worker", None, 8),
    ]
    assert b.bounds == {"latency_cap_ms": (60, 500)}
    assert (b.cooldown_s, b.max_per, b.priority, b.dry_run) == (3600.0, (3, 86400.0), 7, True)
    assert b.clear_when is not None and b.clear_when.text == "avg_over_time(dsec_breaker_level[2h]) <= 1"
    assert b.labels == {"severity": "warning"} and b.annotations == {"runbook": "see docs"}
    assert b.when.window_s == 3600.0 and b.history_s == 7200.0 and ps.history_s == 7200.0
    assert a.history_s == 0.0


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "{}\n", "policies: []\n"])
def test_empty_file_has_no_rules(text: str) -> None:
    ps = compile_policies(text, "p.yaml")
    assert ps.rules == () and ps.names == frozenset() and ps.history_s == 0.0


RULE = """\
policies:
  - name: a
    when: dsec_workers_lost > 2
    then: [{knob: gpu_quota, by: -1}]
"""

DURATION_HELP = "expected e.g. 30s, 5m, 1h, 1h30m, 1d"
POOL_KNOBS = (
    "bandwidth_cap_mbps, gpu_quota, latency_cap_ms, memory_base_gb, memory_ceiling_gb, snapshot_compression_level, "
    "snapshot_interval_s"
)
WORKER_KNOBS = (
    "bandwidth_cap_mbps, compression_bits, grad_accum_steps, latency_cap_ms, memory_ceiling_gb, "
    "snapshot_compression_level, snapshot_interval_s, sync_priority"
)

ERROR_CASES = [
    pytest.param(
        "policies:\n  - name: a\n    when: [x\n",
        ["p.yaml:4:1: invalid YAML: expected ',' or ']', but got '<stream end>'"],
        id="invalid-yaml-unclosed-flow",
    ),
    pytest.param(
        "policies:\n  - name: a\n    when: x: y\n",
        ["p.yaml:3:12: invalid YAML: mapping values are not allowed here"],
        id="invalid-yaml-mapping-in-scalar",
    ),
    pytest.param(
        "policies:\n  - name: a\n    name: b\n",
        ["p.yaml:3:5: duplicate key 'name'"],
        id="duplicate-yaml-key",
    ),
    pytest.param(
        RULE + "rules: []\n",
        ["p.yaml:5:1: rules: Extra inputs are not permitted"],
        id="unknown-top-level-key",
    ),
    pytest.param(
        "- a\n",
        ["p.yaml:1:1: <root>: Input should be a valid dictionary or instance of PolicyFile"],
        id="top-level-list",
    ),
    pytest.param(
        RULE + "    severity: high\n",
        ["p.yaml:5:5: policies[0].severity: Extra inputs are not permitted"],
        id="unknown-rule-key",
    ),
    pytest.param(
        "policies:\n  - name: a\n    then: [{knob: gpu_quota, by: -1}]\n",
        ["p.yaml:2:5: policies[0].when: Field required"],
        id="missing-when",
    ),
    pytest.param(
        "policies:\n  - name: a\n    when: dsec_workers_lost > 2\n",
        ["p.yaml:2:5: policies[0].then: Field required"],
        id="missing-then",
    ),
    pytest.param(
        "policies:\n  - name: a\n    when: dsec_workers_lost > 2\n    then: []\n",
        ["p.yaml:4:5: policies[0].then: List should have at least 1 item after validation, not 0"],
        id="empty-then",
    ),
    pytest.param(
        RULE.replace("name: a", 'name: "tighten cap"'),
        ["p.yaml:2:5: policies[0].name: String should match pattern '^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$'"],
        id="bad-rule-name",
    ),
    pytest.param(
        RULE + RULE.removeprefix("policies:\n").replace("when: dsec_workers_lost > 2", "when: dsec_workers_lost > 9"),
        ["p.yaml:5:5: policies[1].name: 'a' is already the name of policies[0]"],
        id="duplicate-rule-name",
    ),
    pytest.param(
        RULE + "    for: 5 minutes\n    cooldown: 1x\n",
        [
            f"p.yaml:5:5: policies[0].for: Value error, '5 minutes' is not a duration: {DURATION_HELP}",
            f"p.yaml:6:5: policies[0].cooldown: Value error, '1x' is not a duration: {DURATION_HELP}",
        ],
        id="bad-for-and-cooldown",
    ),
    pytest.param(
        RULE + "    for: 30\n",
        ["p.yaml:5:5: policies[0].for: Input should be a valid string"],
        id="for-without-unit",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "increase(dsec_melt_down_count[1x]) > 3"),
        [
            "p.yaml:3:41: policies[0].when: '1x' is neither a number nor a duration (e.g. 30s, 5m, 1h) "
            "(in: increase(dsec_melt_down_count[1x]) > 3)"
        ],
        id="bad-duration-in-range",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "increase(dsec_melt_down_count[5]) > 3"),
        [
            f"p.yaml:3:41: policies[0].when: '5' is not a duration: {DURATION_HELP} "
            "(in: increase(dsec_melt_down_count[5]) > 3)"
        ],
        id="range-without-unit",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "increase(dsec_melt_down_count[0s]) > 3"),
        ["p.yaml:3:41: policies[0].when: a range must be longer than 0s (in: increase(dsec_melt_down_count[0s]) > 3)"],
        id="zero-range",
    ),
    pytest.param(
        RULE + "    max_per: 3 per hour\n",
        [
            "p.yaml:5:5: policies[0].max_per: Value error, '3 per hour' is not a rate limit: "
            "expected COUNT/DURATION, e.g. 3/1h"
        ],
        id="max-per-words",
    ),
    pytest.param(
        RULE + "    max_per: 0/1h\n",
        [
            "p.yaml:5:5: policies[0].max_per: Value error, '0/1h' is not a rate limit: "
            "expected COUNT/DURATION, e.g. 3/1h"
        ],
        id="max-per-zero",
    ),
    pytest.param(
        RULE + "    max_per: 3/1x\n",
        [f"p.yaml:5:5: policies[0].max_per: Value error, '1x' is not a duration: {DURATION_HELP}"],
        id="max-per-bad-duration",
    ),
    pytest.param(
        RULE.replace("knob: gpu_quota", "knob: gpu_quotas"),
        [f"p.yaml:4:13: policies[0].then[0].knob: unknown pool knob 'gpu_quotas': expected one of {POOL_KNOBS}"],
        id="unknown-pool-knob",
    ),
    pytest.param(
        "policies:\n  - name: a\n    when: dsec_breaker_level > 2\n    scope: {level: worker}\n"
        "    then:\n      - knob: gpu_quota\n        by: -1\n",
        [f"p.yaml:6:9: policies[0].then[0].knob: unknown worker knob 'gpu_quota': expected one of {WORKER_KNOBS}"],
        id="pool-knob-in-worker-rule",
    ),
    pytest.param(
        "policies:\n  - name: a\n    when: dsec_workers_lost > 2\n    then:\n      - knob: gpu_quota\n"
        "        by: -1\n        to: 2\n      - knob: latency_cap_ms\n",
        [
            "p.yaml:5:9: policies[0].then[0]: give exactly one of `by` or `to`",
            "p.yaml:8:9: policies[0].then[1]: give exactly one of `by` or `to`",
        ],
        id="both-and-neither-by-to",
    ),
    pytest.param(
        "policies:\n  - name: a\n    when: dsec_workers_lost > 2\n    then:\n"
        "      - knob: snapshot_compression_level\n        to: 5\n",
        ["p.yaml:6:9: policies[0].then[0].to: 5 is outside snapshot_compression_level's range 0..3"],
        id="to-outside-knob-range",
    ),
    pytest.param(
        "policies:\n  - name: a\n    when: dsec_workers_lost > 2\n    then: [{knob: latency_cap_ms, to: 0.5}]\n",
        ["p.yaml:4:35: policies[0].then[0].to: 0.5 is outside latency_cap_ms's range 1..1e+06"],
        id="to-below-knob-range-flow-style",
    ),
    pytest.param(
        RULE + "    bounds:\n      gpu: {min: 1}\n      gpu_quota: {min: 4, max: 2}\n",
        [
            "p.yaml:6:7: policies[0].bounds.gpu: unknown pool knob",
            "p.yaml:7:7: policies[0].bounds.gpu_quota: min 4 > max 2",
        ],
        id="bad-bounds",
    ),
    pytest.param(
        RULE + "    bounds: {gpu_quota: {floor: 1}}\n",
        ["p.yaml:5:26: policies[0].bounds.gpu_quota.floor: Extra inputs are not permitted"],
        id="bounds-unknown-field",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "dsec_melt_count > 3"),
        [
            "p.yaml:3:11: policies[0].when: unknown metric 'dsec_melt_count' (did you mean dsec_melt_down_count?) "
            "(in: dsec_melt_count > 3)"
        ],
        id="unknown-metric-with-hint",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "avg_over_time(dsec_sandbox_utilisation[1h]) < 0.4"),
        [
            "p.yaml:3:25: policies[0].when: unknown metric 'dsec_sandbox_utilisation' "
            "(did you mean dsec_sandbox_utilization_rate?) (in: avg_over_time(dsec_sandbox_utilisation[1h]) < 0.4)"
        ],
        id="unknown-metric-inside-function",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "(dsec_workers_lost + 1 > 2"),
        [
            "p.yaml:3:37: policies[0].when: expected ')', found the end of the expression "
            "(in: (dsec_workers_lost + 1 > 2)"
        ],
        id="missing-paren",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "dsec_melt_down_count[1h] > 3"),
        [
            "p.yaml:3:31: policies[0].when: a range selector needs a function: e.g. "
            "avg_over_time(dsec_melt_down_count[1h]) or increase(dsec_melt_down_count[1h]) "
            "(in: dsec_melt_down_count[1h] > 3)"
        ],
        id="range-without-function",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "1 < dsec_workers_lost < 3"),
        ["p.yaml:3:33: policies[0].when: comparisons do not chain: use 'and' (in: 1 < dsec_workers_lost < 3)"],
        id="chained-comparison",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "sum(dsec_workers_lost[1h]) > 3"),
        [
            "p.yaml:3:11: policies[0].when: unknown function 'sum': expected one of increase, rate, delta, "
            "avg_over_time, min_over_time, max_over_time, last_over_time, count_over_time "
            "(in: sum(dsec_workers_lost[1h]) > 3)"
        ],
        id="unknown-function",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "dsec_breaker_level >= 2"),
        [
            "p.yaml:3:11: policies[0].when: 'dsec_breaker_level' is a per-worker metric: use it in a rule with "
            "scope level: worker (in: dsec_breaker_level >= 2)"
        ],
        id="worker-metric-in-pool-rule",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", '"increase(dsec_worker_melt_down_count[1h]) > 2"'),
        [
            "p.yaml:3:21: policies[0].when: 'dsec_worker_melt_down_count' is a per-worker metric: use it in a rule "
            "with scope level: worker (in: increase(dsec_worker_melt_down_count[1h]) > 2)"
        ],
        id="worker-metric-in-pool-rule-quoted",
    ),
    pytest.param(
        RULE + "    clear_when: dsec_workers_lost <\n",
        [
            "p.yaml:5:36: policies[0].clear_when: expected a number, a metric or a function, "
            "found the end of the expression (in: dsec_workers_lost <)"
        ],
        id="clear-when-error",
    ),
    pytest.param(
        RULE.replace("dsec_workers_lost > 2", "5m > 2"),
        ["p.yaml:3:11: policies[0].when: a duration (5m) is only valid inside [...] (in: 5m > 2)"],
        id="duration-outside-range",
    ),
    pytest.param(
        RULE + "    scope: {level: node}\n",
        ["p.yaml:5:13: policies[0].scope.level: Input should be 'pool' or 'worker'"],
        id="bad-scope-level",
    ),
    pytest.param(
        RULE + "    scope: {pools: []}\n",
        ["p.yaml:5:13: policies[0].scope.pools: List should have at least 1 item after validation, not 0"],
        id="empty-pool-list",
    ),
]


@pytest.mark.parametrize(("text", "expected"), ERROR_CASES)
def test_problems_name_file_line_column_where_and_what(text: str, expected: list[str]) -> None:
    assert problems(text) == expected


def test_worker_metric_is_accepted_in_a_worker_rule() -> None:
    ps = policies(
        """\
        policies:
          - name: w
            when: dsec_breaker_level >= 2 and increase(dsec_worker_melt_down_count[1h]) > 2
            scope: {level: worker}
            then: [{knob: compression_bits, to: 8}]
        """
    )
    assert ps.rules[0].when.metrics == frozenset({"dsec_breaker_level", "dsec_worker_melt_down_count"})


def test_several_problems_in_one_file_are_all_reported() -> None:
    got = problems(
        """\
        policies:
          - name: a
            when: dsec_workers_lost > 2
            then: [{knob: gpu_quotas, by: -1}]
          - name: b
            when: dsec_workers_lots > 2
            then: [{knob: gpu_quota, by: -1}]
          - name: c
            when: dsec_workers_lost > 2
            then: [{knob: gpu_quota, by: -1}]
            bounds: {gpu_quota: {min: 3, max: 1}}
          - name: a
            when: dsec_workers_lost > 2
            then: [{knob: gpu_quota, by: -1}]
          - name: e
            when: dsec_workers_lost > 2
            then: [{knob: gpu_quota, to: -1}]
        """
    )
    assert got == [
        f"p.yaml:4:13: policies[0].then[0].knob: unknown pool knob 'gpu_quotas': expected one of {POOL_KNOBS}",
        "p.yaml:6:11: policies[1].when: unknown metric 'dsec_workers_lots' "
        "(did you mean dsec_workers_lost, dsec_workers_active?) (in: dsec_workers_lots > 2)",
        "p.yaml:11:14: policies[2].bounds.gpu_quota: min 3 > max 1",
        "p.yaml:12:5: policies[3].name: 'a' is already the name of policies[0]",
        "p.yaml:17:30: policies[4].then[0].to: -1 is outside gpu_quota's range 0..4096",
    ]


def test_several_schema_problems_in_one_file_are_all_reported() -> None:
    got = problems(
        """\
        policies:
          - name: a
            when: dsec_workers_lost > 2
            for: soon
            then: [{knob: gpu_quota, by: -1}]
          - name: b
            then: [{knob: gpu_quota, by: -1}]
            max_per: 3 per hour
            dry_run: maybe
        """
    )
    assert got == [
        f"p.yaml:4:5: policies[0].for: Value error, 'soon' is not a duration: {DURATION_HELP}",
        "p.yaml:6:5: policies[1].when: Field required",
        "p.yaml:8:5: policies[1].max_per: Value error, '3 per hour' is not a rate limit: "
        "expected COUNT/DURATION, e.g. 3/1h",
        "p.yaml:9:5: policies[1].dry_run: Input should be a valid boolean, unable to interpret input",
    ]


def test_a_schema_problem_does_not_hide_expression_problems_of_other_rules() -> None:
    got = problems(
        """\
        policies:
          - name: a
            when: dsec_workers_lost > 2
            for: 5x
            then: [{knob: gpu_quota, by: -1}]
          - name: b
            when: dsec_nope > 2
            then: [{knob: gpu_quota, by: -1}]
        """
    )
    assert len(got) == 2 and got[1].startswith("p.yaml:7:11: policies[1].when: unknown metric 'dsec_nope'")


def test_load_policies_reads_a_file_and_names_it(tmp_path: Path) -> None:
    p = tmp_path / "rules.yaml"
    p.write_text(RULE.replace("dsec_workers_lost", "dsec_workers_lots"))
    with pytest.raises(ConfigError) as exc:
        load_policies(p)
    assert exc.value.problems[0].startswith(f"{p}:3:11: policies[0].when: unknown metric 'dsec_workers_lots'")
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as exc:
        load_policies(missing)
    assert exc.value.problems == [f"{missing}: cannot read: No such file or directory"]
    p.write_text(RULE)
    assert load_policies(p).source == str(p)


def test_digest_follows_the_definition_not_the_position() -> None:
    a = policies(RULE).rules[0]
    assert policies(RULE).rules[0].digest == a.digest
    b = "  - name: b\n    when: dsec_workers_lost > 9\n    then: [{knob: gpu_quota, to: 1}]\n"
    swapped = "policies:\n" + b + RULE.removeprefix("policies:\n")
    assert [r.name for r in policies(swapped).rules] == ["b", "a"]
    assert policies(swapped).rules[1].digest == a.digest
    assert policies(RULE.replace("> 2", "> 3")).rules[0].digest != a.digest
    assert policies(RULE + "    cooldown: 1h\n").rules[0].digest != a.digest


# == 2. the expression language ============================================================================
def ev(text: str, series: SeriesStore | None = None, now: float = T0, pool: str = "pool-0") -> float:
    s = series or SeriesStore()
    e = parse(text, ALL_METRICS)
    return e.eval(lambda m: s.instant((m, pool, None), now), lambda m, w: s.range((m, pool, None), now, w), now)


def observed(text: str, series: SeriesStore | None = None, now: float = T0) -> float:
    s = series or SeriesStore()
    e = parse(text, ALL_METRICS)
    return e.observed(
        lambda m: s.instant((m, "pool-0", None), now), lambda m, w: s.range((m, "pool-0", None), now, w), now
    )


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1 + 2 * 3", 7.0),
        ("(1 + 2) * 3", 9.0),
        ("10 - 4 - 3", 3.0),
        ("8 / 4 / 2", 1.0),
        ("-2 * 3 + 10", 4.0),
        ("2 * -3", -6.0),
        ("- -2", 2.0),
        ("1.5e2 + .5", 150.5),
        ("2 + 3 > 4", 1.0),
        ("1 + 1 == 2", 1.0),
        ("3 != 3", 0.0),
        ("2 >= 2 and 2 <= 2", 1.0),
        ("1 > 0 and 2 > 1", 1.0),
        ("1 > 2 or 3 > 2", 1.0),
        ("0 or 0", 0.0),
        ("not (1 > 2)", 1.0),
        ("not 0", 1.0),
        ("not 5", 0.0),
        ("1 > 0 or 1 > 2 and 1 > 2", 1.0),  # and binds tighter than or
        ("1 > 2 and 1 > 2 or 1 > 0", 1.0),
        ("(1 > 0 or 1 > 2) and 1 > 2", 0.0),
        ("1 > 2 and 1 / 0", 0.0),  # short-circuit
        ("1 > 0 or 1 / 0", 1.0),
        ("3 and 4", 1.0),
    ],
)
def test_arithmetic_logic_and_precedence(text: str, value: float) -> None:
    assert ev(text) == value


@pytest.mark.parametrize("text", ["1 / 0", "0 / 0", "dsec_workers_lost / 0", "(1 / 0) * 0", "-(1 / 0)"])
def test_division_by_zero_is_nan(text: str) -> None:
    s = store(steps(LOST, [(0, 3)]))
    assert math.isnan(ev(text, s))


@pytest.mark.parametrize(
    "text",
    [
        "dsec_workers_lost > 1",
        "dsec_workers_lost < 1",
        "dsec_workers_lost >= 0",
        "dsec_workers_lost <= 0",
        "dsec_workers_lost == 0",
        "dsec_workers_lost != 0",
        "dsec_workers_lost + 1 > 0",
        "1 / 0 > 0",
        "1 / 0 != 1",
        "increase(dsec_melt_down_count[1h]) > -1",
        "avg_over_time(dsec_sandbox_utilization_rate[2h]) < 0.4",
        "dsec_workers_lost > 1 and 1 > 0",
        "1 > 0 and dsec_workers_lost < 1",
    ],
)
def test_comparisons_with_missing_data_are_unknown_and_never_hold(text: str) -> None:
    assert math.isnan(ev(text))  # unknown, which a rule treats as "does not hold"
    assert math.isnan(ev(f"not ({text})"))  # and `not` cannot turn missing data into a reason to act


def test_nan_propagates_through_arithmetic_and_not_but_or_can_still_hold() -> None:
    assert math.isnan(ev("dsec_workers_lost + 1"))
    assert math.isnan(ev("dsec_workers_lost * 0"))
    assert math.isnan(ev("-dsec_workers_lost"))
    assert math.isnan(ev("not dsec_workers_lost"))
    assert ev("dsec_workers_lost > 1 or 2 > 1") == 1.0
    assert ev("dsec_workers_lost or 1") == 1.0
    assert math.isnan(ev("dsec_workers_lost and 1"))  # unknown and true: unknown
    assert ev("dsec_workers_lost and 0") == 0.0  # unknown and false: false
    assert math.isnan(ev("dsec_workers_lost or 0"))  # unknown or false: unknown


def test_not_of_a_comparison_on_missing_data_does_not_hold() -> None:
    assert ev("not (dsec_workers_lost > 3)") != 1.0


def test_instant_metric_is_the_newest_sample_at_or_before_now() -> None:
    s = store(steps(LOST, [(0, 1), (1, 2), (2, 3)]))
    assert math.isnan(ev("dsec_workers_lost", s, T0 - 1))
    assert ev("dsec_workers_lost", s, T0) == 1.0
    assert ev("dsec_workers_lost", s, T0 + 59) == 1.0
    assert ev("dsec_workers_lost", s, T0 + MIN) == 2.0
    assert ev("dsec_workers_lost", s, T0 + 90) == 2.0
    assert ev("dsec_workers_lost", s, T0 + 10 * HOUR) == 3.0  # no staleness limit
    assert math.isnan(ev("dsec_workers_lost", s, T0, pool="pool-1"))  # per pool


COUNTER: Key = ("dsec_melt_down_count", "pool-0", None)


def test_increase_and_rate_handle_a_counter_reset() -> None:
    # 5 -> 7 (+2), reset to 2 (+2: the counter restarted from 0), 2 -> 4 (+2)
    s = store(steps(COUNTER, [(0, 5), (1, 7), (2, 2), (3, 4)]))
    now = T0 + 3 * MIN
    assert ev("increase(dsec_melt_down_count[3m])", s, now) == 6.0
    assert ev("rate(dsec_melt_down_count[3m])", s, now) == pytest.approx(6.0 / 180.0)
    assert ev("delta(dsec_melt_down_count[3m])", s, now) == -1.0
    # the window is [now - w, now]: a 2m window starts at the 7
    assert ev("increase(dsec_melt_down_count[2m])", s, now) == 4.0
    # samples after `now` are not seen
    assert ev("increase(dsec_melt_down_count[1h])", s, T0 + MIN) == 2.0
    # a single sample or none: no growth / no data
    assert ev("increase(dsec_melt_down_count[30s])", s, now) == 0.0
    assert math.isnan(ev("increase(dsec_melt_down_count[1h])", s, T0 - 1))
    assert math.isnan(ev("rate(dsec_melt_down_count[1h])", s, T0 - 1))


def test_over_time_functions_skip_nan_samples() -> None:
    s = store(steps(LOST, [(0, 4), (1, math.nan), (2, 1), (3, 7), (4, 2)]))
    now = T0 + 4 * MIN
    assert ev("avg_over_time(dsec_workers_lost[1h])", s, now) == pytest.approx(3.5)
    assert ev("min_over_time(dsec_workers_lost[1h])", s, now) == 1.0
    assert ev("max_over_time(dsec_workers_lost[1h])", s, now) == 7.0
    assert ev("last_over_time(dsec_workers_lost[1h])", s, now) == 2.0
    assert ev("count_over_time(dsec_workers_lost[1h])", s, now) == 4.0
    assert ev("delta(dsec_workers_lost[1h])", s, now) == -2.0
    assert ev("avg_over_time(dsec_workers_lost[1m])", s, now) == pytest.approx(4.5)  # the 7 and the 2
    assert ev("count_over_time(dsec_workers_lost[1h])", s, T0 - 1) == 0.0
    for fn in ("avg_over_time", "min_over_time", "max_over_time", "last_over_time", "delta"):
        assert math.isnan(ev(f"{fn}(dsec_workers_lost[1h])", s, T0 - 1)), fn


def test_range_value_directly() -> None:
    samples = [(0.0, 1.0), (10.0, 3.0), (20.0, 0.0), (30.0, 2.0)]
    assert range_value("increase", samples, 30.0) == 4.0
    assert range_value("rate", samples, 40.0) == pytest.approx(0.1)
    assert range_value("delta", samples, 30.0) == 1.0
    assert range_value("count_over_time", [(0.0, math.nan)], 30.0) == 0.0
    assert math.isnan(range_value("increase", [(0.0, math.nan)], 30.0))


def test_observed_is_the_left_side_of_a_top_level_comparison() -> None:
    s = store(steps(COUNTER, [(0, 0), (10, 4)]), steps(LOST, [(0, 3)]))
    now = T0 + 10 * MIN
    assert observed("increase(dsec_melt_down_count[1h]) > 3", s, now) == 4.0
    assert observed("dsec_workers_lost + 1 >= 100", s, now) == 4.0
    assert observed("(dsec_workers_lost > 1)", s, now) == 3.0
    assert math.isnan(observed("dsec_workers_lost > 1 and 1 > 0", s, now))
    assert math.isnan(observed("dsec_workers_lost", s, now))
    assert math.isnan(observed("dsec_pool_memory_used_gb > 1", s, now))  # missing data


def test_parsed_expression_knows_its_window_and_metrics() -> None:
    e = parse(
        "increase(dsec_melt_down_count[1h]) > 3 and avg_over_time(dsec_sandbox_utilization_rate[1h30m]) < 0.4 "
        "or dsec_workers_lost > 0",
        POOL_METRICS,
    )
    assert e.window_s == 5400.0
    assert e.metrics == frozenset({"dsec_melt_down_count", "dsec_sandbox_utilization_rate", "dsec_workers_lost"})
    assert parse("dsec_workers_lost > 0", POOL_METRICS).window_s == 0.0


@pytest.mark.parametrize(
    ("text", "offset", "message"),
    [
        ("", 0, "empty expression"),
        ("   ", 0, "empty expression"),
        ("1 +", 3, "expected a number, a metric or a function, found the end of the expression"),
        ("dsec_workers_lost > 1)", 21, "unexpected ')' after a complete expression"),
        ("dsec_workers_lost ! 1", 18, "unexpected character '!'"),
        ("dsec_workers_lost and", 21, "expected a number, a metric or a function, found the end of the expression"),
        ("increase(5)", 9, "increase() takes a metric with a range, e.g. increase(dsec_melt_down_count[1h])"),
        ("increase(dsec_workers_lost)", 26, "expected a range after dsec_workers_lost, e.g. [1h], found ')'"),
        ("increase(dsec_workers_lost[1h]", 30, "expected ')', found the end of the expression"),
        ("increase(dsec_workers_lost[1h:5m])", 29, "unexpected character ':'"),
        ("dsec_lost > 1", 0, "unknown metric 'dsec_lost' (did you mean dsec_workers_lost?)"),
        ("foo > 1", 0, "unknown metric 'foo'"),
        ("1 > 2 > 3", 6, "comparisons do not chain: use 'and'"),
        ("1 == 1 != 0", 7, "comparisons do not chain: use 'and'"),
    ],
)
def test_expression_errors_carry_an_offset(text: str, offset: int, message: str) -> None:
    with pytest.raises(ExprError) as exc:
        parse(text, POOL_METRICS)
    assert (exc.value.offset, exc.value.message, str(exc.value)) == (offset, message, message)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("90s", 90.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("1d", 86400.0),
        ("1d2h3m4s", 93784.0),
        (" 10m ", 600.0),
        ("0s", 0.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", " ", "5", "1.5h", "5M", "m", "30m1h", "1x", "-5m", "5 m", "1h 30m"])
def test_parse_duration_errors(text: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_duration(text)
    assert str(exc.value) == f"{text!r} is not a duration: {DURATION_HELP}"


# == 3. the engine in virtual time ==========================================================================
def rule_text(extra: str = "", when: str = "dsec_workers_lost > 2", then: str = "[{knob: gpu_quota, by: -1}]") -> str:
    return f"policies:\n  - name: r\n    when: {when}\n    then: {then}\n" + textwrap.indent(
        textwrap.dedent(extra), "    "
    )


def test_for_goes_pending_resets_when_the_condition_drops_then_fires_after_for() -> None:
    sim = Sim(
        rule_text("for: 10m"),
        store(steps(LOST, [(0, 0), (5, 5), (10, 0), (20, 5)])),
        knobs={("pool-0", "gpu_quota"): 4},
    )
    sim.run(0, 29)
    assert sim.phases() == [(5, "r", "pool-0", "pending"), (10, "r", "pool-0", "reset"), (20, "r", "pool-0", "pending")]
    assert sim.decisions == []
    st = sim.state("r")
    assert (st.phase, st.since, st.last_action) == ("pending", T0 + 20 * MIN, None)
    sim.at(30)
    assert sim.phases()[-1] == (30, "r", "pool-0", "firing")
    assert sim.log() == [(30, "r", "pool-0", "applied", 4, 3)]
    assert sim.state("r").since == T0 + 30 * MIN and sim.state("r").last_action == T0 + 30 * MIN


def test_zero_for_fires_at_once_and_a_transition_carries_the_value_and_state() -> None:
    sim = Sim(rule_text(), store(steps(LOST, [(0, 5)])), knobs={("pool-0", "gpu_quota"): 4})
    _, ts = sim.at(0)
    assert [t.phase for t in ts] == ["pending", "firing"]
    ev_ = ts[1].to_event()
    assert ev_ == {
        "rule": "r",
        "scope": "pool-0",
        "phase": "firing",
        "value": 1.0,
        "state": {
            "phase": "firing",
            "since": T0,
            "last_action": None,
            "actions": [],
            "digest": sim.ps.rules[0].digest,
            "acted": False,
        },
    }
    assert sim.state("r").last_action == T0  # the transition's state is a copy taken before the action


def test_cooldown_zero_acts_once_per_firing_episode() -> None:
    sim = Sim(rule_text(), store(steps(LOST, [(0, 5), (10, 0), (20, 5)])), knobs={("pool-0", "gpu_quota"): 8})
    sim.run(0, 40)
    assert sim.log() == [(0, "r", "pool-0", "applied", 8, 7), (20, "r", "pool-0", "applied", 7, 6)]
    assert [(m, p) for m, _, _, p in sim.phases()] == [
        (0, "pending"), (0, "firing"), (10, "resolved"), (20, "pending"), (20, "firing")
    ]  # fmt: skip
    assert sim.state("r").phase == "firing"


def test_cooldown_repeats_the_action_while_firing() -> None:
    sim = Sim(rule_text("cooldown: 10m"), store(steps(LOST, [(0, 5), (36, 0)])), knobs={("pool-0", "gpu_quota"): 10})
    sim.run(0, 50)
    assert sim.log() == [
        (0, "r", "pool-0", "applied", 10, 9),
        (10, "r", "pool-0", "applied", 9, 8),
        (20, "r", "pool-0", "applied", 8, 7),
        (30, "r", "pool-0", "applied", 7, 6),
    ]
    assert sim.phases()[-1] == (36, "r", "pool-0", "resolved")
    st = sim.state("r")
    # The cooldown clock outlives the episode: a condition that comes back within 10 min does not act at once.
    assert (st.phase, st.since, st.last_action, st.digest) == ("inactive", None, T0 + 30 * 60, sim.ps.rules[0].digest)


def test_clear_when_hysteresis_keeps_firing_between_the_thresholds_and_rearms_only_after_clear() -> None:
    text = rule_text("clear_when: dsec_workers_lost < 2\n", when="dsec_workers_lost > 5")
    #                                fire     between   above again  clear    between  fire again
    sim = Sim(text, store(steps(LOST, [(0, 6), (5, 3), (10, 6), (15, 1), (20, 3), (25, 6)])),
              knobs={("pool-0", "gpu_quota"): 8})  # fmt: skip
    sim.run(0, 14)
    assert [(m, p) for m, _, _, p in sim.phases()] == [(0, "pending"), (0, "firing")]
    assert sim.state("r").phase == "firing"
    sim.run(15, 30)
    assert [(m, p) for m, _, _, p in sim.phases()][2:] == [(15, "resolved"), (25, "pending"), (25, "firing")]
    assert sim.log() == [(0, "r", "pool-0", "applied", 8, 7), (25, "r", "pool-0", "applied", 7, 6)]


def test_between_the_thresholds_a_rule_with_a_cooldown_does_not_keep_pushing() -> None:
    # Cooldown 10 min: while `when` holds the rule acts again every 10 min; between `when` and `clear_when` it keeps
    # firing (no resolve) for 30 min, three cooldowns, and acts not once more; above `when` again it resumes.
    text = rule_text("cooldown: 10m\nclear_when: dsec_workers_lost < 2\n", when="dsec_workers_lost > 5")
    sim = Sim(text, store(steps(LOST, [(0, 6), (12, 3), (45, 6)])), knobs={("pool-0", "gpu_quota"): 8})
    sim.run(0, 44)
    assert sim.log() == [(0, "r", "pool-0", "applied", 8, 7), (10, "r", "pool-0", "applied", 7, 6)]
    assert [p for _, _, _, p in sim.phases()] == ["pending", "firing"]
    sim.run(45, 45)
    assert sim.log()[-1] == (45, "r", "pool-0", "applied", 6, 5)


def test_missing_data_resolves_a_rule_without_clear_when_and_never_fires() -> None:
    sim = Sim(rule_text(), store(steps(LOST, [(0, 5), (10, math.nan)])), knobs={("pool-0", "gpu_quota"): 8})
    sim.run(0, 20)
    assert [(m, p) for m, _, _, p in sim.phases()] == [(0, "pending"), (0, "firing"), (10, "resolved")]
    empty = Sim(rule_text(), SeriesStore(), knobs={("pool-0", "gpu_quota"): 8})
    empty.run(0, 10)
    assert empty.decisions == [] and empty.transitions == []


def test_max_per_rate_limits_then_allows_again_after_the_window() -> None:
    sim = Sim(
        rule_text("cooldown: 10m\nmax_per: 2/1h\n"), store(steps(LOST, [(0, 5)])), knobs={("pool-0", "gpu_quota"): 100}
    )
    sim.run(0, 90)
    applied = [m for m, _, _, o, _, _ in sim.log() if o == "applied"]
    limited = [m for m, _, _, o, _, _ in sim.log() if o == "rate_limited"]
    assert applied == [0, 10, 60, 70]
    # retried at every evaluation while limited, until the oldest action leaves the window
    assert limited == list(range(20, 60)) + list(range(80, 91))
    d = next(d for d in sim.decisions if d.outcome == "rate_limited")
    assert (d.old, d.new, d.detail) == (98, None, "2 actions in the last 3600 s (max 2)")
    assert sim.knobs[("pool-0", "gpu_quota")] == 96
    assert sim.state("r").actions == [T0 + 60 * MIN, T0 + 70 * MIN]  # only the ones inside the window are kept


def test_bounds_clamp_then_at_bound_when_already_at_the_floor() -> None:
    text = rule_text("cooldown: 1m\nbounds: {latency_cap_ms: {min: 60}}\n", then="[{knob: latency_cap_ms, by: -15}]")
    sim = Sim(text, store(steps(LOST, [(0, 5)])), knobs={("pool-0", "latency_cap_ms"): 85})
    sim.run(0, 3)
    assert sim.log() == [
        (0, "r", "pool-0", "applied", 85, 70),
        (1, "r", "pool-0", "applied", 70, 60),  # 55 clamped to the floor
        (2, "r", "pool-0", "at_bound", 60, 60),
        (3, "r", "pool-0", "at_bound", 60, 60),
    ]
    d = sim.decisions[2]
    assert d.detail == "latency_cap_ms is already at 60 (bounds hold it there)" and not d.changes
    assert d.to_event()["outcome"] == "at_bound" and d.to_event()["dry_run"] is False


@pytest.mark.parametrize(
    ("then", "bounds", "old", "new"),
    [
        ("[{knob: latency_cap_ms, by: -1000}]", "{latency_cap_ms: {min: 0.5}}", 85, 1),  # knob range after rule's
        ("[{knob: latency_cap_ms, by: -1000}]", "{latency_cap_ms: {min: 50}}", 85, 50),
        ("[{knob: latency_cap_ms, by: 1000}]", "{latency_cap_ms: {max: 100}}", 85, 100),
        ("[{knob: latency_cap_ms, to: 30}]", "{latency_cap_ms: {min: 60}}", 85, 60),  # bounds apply to `to` too
        ("[{knob: latency_cap_ms, to: 900}]", "{latency_cap_ms: {min: 60, max: 500}}", 85, 500),
        ("[{knob: snapshot_compression_level, by: 5}]", "{}", 1, 3),  # the knob's own range
        ("[{knob: snapshot_compression_level, by: -5}]", "{}", 1, 0),
        ("[{knob: gpu_quota, by: 1}]", "{gpu_quota: {max: 8}}", 12, 8),  # a ceiling below the value pulls it down
    ],
)
def test_rule_bounds_then_the_knobs_range(then: str, bounds: str, old: float, new: float) -> None:
    knob = then.split("knob: ")[1].split(",")[0]
    sim = Sim(rule_text(f"bounds: {bounds}\n", then=then), store(steps(LOST, [(0, 5)])), knobs={("pool-0", knob): old})
    sim.at(0)
    assert sim.log() == [(0, "r", "pool-0", "applied", old, new)]


def test_to_sets_and_by_adjusts_and_by_needs_a_value() -> None:
    text = rule_text(
        then="[{knob: gpu_quota, to: 2}, {knob: latency_cap_ms, by: -10}, {knob: bandwidth_cap_mbps, by: 5}]"
    )
    sim = Sim(text, store(steps(LOST, [(0, 5)])), knobs={("pool-0", "latency_cap_ms"): 85})
    sim.at(0)
    # gpu_quota has no value (all devices): `to` still works; bandwidth has none: `by` cannot adjust it
    assert sim.log() == [
        (0, "r", "pool-0", "applied", None, 2),
        (0, "r", "pool-0", "applied", 85, 75),
        (0, "r", "pool-0", "no_value", None, None),
    ]
    assert sim.decisions[2].detail == "bandwidth_cap_mbps has no value to adjust in pool-0"
    assert sim.knobs == {("pool-0", "gpu_quota"): 2, ("pool-0", "latency_cap_ms"): 75}


def test_no_value_alone_is_retried_while_firing() -> None:
    sim = Sim(rule_text(), store(steps(LOST, [(0, 5)])))
    sim.run(0, 2)
    assert [o for _, _, _, o, _, _ in sim.log()] == ["no_value", "no_value", "no_value"]
    sim.knobs[("pool-0", "gpu_quota")] = 3
    sim.at(3)
    assert sim.log()[-1] == (3, "r", "pool-0", "applied", 3, 2)


@pytest.mark.parametrize(
    ("then", "old", "new"),
    [
        ("[{knob: gpu_quota, by: -1.4}]", 4, 3),
        ("[{knob: gpu_quota, to: 2.4}]", 4, 2),
        ("[{knob: snapshot_compression_level, by: 0.6}]", 1, 2),
        ("[{knob: latency_cap_ms, by: -0.25}]", 85, 84.75),  # a float knob is not rounded
    ],
)
def test_integer_knobs_are_rounded(then: str, old: float, new: float) -> None:
    knob = then.split("knob: ")[1].split(",")[0]
    sim = Sim(rule_text(then=then), store(steps(LOST, [(0, 5)])), knobs={("pool-0", knob): old})
    sim.at(0)
    (d,) = sim.decisions
    assert (d.outcome, d.old, d.new) == ("applied", old, new) and isinstance(d.new, float)


def test_dry_run_records_but_changes_nothing() -> None:
    ps = policies(rule_text("dry_run: true\ncooldown: 10m\n", then="[{knob: latency_cap_ms, by: -10}]"))
    s = store(per_minute(LOST, [5.0] * 25))
    result = replay(ps, s, step_s=MIN)
    assert [((d.at - T0) / MIN, d.outcome, d.old, d.new) for d in result.decisions] == [
        (0, "dry_run", 85, 75), (10, "dry_run", 85, 75), (20, "dry_run", 85, 75)
    ]  # fmt: skip
    assert not any(d.changes for d in result.decisions)
    assert result.knobs == {}
    assert result.decisions[0].to_event()["dry_run"] is True
    live = replay(policies(rule_text("cooldown: 10m\n", then="[{knob: latency_cap_ms, by: -10}]")), s, step_s=MIN)
    assert live.knobs == {("pool", "pool-0", "latency_cap_ms"): 55.0}


def test_suppressed_while_recovering_then_applied_once_the_window_ends() -> None:
    ps = policies(rule_text(then="[{knob: latency_cap_ms, by: -10}]"))
    s = store(per_minute(LOST, [5.0] * 21), per_minute(("dsec_workers_lost", "pool-1", None), [5.0] * 21))
    result = replay(ps, s, step_s=MIN, suppressed={"pool-0": (T0 - MIN, T0 + 10 * MIN)})
    rows = [((d.at - T0) / MIN, d.scope.key, d.outcome) for d in result.decisions]
    assert rows == (
        [(0, "pool-0", "suppressed"), (0, "pool-1", "applied")]
        + [(m, "pool-0", "suppressed") for m in range(1, 10)]
        + [(10, "pool-0", "applied")]
    )
    first = result.decisions[0]
    assert (first.old, first.new, first.detail) == (85, None, "pool pool-0 is recovering from a device failure")
    assert [t.phase for t in result.transitions if t.scope.pool == "pool-0"] == ["pending", "firing"]
    assert result.knobs == {("pool", "pool-0", "latency_cap_ms"): 75, ("pool", "pool-1", "latency_cap_ms"): 75}


def test_suppression_through_evaluate_directly() -> None:
    sim = Sim(rule_text(), store(steps(LOST, [(0, 5)])), knobs={("pool-0", "gpu_quota"): 4})
    sim.suppressed = {"pool-0"}
    sim.run(0, 2)
    assert [o for _, _, _, o, _, _ in sim.log()] == ["suppressed"] * 3
    sim.suppressed = set()
    sim.run(3, 5)
    assert sim.log()[3:] == [(3, "r", "pool-0", "applied", 4, 3)]


CONFLICT = """\
policies:
  - name: first
    when: dsec_workers_lost > 2
    then: [{knob: gpu_quota, to: 6}]
  - name: second
    when: dsec_workers_lost > 2
    PRIORITY
    then: [{knob: gpu_quota, to: 2}]
"""


def test_conflict_higher_priority_wins() -> None:
    sim = Sim(
        CONFLICT.replace("PRIORITY", "priority: 5"), store(steps(LOST, [(0, 5)])), knobs={("pool-0", "gpu_quota"): 4}
    )
    ds, _ = sim.at(0)
    assert [(d.rule, d.outcome, d.old, d.new) for d in ds] == [("second", "applied", 4, 2), ("first", "conflict", 4, 6)]
    assert ds[1].detail == "rule 'second' changes gpu_quota of pool-0 first"
    assert sim.knobs[("pool-0", "gpu_quota")] == 2


def test_conflict_equal_priority_earlier_in_the_file_wins() -> None:
    sim = Sim(
        CONFLICT.replace("PRIORITY", "priority: 0"), store(steps(LOST, [(0, 5)])), knobs={("pool-0", "gpu_quota"): 4}
    )
    ds, _ = sim.at(0)
    assert [(d.rule, d.outcome, d.new) for d in ds] == [("first", "applied", 6), ("second", "conflict", 2)]
    assert ds[1].detail == "rule 'first' changes gpu_quota of pool-0 first"


def test_no_conflict_across_pools_or_knobs() -> None:
    text = CONFLICT.replace("PRIORITY", "priority: 0").replace("to: 2}", "to: 2}, {knob: latency_cap_ms, by: -5}")
    s = store(steps(LOST, [(0, 5)]), steps(("dsec_workers_lost", "pool-1", None), [(0, 5)]))
    sim = Sim(text, s, scopes=[Scope("pool-0"), Scope("pool-1")], knobs={("pool-0", "latency_cap_ms"): 85})
    ds, _ = sim.at(0)
    assert [(d.rule, d.scope.key, d.knob, d.outcome) for d in ds] == [
        ("first", "pool-0", "gpu_quota", "applied"),
        ("first", "pool-1", "gpu_quota", "applied"),
        ("second", "pool-0", "gpu_quota", "conflict"),
        ("second", "pool-0", "latency_cap_ms", "applied"),
        ("second", "pool-1", "gpu_quota", "conflict"),
        ("second", "pool-1", "latency_cap_ms", "no_value"),
    ]


def test_a_rule_at_its_bound_does_not_claim_the_knob() -> None:
    text = CONFLICT.replace("PRIORITY", "priority: 0").replace("to: 6", "to: 4")
    sim = Sim(text, store(steps(LOST, [(0, 5)])), knobs={("pool-0", "gpu_quota"): 4})
    ds, _ = sim.at(0)
    assert [(d.rule, d.outcome) for d in ds] == [("first", "at_bound"), ("second", "applied")]


def test_the_losing_rule_does_not_override_the_winner_at_the_next_evaluation() -> None:
    sim = Sim(
        CONFLICT.replace("PRIORITY", "priority: 5"), store(steps(LOST, [(0, 5)])), knobs={("pool-0", "gpu_quota"): 4}
    )
    sim.run(0, 5)
    assert sim.knobs[("pool-0", "gpu_quota")] == 2
    assert [(m, r, o) for m, r, _, o, _, _ in sim.log() if o == "applied"] == [(0, "second", "applied")]


def test_a_dry_run_rule_does_not_block_a_live_rule() -> None:
    text = CONFLICT.replace("PRIORITY", "priority: 5\n    dry_run: true")
    sim = Sim(text, store(steps(LOST, [(0, 5)])), knobs={("pool-0", "gpu_quota"): 4})
    ds, _ = sim.at(0)
    assert [(d.rule, d.outcome) for d in ds] == [("second", "dry_run"), ("first", "applied")]


def test_cooldown_is_quiet_time_after_an_action_even_when_the_condition_flaps() -> None:
    text = rule_text("cooldown: 6h\n", then="[{knob: snapshot_compression_level, by: 1}]")
    sim = Sim(text, store(steps(LOST, [(0, 5), (10, 0), (20, 5)])), knobs={("pool-0", "snapshot_compression_level"): 0})
    sim.run(0, 30)
    assert [o for _, _, _, o, _, _ in sim.log()] == ["applied"]


WORKER_RULE = """\
policies:
  - name: w
    when: dsec_breaker_level >= 2 and dsec_workers_lost >= 0
    scope: {level: worker, pools: ["pool-0"], role: actor}
    then: [{knob: compression_bits, to: 8}]
  - name: pool-rule
    when: dsec_workers_lost >= 0
    then: [{knob: latency_cap_ms, by: -1}]
"""


def test_worker_rules_act_only_on_matching_workers() -> None:
    s = store(
        steps(("dsec_breaker_level", "pool-0", "w1"), [(0, 3)]),
        steps(("dsec_breaker_level", "pool-0", "w2"), [(0, 0)]),  # below the threshold
        steps(("dsec_breaker_level", "pool-0", "w3"), [(0, 3)]),  # a learner
        steps(("dsec_breaker_level", "pool-1", "w4"), [(0, 3)]),  # another pool
        steps(("dsec_breaker_level", "pool-0", None), [(0, 3)]),  # not a worker series: never read by w
        steps(LOST, [(0, 0)]),
        steps(("dsec_workers_lost", "pool-1", None), [(0, 0)]),
    )
    scopes = [
        Scope("pool-0"),
        Scope("pool-0", "w1", "actor"),
        Scope("pool-0", "w2", "actor"),
        Scope("pool-0", "w3", "learner"),
        Scope("pool-1", "w4", "actor"),
        Scope("pool-0", "w5", "actor"),  # no breaker series
    ]
    sim = Sim(WORKER_RULE, s, scopes=scopes, knobs={("pool-0", "latency_cap_ms"): 85})
    ds, _ = sim.at(0)
    assert [(d.rule, d.scope.key, d.level, d.knob, d.outcome, d.new) for d in ds] == [
        ("w", "pool-0/w1", "worker", "compression_bits", "applied", 8),
        ("pool-rule", "pool-0", "pool", "latency_cap_ms", "applied", 84),
    ]
    assert ds[0].to_event()["scope"] == "pool-0/w1" and Scope("pool-0", "w1").key == "pool-0/w1"
    assert set(sim.engine.states) == {
        ("w", "pool-0/w1"), ("w", "pool-0/w2"), ("w", "pool-0/w5"), ("pool-rule", "pool-0")
    }  # fmt: skip


def test_worker_rule_without_role_and_worker_meltdown_counter() -> None:
    text = """\
    policies:
      - name: w
        when: increase(dsec_worker_melt_down_count[1h]) > 2
        scope: {level: worker}
        then: [{knob: grad_accum_steps, by: 1}]
    """
    s = store(
        steps(("dsec_worker_melt_down_count", "pool-0", "w1"), [(0, 0), (10, 3)]),
        steps(("dsec_worker_melt_down_count", "pool-0", "w2"), [(0, 0), (10, 1)]),
        steps(("dsec_worker_melt_down_count", "pool-1", "w1"), [(0, 0), (10, 5)]),
    )
    scopes = [Scope("pool-0", "w1", "learner"), Scope("pool-0", "w2", "actor"), Scope("pool-1", "w1")]
    sim = Sim(text, s, scopes=scopes, knobs={(sc.key, "grad_accum_steps"): 1 for sc in scopes})
    sim.run(0, 12)
    assert sim.log() == [(10, "w", "pool-0/w1", "applied", 1, 2), (10, "w", "pool-1/w1", "applied", 1, 2)]
    assert sim.decisions[0].evidence == {"when": "increase(dsec_worker_melt_down_count[1h]) > 2", "observed": 3.0}


@pytest.mark.parametrize(
    ("pools", "covered"),
    [
        ('["*"]', {"pool-0", "pool-1", "gpu-a"}),
        ('["pool-*"]', {"pool-0", "pool-1"}),
        ('["gpu-a"]', {"gpu-a"}),
        ('["pool-?", "gpu-a"]', {"pool-0", "pool-1", "gpu-a"}),
        ('["pool-1", "nope"]', {"pool-1"}),
        ('["POOL-*"]', set()),  # case-sensitive
    ],
)
def test_pool_globs(pools: str, covered: set[str]) -> None:
    names = ["pool-0", "pool-1", "gpu-a"]
    text = rule_text(f"scope: {{pools: {pools}}}\n", then="[{knob: gpu_quota, to: 1}]")
    ps = policies(text)
    assert {p for p in names if ps.rules[0].covers(p)} == covered
    s = store(*(steps(("dsec_workers_lost", p, None), [(0, 5)]) for p in names))
    sim = Sim(ps, s, scopes=[Scope(p) for p in names])
    sim.at(0)
    assert {d.scope.pool for d in sim.decisions if d.outcome == "applied"} == covered


def test_evidence_is_the_observed_left_side() -> None:
    sim = Sim(
        rule_text(when="dsec_workers_lost * 2 > 2"), store(steps(LOST, [(0, 3)])), knobs={("pool-0", "gpu_quota"): 4}
    )
    sim.at(0)
    assert sim.decisions[0].evidence == {"when": "dsec_workers_lost * 2 > 2", "observed": 6.0}
    both = Sim(
        rule_text(when="dsec_workers_lost > 2 and 1 > 0"),
        store(steps(LOST, [(0, 3)])),
        knobs={("pool-0", "gpu_quota"): 4},
    )
    both.at(0)
    assert both.decisions[0].evidence["observed"] is None


# == 4. persisted rule state ===============================================================================
def test_rule_state_round_trip() -> None:
    st = RuleState("firing", T0, T0 + 60, [T0, T0 + 60], "abc123")
    assert RuleState.from_dict(st.to_dict()) == st
    assert RuleState.from_dict(json.loads(json.dumps(st.to_dict()))) == st
    assert st.to_dict() == {"phase": "firing", "since": T0, "last_action": T0 + 60, "actions": [T0, T0 + 60],
                            "digest": "abc123", "acted": False}  # fmt: skip
    assert RuleState.from_dict({}) == RuleState()
    assert RuleState.from_dict({"actions": ["1.5", 2]}).actions == [1.5, 2.0]


def persisted(engine: Engine) -> dict[tuple[str, str], RuleState]:
    """What a restarted control plane reads back: through JSON."""
    return {k: RuleState.from_dict(json.loads(json.dumps(s.to_dict()))) for k, s in engine.states.items()}


def test_a_rebuilt_engine_keeps_the_pending_since() -> None:
    text = rule_text("for: 30m\n")
    s = store(steps(LOST, [(0, 5)]))
    first = Sim(text, s, knobs={("pool-0", "gpu_quota"): 4})
    first.run(0, 20)
    assert first.state("r").phase == "pending" and first.state("r").since == T0
    second = Sim(text, s, knobs={("pool-0", "gpu_quota"): 4}, states=persisted(first.engine))
    second.run(21, 29)
    assert second.decisions == [] and second.transitions == []
    second.at(30)  # 30 min after the condition began, 10 min after the rebuild
    assert second.log() == [(30, "r", "pool-0", "applied", 4, 3)]
    assert [t.phase for t in second.transitions] == ["firing"]


def test_a_rebuilt_engine_keeps_cooldown_and_max_per_history() -> None:
    text = rule_text("cooldown: 10m\nmax_per: 2/1h\n")
    s = store(steps(LOST, [(0, 5)]))
    first = Sim(text, s, knobs={("pool-0", "gpu_quota"): 10})
    first.run(0, 15)
    second = Sim(text, s, knobs=first.knobs, states=persisted(first.engine))
    second.run(16, 60)
    assert next((m, o) for m, _, _, o, _, _ in second.log()) == (20, "rate_limited")
    assert [m for m, _, _, o, _, _ in second.log() if o == "applied"] == [60]


def test_a_changed_rule_definition_drops_its_old_state() -> None:
    s = store(steps(LOST, [(0, 5)]))
    first = Sim(rule_text("for: 30m\n"), s, knobs={("pool-0", "gpu_quota"): 4})
    first.run(0, 20)
    changed = Sim(rule_text("for: 40m\n"), s, knobs={("pool-0", "gpu_quota"): 4}, states=persisted(first.engine))
    assert changed.engine.states == {}
    changed.run(21, 60)
    assert changed.decisions == []
    assert changed.phases() == [(21, "r", "pool-0", "pending")]  # starts over: fires at 21 + 40
    changed.at(61)
    assert changed.log() == [(61, "r", "pool-0", "applied", 4, 3)]


def test_states_of_removed_rules_and_of_stale_digests_are_dropped() -> None:
    ps = policies(rule_text())
    digest = ps.rules[0].digest
    states = {
        ("r", "pool-0"): RuleState("pending", T0, None, [], digest),
        ("r", "pool-1"): RuleState("pending", T0, None, [], "stale"),
        ("gone", "pool-0"): RuleState("firing", T0, T0, [T0], digest),
    }
    assert set(Engine(ps, states).states) == {("r", "pool-0")}


def test_replace_policies_keeps_the_states_of_unchanged_rules() -> None:
    two = """\
    policies:
      - name: a
        when: dsec_workers_lost > 2
        for: 1h
        then: [{knob: gpu_quota, by: -1}]
      - name: b
        when: dsec_workers_lost > 2
        for: 1h
        then: [{knob: latency_cap_ms, by: -1}]
      - name: c
        when: dsec_workers_lost > 2
        for: 1h
        then: [{knob: bandwidth_cap_mbps, by: -1}]
    """
    sim = Sim(textwrap.dedent(two), store(steps(LOST, [(0, 5)])))
    sim.run(0, 20)
    kept = sim.state("a")
    assert {k[0] for k in sim.engine.states} == {"a", "b", "c"}
    edited = textwrap.dedent(two).replace("latency_cap_ms, by: -1", "latency_cap_ms, by: -2")
    edited = edited.split("  - name: c")[0]  # c removed
    sim.engine.replace_policies(policies(edited))
    assert set(sim.engine.states) == {("a", "pool-0")} and sim.state("a") is kept and kept.since == T0
    sim.run(21, 40)
    assert sim.state("b").since == T0 + 21 * MIN


# == 5. the shipped examples ================================================================================
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def example_series() -> SeriesStore:
    return SeriesStore.from_export(json.loads((EXAMPLES / "series-meltdowns.json").read_text()))


def test_all_examples_validate() -> None:
    assert [p.name for p in EXAMPLE_FILES] == [
        "idle-pool-gpu-quota.yaml",
        "meltdowns-tighten-latency-cap.yaml",
        "slow-recovery-more-compression.yaml",
    ]
    names = {p.name: [r.name for r in load_policies(p).rules] for p in EXAMPLE_FILES}
    assert names == {
        "idle-pool-gpu-quota.yaml": ["shrink-idle-pool", "regrow-busy-pool"],
        "meltdowns-tighten-latency-cap.yaml": ["tighten-latency-cap-on-meltdowns"],
        "slow-recovery-more-compression.yaml": ["compress-snapshots-on-slow-recovery"],
    }


def test_meltdowns_example_over_the_example_series() -> None:
    ps = load_policies(EXAMPLES / "meltdowns-tighten-latency-cap.yaml")
    result = replay(ps, example_series(), step_s=MIN)
    assert (result.start, result.end) == (T0, T0 + 2 * HOUR)
    (d,) = result.decisions
    assert (d.rule, d.scope.key, d.knob, d.level, d.outcome, d.old, d.new) == (
        "tighten-latency-cap-on-meltdowns", "pool-0", "latency_cap_ms", "pool", "applied", 85, 75
    )  # fmt: skip
    assert d.at == T0 + 31 * MIN
    assert d.evidence == {"when": "increase(dsec_melt_down_count[1h]) > 3", "observed": 4.0}
    assert [((t.at - T0) / MIN, t.phase) for t in result.transitions] == [
        (31, "pending"), (31, "firing"), (91, "resolved")
    ]  # fmt: skip
    # it resolves exactly when the hourly increase drops to <= 1 (the clear_when), not when it drops to <= 3
    s = example_series()
    inc = parse("increase(dsec_melt_down_count[1h])", POOL_METRICS)

    def hourly_at(minute: int) -> float:
        now = T0 + minute * MIN
        return inc.eval(lambda n: math.nan, lambda n, w: s.range((n, "pool-0", None), now, w), now)

    hourly = {m: hourly_at(m) for m in range(121)}
    assert hourly[72] == 3 and hourly[80] == 2 and hourly[90] == 2 and hourly[91] == 1
    assert min(m for m in range(32, 121) if hourly[m] <= 1) == 91
    assert result.knobs == {("pool", "pool-0", "latency_cap_ms"): 75.0}


def test_idle_pool_example_shrinks_once_after_two_hours_then_regrows() -> None:
    ps = load_policies(EXAMPLES / "idle-pool-gpu-quota.yaml")
    util = ("dsec_sandbox_utilization_rate", "pool-0", None)
    s = store(per_minute(util, [0.2] * 150 + [0.8] * 61))  # 2.5 h at 0.2, then 1 h at 0.8
    result = replay(ps, s, step_s=MIN, initial={("pool-0", "gpu_quota"): 4})
    rows = [(d.rule, (d.at - T0) / MIN, d.outcome, d.old, d.new) for d in result.decisions]
    assert rows[0] == ("shrink-idle-pool", 120, "applied", 4, 3)
    assert [r for r in rows if r[0] == "shrink-idle-pool"] == [rows[0]]  # once
    regrow = [r for r in rows if r[0] == "regrow-busy-pool"]
    # avg over 10 min is > 0.6 from +157 min; `for: 10m`, then one GPU per `cooldown: 10m`, up to max 8
    assert regrow == [
        ("regrow-busy-pool", m, "applied", n, n + 1) for m, n in ((167, 3), (177, 4), (187, 5), (197, 6), (207, 7))
    ]
    assert result.decisions[0].evidence["observed"] == pytest.approx(0.2)
    phases = [(t.rule, (t.at - T0) / MIN, t.phase) for t in result.transitions]
    assert ("shrink-idle-pool", 120, "firing") in phases and ("shrink-idle-pool", 157, "resolved") in phases
    assert result.knobs[("pool", "pool-0", "gpu_quota")] == 8


def test_idle_pool_example_holds_the_floor_of_one_gpu() -> None:
    ps = load_policies(EXAMPLES / "idle-pool-gpu-quota.yaml")
    util = ("dsec_sandbox_utilization_rate", "pool-0", None)
    s = store(per_minute(util, [0.1] * (12 * 60 + 1)))
    result = replay(ps, s, step_s=5 * MIN, initial={("pool-0", "gpu_quota"): 3})
    rows = [((d.at - T0) / HOUR, d.outcome, d.old, d.new) for d in result.decisions]
    assert rows == [(2, "applied", 3, 2), (4, "applied", 2, 1), (6, "at_bound", 1, 1), (8, "at_bound", 1, 1),
                    (10, "at_bound", 1, 1), (12, "at_bound", 1, 1)]  # fmt: skip
    assert result.knobs[("pool", "pool-0", "gpu_quota")] == 1


def test_idle_pool_example_without_a_quota_has_no_value_to_shrink() -> None:
    ps = load_policies(EXAMPLES / "idle-pool-gpu-quota.yaml")
    s = store(per_minute(("dsec_sandbox_utilization_rate", "pool-0", None), [0.1] * 121))
    result = replay(ps, s, step_s=MIN)
    assert [(d.outcome, d.detail) for d in result.decisions][:1] == [
        ("no_value", "gpu_quota has no value to adjust in pool-0")
    ]
    assert result.knobs == {}


def test_slow_recovery_example_raises_compression_to_three_then_at_bound() -> None:
    ps = load_policies(EXAMPLES / "slow-recovery-more-compression.yaml")
    s = store(per_minute(("dsec_snapshot_recovery_time", "pool-0", None), [12.0] * (13 * 60)))
    result = replay(ps, s, step_s=5 * MIN)
    rows = [((d.at - T0) / HOUR, d.outcome, d.old, d.new) for d in result.decisions]
    assert rows == [(0, "applied", 2, 3), (6, "at_bound", 3, 3), (12, "at_bound", 3, 3)]
    assert result.decisions[0].evidence["observed"] == 12.0
    assert result.knobs == {("pool", "pool-0", "snapshot_compression_level"): 3.0}
    fast = store(per_minute(("dsec_snapshot_recovery_time", "pool-0", None), [8.0] * 60))
    assert replay(ps, fast, step_s=MIN).decisions == []  # > 8, not >= 8


def test_replay_arguments() -> None:
    ps = policies(rule_text())
    with pytest.raises(ValueError, match="the series file holds no samples"):
        replay(ps, SeriesStore())
    with pytest.raises(ValueError, match=r"step 0 is invalid: expected > 0 seconds"):
        replay(ps, store(steps(LOST, [(0, 5)])), step_s=0)
    s = store(steps(LOST, [(0, 0), (30, 5)]))
    r = replay(ps, s, step_s=MIN, start=T0 + 10 * MIN, end=T0 + 40 * MIN, initial={("pool-0", "gpu_quota"): 4})
    assert (r.start, r.end) == (T0 + 10 * MIN, T0 + 40 * MIN)
    assert [((d.at - T0) / MIN, d.new) for d in r.decisions] == [(30, 3)]


# == 6. the series store ====================================================================================
def test_retention_drops_old_points() -> None:
    s = SeriesStore(retention_s=600)
    s.add_series(LOST, [(T0 + m * MIN, float(m)) for m in range(31)])
    now = T0 + 30 * MIN
    assert [v for _, v in s.range(LOST, now, HOUR)] == [float(m) for m in range(20, 31)]
    assert math.isnan(s.instant(LOST, T0 + 5 * MIN))  # before the oldest kept point
    assert s.span() == (T0 + 20 * MIN, now)


def test_max_points_bounds_each_series() -> None:
    s = SeriesStore(retention_s=1e9, max_points=5)
    s.add_series(LOST, [(T0 + m, float(m)) for m in range(10)])
    assert [v for _, v in s.range(LOST, T0 + 100, 1e9)] == [5.0, 6.0, 7.0, 8.0, 9.0]


def test_out_of_order_samples_are_ignored() -> None:
    s = SeriesStore(retention_s=1e9)
    s.add(T0 + 60, {LOST: 1.0})
    s.add(T0, {LOST: 5.0})
    s.add(T0 + 120, {LOST: 2.0, COUNTER: 7.0})
    assert s.range(LOST, T0 + 120, HOUR) == [(T0 + 60, 1.0), (T0 + 120, 2.0)]
    assert s.instant(LOST, T0 + 30) != 5.0
    assert s.range(COUNTER, T0 + 120, HOUR) == [(T0 + 120, 7.0)]
    unsorted = SeriesStore(retention_s=1e9)
    unsorted.add_series(LOST, [(T0 + 60, 1.0), (T0, 5.0)])  # add_series sorts its points first
    assert unsorted.range(LOST, T0 + 60, HOUR) == [(T0, 5.0), (T0 + 60, 1.0)]


def test_range_is_inclusive_at_both_ends_and_empty_for_unknown_keys() -> None:
    s = store(steps(LOST, [(0, 1), (1, 2), (2, 3)]))
    assert s.range(LOST, T0 + 2 * MIN, 2 * MIN) == [(T0, 1.0), (T0 + MIN, 2.0), (T0 + 2 * MIN, 3.0)]
    assert s.range(LOST, T0 + 2 * MIN, 59) == [(T0 + 2 * MIN, 3.0)]
    assert s.range(COUNTER, T0, HOUR) == [] and math.isnan(s.instant(COUNTER, T0))
    assert SeriesStore().span() is None


def test_export_and_from_export_round_trip() -> None:
    s = store(
        steps(LOST, [(0, 1), (1, math.nan), (2, 3)]),
        steps(("dsec_breaker_level", "pool-0", "w1"), [(0, 2)]),
        steps(("dsec_breaker_level", "pool-0", "w0"), [(0, 1)]),
        steps(("dsec_workers_lost", "a-pool", None), [(0, 0)]),
    )
    data = s.export()
    assert data["format"] == 1
    assert [(x["metric"], x["labels"]) for x in data["series"]] == [
        ("dsec_breaker_level", {"pool": "pool-0", "worker": "w0"}),
        ("dsec_breaker_level", {"pool": "pool-0", "worker": "w1"}),
        ("dsec_workers_lost", {"pool": "a-pool"}),
        ("dsec_workers_lost", {"pool": "pool-0"}),
    ]
    assert data["series"][3]["samples"] == [[T0, 1.0], [T0 + MIN, None], [T0 + 2 * MIN, 3.0]]
    text = json.dumps(data, allow_nan=False)  # strict JSON: NaN became null
    back = SeriesStore.from_export(json.loads(text))
    assert back.export() == data
    assert back.series_keys() == s.series_keys()
    assert math.isnan(back.instant(LOST, T0 + MIN)) and back.instant(LOST, T0 + 2 * MIN) == 3.0
    assert back.range(("dsec_breaker_level", "pool-0", "w1"), T0, 0) == [(T0, 2.0)]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], 'a series file is a JSON object {"series": [{"metric", "labels", "samples"}, ...]}'),
        ({}, 'a series file is a JSON object {"series": [{"metric", "labels", "samples"}, ...]}'),
        ({"series": {}}, 'a series file is a JSON object {"series": [{"metric", "labels", "samples"}, ...]}'),
        (
            {"series": [{"metric": "m", "labels": {"pool": "p"}, "samples": []}, {"metric": "m", "samples": []}]},
            "series[1]: expected metric, labels.pool and samples [[t, v], ...] ('pool')",
        ),
        (
            {"series": [{"labels": {"pool": "p"}, "samples": []}]},
            "series[0]: expected metric, labels.pool and samples [[t, v], ...] ('metric')",
        ),
        (
            {"series": [{"metric": "m", "labels": {"pool": "p"}}]},
            "series[0]: expected metric, labels.pool and samples [[t, v], ...] ('samples')",
        ),
        (
            {"series": [{"metric": "m", "labels": {"pool": "p"}, "samples": [[1]]}]},
            "series[0]: expected metric, labels.pool and samples [[t, v], ...] "
            "(not enough values to unpack (expected 2, got 1))",
        ),
        (
            {"series": [{"metric": "m", "labels": {"pool": "p"}, "samples": [[1, "a"]]}]},
            "series[0]: expected metric, labels.pool and samples [[t, v], ...] "
            "(could not convert string to float: 'a')",
        ),
        (
            {"series": [{"metric": "m", "labels": {"pool": "p"}, "samples": 5}]},
            "series[0]: expected metric, labels.pool and samples [[t, v], ...] ('int' object is not iterable)",
        ),
    ],
)
def test_from_export_errors_name_the_bad_series(data: object, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        SeriesStore.from_export(data)  # type: ignore[arg-type]
    assert str(exc.value) == message


def test_from_export_rejects_a_non_object_series_entry_with_its_index() -> None:
    with pytest.raises(ValueError, match=r"^series\[1\]: "):
        SeriesStore.from_export({"series": [{"metric": "m", "labels": {"pool": "p"}, "samples": []}, "oops"]})
