"""Worker metrics carry their age: a name not sent for more than ``max_age`` of the worker's beats is gone."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.control.state import AgedMetrics, LiveWorker
from dsec.control.store import WorkerRow
from dsec.model import Directive, DirectiveFields

MAX_AGE = 3


def _row(beats: int, metrics: dict[str, float]) -> WorkerRow:
    info = {"pool": "p", "role": "actor", "group": "g", "rank": 0, "host": "h", "pid": 1, "device": None,
            "heartbeat_interval_s": 5.0}  # fmt: skip
    return WorkerRow("w-1", "p", info, "active", "x" * 64, 0.0, 1.0, beats, 0, beats, metrics)


def _worker(beats: int = 0, metrics: dict[str, float] | None = None) -> LiveWorker:
    return LiveWorker.from_row(_row(beats, metrics or {}), Directive("w-1", 1, DirectiveFields(), 0.0))


def _beat(w: LiveWorker, metrics: dict[str, float]) -> None:
    """What the control plane does with a beat's metrics (service._merged_metrics, then the swap)."""
    w.metrics = w.merged_metrics(metrics, MAX_AGE)
    w.beats += 1


def test_a_name_sent_once_is_gone_after_max_age_plus_one_beats_without_it() -> None:
    w = _worker()
    _beat(w, {"memory_used_gb": 3.0, "updates_total": 1.0})
    for i in range(MAX_AGE):
        _beat(w, {"updates_total": 2.0 + i})
        assert w.metrics["memory_used_gb"] == 3.0, f"still fresh {i + 1} beat(s) later"
    _beat(w, {"updates_total": 9.0})
    assert "memory_used_gb" not in w.metrics and w.metrics.get("memory_used_gb") is None
    assert dict(w.metrics) == {"updates_total": 9.0} and len(w.metrics) == 1
    assert w.row().metrics == {"updates_total": 9.0}, "what is flushed to the store is the fresh view"


def test_a_name_sent_again_stays_and_empty_beats_age_too() -> None:
    w = _worker()
    for beat in range(10):
        _beat(w, {"memory_used_gb": float(beat)} if beat % MAX_AGE == 0 else {})
        assert "memory_used_gb" in w.metrics
    assert isinstance(w.metrics, AgedMetrics) and w.metrics.last_beat("memory_used_gb") == 10
    for _ in range(MAX_AGE + 1):
        _beat(w, {})
    assert dict(w.metrics) == {}


def test_metrics_loaded_from_the_store_count_as_sent_in_the_last_beat() -> None:
    w = _worker(beats=40, metrics={"memory_used_gb": 5.0})
    assert w.metrics == {"memory_used_gb": 5.0}
    for _ in range(MAX_AGE):
        _beat(w, {"x": 1.0})
    assert w.metrics["memory_used_gb"] == 5.0
    _beat(w, {"x": 1.0})
    assert dict(w.metrics) == {"x": 1.0}


def test_the_view_reads_like_the_dict_it_replaced() -> None:
    m = AgedMetrics().merged({"a": 1.0, "b": 2.5}, beat=1, max_age=MAX_AGE)
    assert m == {"a": 1.0, "b": 2.5} and m.keys() - {"a"} == {"b"} and bool(m)
    assert json.loads(json.dumps(_worker().to_api()["metrics"])) == {}
    old = m
    m.merged({"a": 7.0}, beat=2, max_age=MAX_AGE)
    assert old == {"a": 1.0, "b": 2.5}, "merging builds a new view: the writer thread may be copying the old one"


def test_the_plain_dict_a_decision_view_shares_is_never_changed_by_later_beats() -> None:
    # Decision views read as_dict() (control/views.py) and may be read on the judgments' thread while beats go on:
    # neither branch of merged (every name sent again, or some aged out) may touch a dict handed out before.
    m = AgedMetrics().merged({"a": 1.0, "b": 2.0}, beat=1, max_age=1)
    shared = m.as_dict()
    full = m.merged({"a": 3.0, "b": 4.0}, beat=2, max_age=1)  # the common branch: dict copy + update
    partial = full.merged({"a": 5.0}, beat=4, max_age=1)  # the general branch: "b" aged out
    assert shared == {"a": 1.0, "b": 2.0}
    assert full.as_dict() == {"a": 3.0, "b": 4.0} and partial.as_dict() == {"a": 5.0}
    assert full.as_dict() is not shared and partial.as_dict() is not full.as_dict()
    assert dict(m) == shared  # the same names and values the Mapping reads


@settings(max_examples=300, deadline=None)
@given(
    beats=st.lists(st.dictionaries(st.sampled_from("abcdef"), st.floats(-10, 10), max_size=6), max_size=30),
    max_age=st.integers(0, 4),
)
def test_merged_holds_what_the_general_rule_holds_in_the_same_order(
    beats: list[dict[str, float]], max_age: int
) -> None:
    """``merged`` takes a shortcut when a beat sends every name held again; the names, values, beats seen and their
    order are those of the general rule (fresh names kept in their order, the beat's names updated or appended)."""
    m, values, seen = AgedMetrics(), {}, {}  # type: ignore[var-annotated]
    for beat, new in enumerate(beats, start=1):
        m = m.merged(new, beat=beat, max_age=max_age)
        seen = {k: b for k, b in seen.items() if b >= beat - max_age}
        values = {k: values[k] for k in seen}
        values.update(new)
        seen.update(dict.fromkeys(new, beat))
        assert list(m.items()) == list(values.items())
        assert [(k, m.last_beat(k)) for k in m] == list(seen.items())
        assert m._oldest == min(seen.values(), default=None)  # what the shortcut's "none aged" test reads
