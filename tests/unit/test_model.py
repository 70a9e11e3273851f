"""Domain model validation: every ModelError names the field, the bad value and what is accepted."""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError
from typing import Any

import pytest

from dsec.model import (
    MAX_MEMORY_GB,
    WORKER_EVENT_TYPES,
    Device,
    DeviceHealth,
    Directive,
    DirectiveFields,
    Event,
    EventType,
    ModelError,
    Pool,
    PoolThresholds,
    WorkerInfo,
)


def assert_names(exc: pytest.ExceptionInfo[ModelError], field: str) -> None:
    msg = str(exc.value)
    assert msg.startswith(f"{field}="), msg
    assert "is invalid: expected" in msg, msg


def test_model_error_is_a_value_error() -> None:
    assert issubclass(ModelError, ValueError)


# -- pools ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": ""}, "name"),
        ({"memory_base_gb": -1.0}, "memory_base_gb"),
        ({"memory_base_gb": math.nan}, "memory_base_gb"),
        ({"memory_base_gb": math.inf, "memory_ceiling_gb": math.inf}, "memory_base_gb"),
        ({"memory_base_gb": MAX_MEMORY_GB + 1, "memory_ceiling_gb": MAX_MEMORY_GB + 1}, "memory_base_gb"),
        ({"memory_ceiling_gb": -0.5}, "memory_ceiling_gb"),
        ({"memory_base_gb": 10.0, "memory_ceiling_gb": 5.0}, "memory_ceiling_gb"),
        ({"snapshot_interval_s": 0.0}, "snapshot_interval_s"),
        ({"snapshot_interval_s": -1.0}, "snapshot_interval_s"),
        ({"snapshot_compression_level": 4}, "snapshot_compression_level"),
    ],
)
def test_pool_validation_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    kwargs = {"name": "pool-a", **kwargs}
    with pytest.raises(ModelError) as exc:
        Pool(**kwargs)
    assert_names(exc, field)


def test_pool_ceiling_message_shows_the_base() -> None:
    with pytest.raises(ModelError, match=r"memory_ceiling_gb=5\.0 is invalid: expected >= memory_base_gb \(10\)"):
        Pool("p", memory_base_gb=10.0, memory_ceiling_gb=5.0)


def test_pool_bounds_are_inclusive() -> None:
    Pool("p", memory_base_gb=0.0, memory_ceiling_gb=0.0)
    Pool("p", memory_base_gb=MAX_MEMORY_GB, memory_ceiling_gb=MAX_MEMORY_GB)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"bandwidth_cap_mbps": 0.0}, "bandwidth_cap_mbps"),
        ({"bandwidth_cap_mbps": -1.0}, "bandwidth_cap_mbps"),
        ({"bandwidth_cap_mbps": math.nan}, "bandwidth_cap_mbps"),
        ({"latency_cap_ms": 0.0}, "latency_cap_ms"),
    ],
)
def test_thresholds_validation_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelError) as exc:
        PoolThresholds(**kwargs)
    assert_names(exc, field)


def test_pool_round_trips_through_dict() -> None:
    p = Pool(
        "pool-a",
        devices=("gpu0", "gpu1"),
        thresholds=PoolThresholds(64.0, 40.0),
        memory_base_gb=2.0,
        memory_ceiling_gb=3.5,
        snapshot_interval_s=30.0,
        memory_pressure=0.9,
        compression_bits=8,
    )
    d = p.to_dict()
    assert d["devices"] == ["gpu0", "gpu1"] and d["thresholds"] == {"bandwidth_cap_mbps": 64.0, "latency_cap_ms": 40.0}
    assert Pool.from_dict(d) == p
    assert Pool.from_dict({"name": "bare"}) == Pool("bare")


def test_pool_from_dict_validates() -> None:
    with pytest.raises(ModelError) as exc:
        Pool.from_dict({"name": "p", "memory_base_gb": -3})
    assert_names(exc, "memory_base_gb")
    with pytest.raises(ModelError) as exc:
        Pool.from_dict({"name": "p", "thresholds": {"latency_cap_ms": 0}})
    assert_names(exc, "latency_cap_ms")
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ModelError) as exc:
            Pool.from_dict({"name": "p", "memory_pressure": bad})
        assert_names(exc, "memory_pressure")
    for bits in (4, 7):
        with pytest.raises(ModelError) as exc:
            Pool.from_dict({"name": "p", "compression_bits": bits})
        assert_names(exc, "compression_bits")


