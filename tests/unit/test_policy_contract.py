"""Exact contracts of the policy language and engine: audit payloads, bounds at their edges, error texts with the
offset they point at — each found by mutation testing (docs/testing.md), each failing on a mutant that survived
tests/unit/test_policy_engine.py."""

from __future__ import annotations

import math

import pytest

from dsec.policy.engine import Decision, RuleState, Scope, Transition
from dsec.policy.expr import MAX_NESTING, MAX_TOKENS, ExprError, parse, parse_duration

M = ["x", "y"]


def nothing(_: str) -> float:
    return math.nan


def test_a_decision_event_carries_every_field_of_the_audit() -> None:
    d = Decision("r", Scope("p", "w1"), "latency_cap_ms", "worker", 50.0, 60.0, "dry_run", 9.0, {"x": 1.0}, "why")
    assert d.to_event() == {
        "rule": "r",
        "scope": "p/w1",
        "knob": "latency_cap_ms",
        "level": "worker",
        "old": 50.0,
        "new": 60.0,
        "outcome": "dry_run",
        "dry_run": True,
        "evidence": {"x": 1.0},
        "detail": "why",
    }
    plain = Decision("r", Scope("p"), "k", "pool", None, 1.0, "applied", 9.0, {})
    assert "detail" not in plain.to_event() and plain.to_event()["scope"] == "p"
    assert plain.to_event()["dry_run"] is False


def test_a_transition_event_reports_an_unknown_value_as_null() -> None:
    t = Transition("r", Scope("p"), "pending", 3.0, math.nan, RuleState())
    assert t.to_event()["value"] is None
    assert Transition("r", Scope("p"), "firing", 3.0, 2.5, RuleState()).to_event()["value"] == 2.5


def test_a_rule_state_restored_without_an_acted_flag_has_not_acted() -> None:
    assert RuleState.from_dict({"phase": "firing"}).acted is False
    assert RuleState.from_dict({"phase": "firing", "acted": 1}).acted is True
    state = RuleState("firing", 1.0, 2.0, [2.0], "d", True)
    assert RuleState.from_dict(state.to_dict()) == state


# -- bounds ---------------------------------------------------------------------------------------------------------
def test_nesting_is_allowed_up_to_the_bound_and_refused_one_past_it_at_the_offending_paren() -> None:
    deepest = "(" * MAX_NESTING + "x" + ")" * MAX_NESTING
    assert parse(deepest, M).metrics == {"x"}
    with pytest.raises(ExprError) as e:
        parse("(" * (MAX_NESTING + 1) + "x" + ")" * (MAX_NESTING + 1), M)
    assert e.value.message == f"nested deeper than {MAX_NESTING} levels" and e.value.offset == MAX_NESTING


