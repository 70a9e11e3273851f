"""The plain-beat check (``schemas.plain_beat``): a batch item it accepts is one ``HeartbeatRequest`` validates to the
same values; anything else it leaves to validation (which names the field in its 422)."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dsec.control.schemas import MAX_METRICS, HeartbeatRequest, PlainBeat, plain_beat

NAMES = st.one_of(
    st.sampled_from(["memory_used_gb", "sync_ops_total", "sync_ok_total", "step_ms_mean", "_x", "a" * 100]),
    st.sampled_from(["a" * 101, "9lives", "bad-name", "", "ünï", "x\n"]),  # invalid metric names
    st.text(max_size=8),
)
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-1e3, 1e3),
    st.integers(-5, 5),
    st.sampled_from([True, False, None, "1.5", 2.0**53, 2.0**53 + 2, -0.0, 1e300]),
)
INTS = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([2**31, 2**31 + 1, 2**62, 2**62 + 1, 2**63]),
    st.sampled_from([True, False, None, 1.0, 3.5, "4"]),
)
BODIES = st.fixed_dictionaries(
    {},
    optional={
        "seq": INTS,
        "acked_directive_version": INTS,
        "metrics": st.one_of(st.dictionaries(NAMES, VALUES, max_size=6), st.sampled_from([None, [], "m", {}])),
        "events": st.sampled_from([[], None, {}, "", [{"type": "log", "data": {}}]]),
        "inferred_role": st.sampled_from([None, {"role": "actor", "evidence": {}}]),
        "extra": st.just(1),
    },
)


def _validated(body: dict[str, Any]) -> HeartbeatRequest | None:
    try:
        return HeartbeatRequest.model_validate(body)
    except ValidationError:
        return None


@settings(max_examples=1500, deadline=None)
@given(body=BODIES)
def test_a_plain_beat_is_what_validation_makes_of_it(body: dict[str, Any]) -> None:
    before = repr(body)
    plain = plain_beat(body)
    assert repr(body) == before  # the body is read, never changed
    if plain is None:
        return
    validated = _validated(body)
    assert validated is not None, f"plain_beat accepted what validation refuses: {body!r}"
    assert (plain.seq, plain.acked_directive_version, plain.metrics) == (
        validated.seq,
        validated.acked_directive_version,
        validated.metrics,
    )
    assert [type(v) for v in plain.metrics.values()] == [type(v) for v in validated.metrics.values()]
    assert plain.events == () and not validated.events
    assert plain.inferred_role is None and validated.inferred_role is None


def test_the_common_beat_is_plain_and_the_rest_goes_to_validation() -> None:
    body = {
        "seq": 7,
        "acked_directive_version": 2,
        "metrics": {"step_ms_mean": 12.5, "memory_used_gb": 3.0},
        "events": [],
    }
    assert plain_beat(body) == PlainBeat(7, 2, {"step_ms_mean": 12.5, "memory_used_gb": 3.0})
    assert plain_beat({"seq": 1}) == PlainBeat(1, 0, {})
    refused = [
        {**body, "events": [{"type": "log"}]},  # events: validated (types, data budgets)
        {**body, "inferred_role": {"role": "actor"}},
        {**body, "metrics": {"step_ms_mean": 1}},  # an integer: validation decides what a number is
        {**body, "metrics": {"memory_used_gb": 1e6}},  # a gauge input out of range
        {**body, "metrics": {"sync_ops_total": 1.0, "sync_ok_total": 2.0}},
        {**body, "metrics": {"bad-name": 1.0}},
        {**body, "metrics": {f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}},
        {**body, "metrics": {"x": math.nan}},
        {**body, "seq": 0},
        {**body, "seq": True},
        {**body, "acked_directive_version": 2**31 + 1},
        {**body, "worker_id": "w-1"},  # only the beat's own fields
    ]
    assert [plain_beat(b) for b in refused] == [None] * len(refused)
    assert _validated(refused[0]) is not None  # refused here is not refused there: validation decides
    assert plain_beat({**body, "metrics": {f"m{i}": 1.0 for i in range(MAX_METRICS)}}) is not None