def test_pool_is_frozen() -> None:
    with pytest.raises(FrozenInstanceError):
        Pool("p").name = "q"  # type: ignore[misc]


# -- devices ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"id": ""}, "id"), ({"memory_gb": -1.0}, "memory_gb"), ({"memory_gb": math.inf}, "memory_gb")],
)
def test_device_validation_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelError) as exc:
        Device(**{"id": "gpu0", "node": "n0", **kwargs})
    assert_names(exc, field)


def test_device_round_trips_through_dict() -> None:
    d = Device(
        "gpu0",
        "n0",
        model="H200",
        memory_gb=141.0,
        numa_node=1,
        nvlink_peers=("gpu1",),
        health=DeviceHealth.PROBATION,
        pool="pool-a",
    )
    assert Device.from_dict(d.to_dict()) == d
    assert d.to_dict()["health"] == "probation"
    assert Device.from_dict({"id": "x", "node": "n"}) == Device("x", "n")
    with pytest.raises(ValueError, match="broken"):
        Device.from_dict({"id": "x", "node": "n", "health": "broken"})


# -- directives -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"compression_bits": 3}, "compression_bits"),
        ({"compression_bits": 0}, "compression_bits"),
        ({"compression_bits": True}, "compression_bits"),
        ({"compression_bits": "8"}, "compression_bits"),
        ({"compression_bits": 8.0}, "compression_bits"),
        ({"grad_accum_steps": 0}, "grad_accum_steps"),
        ({"grad_accum_steps": 1025}, "grad_accum_steps"),
        ({"precision": "fp8"}, "precision"),
        ({"precision": "FP32"}, "precision"),
        ({"sync_priority": 11}, "sync_priority"),
        ({"sync_priority": -11}, "sync_priority"),
        ({"memory_quota_gb": -1.0}, "memory_quota_gb"),
        ({"memory_quota_gb": math.nan}, "memory_quota_gb"),
        ({"memory_ceiling_gb": MAX_MEMORY_GB * 2}, "memory_ceiling_gb"),
        ({"memory_quota_gb": 8.0, "memory_ceiling_gb": 4.0}, "memory_ceiling_gb"),
        ({"snapshot_interval_s": 0.5}, "snapshot_interval_s"),
        ({"snapshot_interval_s": 86401.0}, "snapshot_interval_s"),
        ({"snapshot_compression_level": True}, "snapshot_compression_level"),
        ({"snapshot_interval_s": math.inf}, "snapshot_interval_s"),
        ({"snapshot_interval_s": math.nan}, "snapshot_interval_s"),
    ],
)
def test_directive_validation_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelError) as exc:
        DirectiveFields(**kwargs)
    assert_names(exc, field)


def test_directive_messages_list_what_is_accepted() -> None:
    with pytest.raises(ModelError, match=r"expected one of \[32, 16, 8, 4\]"):
        DirectiveFields(compression_bits=3)
    with pytest.raises(ModelError, match=r"expected one of \['fp32', 'bf16', 'fp16'\]"):
        DirectiveFields(precision="fp8")


def test_compression_bits_null_is_the_default_and_32_stays_32_through_dicts() -> None:
    for bits in (None, 32, 8):
        d = DirectiveFields(compression_bits=bits)
        assert DirectiveFields.from_dict(d.to_dict()).compression_bits == bits
    assert DirectiveFields(compression_bits=8).merged({"compression_bits": None}).compression_bits is None


def test_directive_defaults_and_optional_fields() -> None:
    d = DirectiveFields()
    assert (d.compression_bits, d.grad_accum_steps, d.async_sampling, d.precision, d.sync_priority) == (
        None,  # the probe's configured default
        1,
        True,
        "fp32",
        0,
    )
    assert d.memory_quota_gb is None and d.memory_ceiling_gb is None and d.snapshot_interval_s is None
    # The optional fields accept None, and the bounds are inclusive.
    DirectiveFields(memory_quota_gb=None, memory_ceiling_gb=None, snapshot_interval_s=None)
    DirectiveFields(grad_accum_steps=1024, sync_priority=-10, snapshot_interval_s=1.0, memory_quota_gb=0.0)