def test_nesting_counts_depth_not_how_many_groups_or_negations_there_are() -> None:
    # many groups side by side, each shallow: depth comes back down after each
    wide = " + ".join(["(x)"] * 40)
    assert parse(wide, M).metrics == {"x"}
    negations = " + ".join(["-x"] * 40)
    assert parse(negations, M).metrics == {"x"}
    # negations nest like parentheses
    deepest = "-" * MAX_NESTING + "x"
    assert parse(deepest, M).metrics == {"x"}
    with pytest.raises(ExprError) as e:
        parse("-" * (MAX_NESTING + 1) + "x", M)
    assert e.value.offset == MAX_NESTING and "nested deeper" in e.value.message
    mixed = "-(" * (MAX_NESTING // 2) + "x" + ")" * (MAX_NESTING // 2)
    assert parse(mixed, M).metrics == {"x"}


def test_an_expression_of_exactly_the_token_bound_parses_and_one_more_is_refused_where_it_starts() -> None:
    # "x + x + ... + x": 2n - 1 tokens plus the end token
    n = MAX_TOKENS // 2
    text = " + ".join(["x"] * n)  # 2n - 1 = MAX_TOKENS - 1 tokens + end = MAX_TOKENS
    assert parse(text, M).metrics == {"x"}
    longer = text + " + x"
    with pytest.raises(ExprError) as e:
        parse(longer, M)
    assert e.value.message == f"expression too long: more than {MAX_TOKENS} tokens"
    assert e.value.offset == len(text) + 3  # the 'x' after it: token number MAX_TOKENS (0-based)


# -- errors name what and where ---------------------------------------------------------------------------------------
def test_parse_errors_say_what_was_expected_and_point_at_it() -> None:
    with pytest.raises(ExprError) as e:
        parse("increase(x[5m) > 1", M)
    assert (e.value.message, e.value.offset) == ("expected ']', found ')'", 13)
    with pytest.raises(ExprError) as e:
        parse("increase(x[y])", M)
    assert e.value.message == "expected a duration such as 5m or 1h, found 'y'" and e.value.offset == 11


def test_keywords_are_not_metrics() -> None:
    for word in ("and", "or", "not"):
        with pytest.raises(ExprError) as e:
            parse(f"{word} > 1" if word != "not" else "not", [*M, word])
        assert "found" in e.value.message


def test_a_misspelt_metric_gets_up_to_three_close_suggestions() -> None:
    names = ["sync_ms_a", "sync_ms_b", "sync_ms_c", "sync_ms_d", "other"]
    with pytest.raises(ExprError) as e:
        parse("sync_ms_x > 1", names)
    assert e.value.message.count("sync_ms_") == 4  # the name itself and three suggestions
    with pytest.raises(ExprError) as e:
        parse("sync_mx_q > 1", ["sync_ms_a"])  # 0.78 similar: suggested at the 0.6 cutoff
    assert "sync_ms_a" in e.value.message


def test_parsed_nodes_keep_their_offsets_and_metrics_under_negation() -> None:
    assert parse("-x > 1", M).metrics == {"x"}
    assert parse("not (y > 1)", M).metrics == {"y"}
    with pytest.raises(ExprError) as e:
        parse("increase(x[0s]) > 1", M)
    assert e.value.offset >= 0


def test_a_comparison_is_strict_where_it_says_so_and_ranges_work_on_both_sides() -> None:
    def inst(name: str) -> float:
        return {"x": 2.0, "y": 2.0}[name]

    assert parse("x < y", M).eval(inst, lambda m, w: [], 0.0) == 0.0
    assert parse("x <= y", M).eval(inst, lambda m, w: [], 0.0) == 1.0
    samples = [(0.0, 1.0), (60.0, 4.0)]
    right = parse("1 < increase(x[5m])", M)
    assert right.eval(inst, lambda m, w: samples, 60.0) == 1.0
    assert right.window_s == 300.0


def test_durations_and_token_edges() -> None:
    assert parse_duration(" 1h30m ") == 5400.0
    with pytest.raises(ValueError):
        parse_duration("   ")
    with pytest.raises(ExprError) as e:
        parse("5q > 1", M)
    assert e.value.message == "'5q' is neither a number nor a duration (e.g. 30s, 5m, 1h)" and e.value.offset == 0
    with pytest.raises(ExprError) as e:
        parse("x > Q$", M)
    assert e.value.offset == 5 and e.value.message == "unexpected character '$'"
    assert parse("X_1 > 1", ["X_1"]).metrics == {"X_1"}


def test_depth_comes_back_exactly_after_a_group_or_a_negation() -> None:
    # A closed group or negation leaves the depth where it was: the next sibling may nest exactly MAX_NESTING deep,
    # and one more level is refused at that level's own offset.
    for first in ("(x)", "-x", "((x))"):
        prefix = f"{first} + "
        assert parse(prefix + "(" * MAX_NESTING + "x" + ")" * MAX_NESTING, M).metrics == {"x"}
        with pytest.raises(ExprError) as e:
            parse(prefix + "(" * (MAX_NESTING + 1) + "x" + ")" * (MAX_NESTING + 1), M)
        assert e.value.offset == len(prefix) + MAX_NESTING
        with pytest.raises(ExprError) as e:
            parse(prefix + "-" * (MAX_NESTING + 1) + "x", M)
        assert e.value.offset == len(prefix) + MAX_NESTING


def test_the_shortest_window_is_one_second_and_a_bad_word_is_quoted_whole() -> None:
    assert parse("increase(x[1s]) > 0", M).window_s == 1.0
    with pytest.raises(ExprError) as e:
        parse("x > 5Qz", M)
    assert e.value.message.startswith("'5Qz' is neither a number nor a duration") and e.value.offset == 4


# -- the engine's acting (a rule firing on a constant condition) ------------------------------------------------------
def _engine_run(rule_yaml: str, knobs: dict[str, float], times: list[float]) -> list[list[Decision]]:
    import textwrap

    from dsec.policy import Engine, SeriesStore, compile_policies

    ps = compile_policies(textwrap.dedent(rule_yaml), "p.yaml")
    series = SeriesStore(retention_s=1e9)
    series.add_series(("dsec_workers_lost", "pool-0", None), [(0.0, 5.0)])
    engine = Engine(ps)
    values = dict(knobs)
    out = []
    for now in times:
        ds, _ = engine.evaluate(now, [Scope("pool-0")], series, lambda s, k: values.get(k.name), lambda p: False)
        for d in ds:
            if d.changes and d.new is not None:
                values[d.knob] = d.new
        out.append(ds)
    return out


RULE_YAML = """\
policies:
  - name: r
    when: dsec_workers_lost > 2
    then: [{knob: latency_cap_ms, by: 5}]
"""


def test_an_applied_change_carries_no_detail_and_adds_to_zero_as_zero() -> None:
    (first,) = _engine_run(RULE_YAML, {"latency_cap_ms": 0.0}, [100.0])
    (d,) = first
    assert d.outcome == "applied" and (d.old, d.new) == (0.0, 5.0)
    assert "detail" not in d.to_event()


def test_a_one_second_cooldown_lets_a_still_true_rule_act_again_after_it() -> None:
    rule = RULE_YAML + "    cooldown: 1s\n"
    runs = _engine_run(rule, {"latency_cap_ms": 50.0}, [100.0, 100.5, 101.0])
    assert [[d.outcome for d in ds] for ds in runs] == [["applied"], [], ["applied"]]


def test_dry_run_changes_count_toward_the_rate_limit() -> None:
    rule = RULE_YAML + "    cooldown: 1s\n    max_per: 1/1h\n    dry_run: true\n"
    runs = _engine_run(rule, {"latency_cap_ms": 50.0}, [100.0, 101.0])
    assert [[d.outcome for d in ds] for ds in runs] == [["dry_run"], ["rate_limited"]]
