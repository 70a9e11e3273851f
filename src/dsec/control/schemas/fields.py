"""The field types and the base model every wire schema is built from (see the package's docstring): JSON-strict
numbers and booleans, names, and the checks of free-form event data."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from dsec.model import MAX_MEMORY_GB


def json_integer(value: Any) -> Any:
    """JSON Schema's integer: a number with no fractional part (``3.0`` included), never a boolean. Integral floats
    become ints here; the strict int validation after it refuses everything else (strings, ``3.5``)."""
    if isinstance(value, bool):
        raise ValueError("Input should be a valid integer, not a boolean")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("Input should be a finite number")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, Field(strict=True), BeforeValidator(json_integer)]
# An optional integer's bounds go inside its Annotated (before the validator): Field(ge=...) on ``Int | None`` is
# enforced but reaches the JSON Schema as raw "ge"/"le" instead of minimum/maximum (pydantic cannot push bounds
# through a validator inside a union). tests/integration/test_api_contract.py checks the document has none.
SnapshotLevel = Annotated[int, Field(strict=True, ge=0, le=3), BeforeValidator(json_integer)]
Float = Annotated[float, Field(strict=True)]
Bool = Annotated[bool, Field(strict=True)]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="letters, digits, _ . : - (max 128)")]
METRIC_NAME_PATTERN = r"^[a-zA-Z_][a-zA-Z0-9_]{0,99}$"
MetricName = Annotated[str, Field(pattern=METRIC_NAME_PATTERN)]
MemoryGB = Annotated[float, Field(ge=0, le=MAX_MEMORY_GB, strict=True)]
MAX_EVENT_DATA_BYTES = 16 * 1024
MAX_EVENT_DATA_DEPTH = 8


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, str_max_length=4096)


def _check_json_value(value: Any, depth: int = 0) -> None:
    if depth > MAX_EVENT_DATA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_EVENT_DATA_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"non-finite number {value!r} is not allowed")
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        # The store writes event data as JSON with orjson, which holds 64-bit integers only.
        raise ValueError(f"integer {value} does not fit in 64 bits")
    if isinstance(value, dict):
        for v in value.values():
            _check_json_value(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_json_value(v, depth + 1)


# What _event_data checks that JSON Schema cannot say of free-form data (the 422 names the field).
EVENT_DATA_RULES = (
    f"any JSON object nested at most {MAX_EVENT_DATA_DEPTH} levels, at most {MAX_EVENT_DATA_BYTES // 1024} KiB, "
    "integers within 64 bits"
)


def _event_data(v: dict[str, Any]) -> dict[str, Any]:
    _check_json_value(v)
    if len(repr(v)) > MAX_EVENT_DATA_BYTES:
        raise ValueError(f"event data larger than {MAX_EVENT_DATA_BYTES} bytes")
    return v