def test_directive_round_trips_through_dict() -> None:
    d = DirectiveFields(
        compression_bits=4,
        precision="bf16",
        memory_quota_gb=3.0,
        memory_ceiling_gb=6.0,
        snapshot_now="req-9",
        target_device="gpu3",
    )
    assert DirectiveFields.from_dict(d.to_dict()) == d
    assert DirectiveFields.from_dict({}) == DirectiveFields()


def test_directive_from_dict_names_unknown_fields() -> None:
    with pytest.raises(ModelError, match=r"unknown directive field\(s\) \['turbo', 'warp'\]") as exc:
        DirectiveFields.from_dict({"warp": 9, "turbo": True, "precision": "bf16"})
    assert "compression_bits" in str(exc.value)  # lists the accepted fields


def test_directive_merged_validates_the_whole() -> None:
    base = DirectiveFields(memory_quota_gb=7.0, memory_ceiling_gb=12.0)
    assert base.merged({"compression_bits": 8}) == DirectiveFields(
        compression_bits=8, memory_quota_gb=7.0, memory_ceiling_gb=12.0
    )
    assert base.merged({}) == base
    with pytest.raises(ModelError) as exc:
        base.merged({"memory_ceiling_gb": 6.0})  # below the existing quota
    assert_names(exc, "memory_ceiling_gb")
    with pytest.raises(ModelError, match=r"unknown directive field\(s\) \['bogus'\]"):
        base.merged({"bogus": 1})
    assert base.merged({"memory_quota_gb": None}).memory_quota_gb is None  # optional: None clears it


@pytest.mark.parametrize("field", ["grad_accum_steps", "sync_priority", "async_sampling"])
def test_directive_none_for_a_required_field_is_a_model_error(field: str) -> None:
    with pytest.raises(ModelError) as exc:
        DirectiveFields().merged({field: None})
    assert_names(exc, field)


def test_directive_for_pool_takes_the_pool_limits() -> None:
    p = Pool("p", memory_base_gb=3.0, memory_ceiling_gb=5.0, snapshot_interval_s=45.0)
    d = DirectiveFields.for_pool(p)
    assert (d.memory_quota_gb, d.memory_ceiling_gb, d.snapshot_interval_s) == (3.0, 5.0, 45.0)
    assert d.memory_limit_gb == 5.0  # until the first quota plan, a new worker may grow to the ceiling
    assert Directive("w", 1, d, 1.5).to_dict() == {"version": 1, "updated_at": 1.5, **d.to_dict()}


# -- workers and events ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": -1}, "rank"),
        ({"pid": -1}, "pid"),
        ({"heartbeat_interval_s": 0.0}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": 0.049}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": 3601.0}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": math.nan}, "heartbeat_interval_s"),
    ],
)
def test_worker_info_validation_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelError) as exc:
        WorkerInfo(pool="p", **kwargs)
    assert_names(exc, field)


def test_worker_info_bounds_are_inclusive() -> None:
    WorkerInfo(pool="p", heartbeat_interval_s=0.05)
    WorkerInfo(pool="p", heartbeat_interval_s=3600.0, rank=0, pid=0)


def test_event_to_dict() -> None:
    e = Event(ts=1.5, type=EventType.SNAPSHOT, worker_id="w", pool="p", data={"step": 3}, id=7)
    assert e.to_dict() == {"id": 7, "ts": 1.5, "type": "snapshot", "worker_id": "w", "pool": "p", "data": {"step": 3}}
    assert Event(ts=0.0, type=EventType.LOG).to_dict()["data"] == {}


def test_worker_event_types_exclude_control_plane_decisions() -> None:
    assert {t.value for t in WORKER_EVENT_TYPES} == {
        "snapshot",
        "restore",
        "alert",
        "anomaly",
        "log",
        "directive_unappliable",
    }
    for decided in (
        "registered",
        "deregistered",
        "lost",
        "rejoined",
        "directive_set",
        "directive_acked",
        "meltdown",
        "recovered",
        "policy_action",
        "pool_changed",
    ):
        assert EventType(decided) not in WORKER_EVENT_TYPES
