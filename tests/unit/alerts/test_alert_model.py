"""The Alert value: validation naming the field, read-only mappings, key and wire form."""

from __future__ import annotations

import pytest

from dsec.alerts import Alert, Severity
from dsec.model import ModelError


def test_alert_defaults_key_and_roundtrip() -> None:
    a = Alert(
        "episode_stuck",
        "critical",  # type: ignore[arg-type]  # strings are accepted and converted
        ts=12.5,
        pool="pool-a",
        worker_id="w-1",
        summary="env reset 3x",
        labels={"env": "cartpole"},
        data={"resets": 3},
    )
    assert a.severity is Severity.CRITICAL
    assert a.key == ("episode_stuck", "pool-a", "w-1")
    assert a.to_dict() == {
        "name": "episode_stuck",
        "severity": "critical",
        "ts": 12.5,
        "pool": "pool-a",
        "worker_id": "w-1",
        "summary": "env reset 3x",
        "labels": {"env": "cartpole"},
        "data": {"resets": 3},
    }
    assert Alert.from_dict(a.to_dict()) == a
    assert hash(Alert.from_dict(a.to_dict())) == hash(a)


def test_alert_mappings_are_copied_and_read_only() -> None:
    labels = {"env": "cartpole"}
    a = Alert("x", labels=labels)
    labels["env"] = "changed"
    assert a.labels["env"] == "cartpole"
    with pytest.raises(TypeError):
        a.labels["env"] = "nope"  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "name=''"),
        ({"name": "x", "severity": "page"}, "severity='page' is invalid: expected one of"),
        ({"name": "x", "ts": float("nan")}, "ts=nan"),
        ({"name": "x", "pool": ""}, "pool=''"),
        ({"name": "x", "worker_id": 7}, "worker_id=7"),
        ({"name": "x", "labels": {"n": 1}}, "labels\\['n'\\]=1"),
        ({"name": "x", "data": [1]}, "data=\\[1\\]"),
    ],
)
def test_alert_validation_names_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ModelError, match=message):
        Alert(**kwargs)  # type: ignore[arg-type]


def test_severity_rank_orders_them() -> None:
    assert Severity.INFO.rank < Severity.WARNING.rank < Severity.CRITICAL.rank
