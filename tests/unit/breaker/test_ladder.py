"""The degradation ladder's directive patches (dsec.breaker.ladder)."""

from __future__ import annotations

import pytest

from dsec.breaker.ladder import MAX_LEVEL, fields_for, level_of


def test_each_level_asks_for_exactly_this() -> None:
    # Level 0 leaves compression to the probe's configured default (null); 32 would force float32.
    assert [fields_for(level) for level in range(MAX_LEVEL + 1)] == [
        {"compression_bits": None, "grad_accum_steps": 1, "async_sampling": True},
        {"compression_bits": 4, "grad_accum_steps": 1, "async_sampling": True},
        {"compression_bits": 4, "grad_accum_steps": 4, "async_sampling": True},
        {"compression_bits": 4, "grad_accum_steps": 4, "async_sampling": False},
    ]


@pytest.mark.parametrize("level", range(MAX_LEVEL + 1))
def test_level_of_reads_back_the_level(level: int) -> None:
    assert level_of(fields_for(level)) == level


def test_uncompressed_and_default_are_both_level_zero() -> None:
    assert level_of({"compression_bits": 32, "grad_accum_steps": 1, "async_sampling": True}) == 0
    assert level_of({"compression_bits": None, "grad_accum_steps": 1, "async_sampling": True}) == 0


def test_memory_pressure_accumulates_from_level_one_and_holds_the_quota_at_the_ceiling() -> None:
    assert fields_for(1, ["memory_gb"], 12.0) == {
        "compression_bits": 4,
        "grad_accum_steps": 4,
        "async_sampling": True,
        "memory_quota_gb": 12.0,
    }
    assert fields_for(0, ["memory_gb"], 12.0)["compression_bits"] is None


@pytest.mark.parametrize("default", [8, 16, 32])
def test_a_pools_default_compression_is_level_zero_and_the_first_rung_is_still_4_bit(default: int) -> None:
    assert fields_for(0, default_bits=default)["compression_bits"] == default
    assert [fields_for(level, default_bits=default)["compression_bits"] for level in (1, 2, 3)] == [4, 4, 4]
    assert level_of(fields_for(0, default_bits=default)) == 0
