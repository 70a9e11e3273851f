"""The dual-threshold circuit breaker: a pure state machine per worker and the degradation ladder."""

from dsec.breaker.ladder import MAX_LEVEL, fields_for, level_of
from dsec.breaker.machine import (
    TRANSITIONS,
    Action,
    Breaker,
    BreakerConfig,
    Caps,
    Phase,
    Sample,
    Transition,
    Trigger,
)

__all__ = [
    "MAX_LEVEL",
    "TRANSITIONS",
    "Action",
    "Breaker",
    "BreakerConfig",
    "Caps",
    "Phase",
    "Sample",
    "Transition",
    "Trigger",
    "fields_for",
    "level_of",
]
