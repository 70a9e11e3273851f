"""Every anomaly the probe's telemetry raises reaches the control plane as an ``anomaly`` event — and never raises in
the training thread. A failed collective used to raise KeyError('kind') from the probe's own hook, hiding the
collective's error (a healing Diverged, a gloo timeout) behind one of DSec's."""

from __future__ import annotations

from typing import Any

import pytest

from dsec.probe.runtime import Probe


@pytest.fixture
def probe(offline_probe: Probe) -> Probe:
    return offline_probe


def test_each_failure_the_telemetry_sees_is_one_anomaly_event(probe: Probe, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, dict[str, Any]]] = []

    def capture(kind: str, /, urgent: bool = False, **data: Any) -> None:  # Probe.event's signature
        events.append((kind, data))

    monkeypatch.setattr(probe, "event", capture)
    t = probe.telemetry
    t.record_collective("all_gather", 64, 0.5, ok=False)
    t.record_sync(1024, 0.1, ok=False)
    t.record_update(0.01, float("nan"))
    assert events == [
        ("anomaly", {"kind": "collective_error", "op": "all_gather"}),
        ("anomaly", {"kind": "sync_error", "bytes": 1024}),
        ("anomaly", {"kind": "non_finite_gradient", "grad_norm": "nan"}),
    ]


def test_an_anomaly_whose_data_names_a_kind_keeps_the_anomalys_kind(
    probe: Probe, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[dict[str, Any]] = []

    def capture(kind: str, /, urgent: bool = False, **data: Any) -> None:
        events.append(data)

    monkeypatch.setattr(probe, "event", capture)
    probe._anomaly("replica_drift", {"kind": "something else", "step": 3})
    assert events == [{"kind": "replica_drift", "step": 3}]
