"""JSON-safe copies of optimizer settings and similar Python values (snapshots, state transfer)."""

from __future__ import annotations

import math
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` as JSON: one-element tensors as numbers, non-finite floats as strings, tuples as lists; anything
    else that JSON cannot hold becomes None (dropped by whoever loads it)."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if hasattr(value, "numel") and value.numel() == 1:
        return json_safe(value.item())
    return None
