"""The degradation ladder: what each breaker level asks the worker to do.

Each level keeps everything the previous one did and adds one intervention, cheapest first:

=====  ==========================================================================================
level  directive fields
=====  ==========================================================================================
0      ``compression_bits``: the pool's default (``Pool.compression_bits``, 8/16/32), else None: the
       probe's configured default (uncompressed as shipped); no accumulation, asynchronous sampling on
1      ``compression_bits = 4`` — a quarter of the 8-bit upload, error feedback keeps it unbiased
2      + ``grad_accum_steps = 4`` — synchronize every 4th backward pass
3      + ``async_sampling = false`` — actor sampling paused; inference and heartbeats keep running
=====  ==========================================================================================

The memory-pressure path (a worker above its memory cap; off unless ``DSEC_MEMORY_PRESSURE`` sets the cap, see
``dsec.decide.caps_for``) prefers accumulation over bigger batches: from level 1 on it also asks for
``grad_accum_steps = 4`` and holds ``memory_quota_gb`` at the ceiling, so training code that shrinks its micro-batch
under accumulation can trade micro-batch size for steps instead of growing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MAX_LEVEL = 3
DEGRADED_BITS = 4
ACCUM_STEPS = 4

_LEVELS: tuple[dict[str, Any], ...] = (
    {"compression_bits": None, "grad_accum_steps": 1, "async_sampling": True},
    {"compression_bits": DEGRADED_BITS, "grad_accum_steps": 1, "async_sampling": True},
    {"compression_bits": DEGRADED_BITS, "grad_accum_steps": ACCUM_STEPS, "async_sampling": True},
    {"compression_bits": DEGRADED_BITS, "grad_accum_steps": ACCUM_STEPS, "async_sampling": False},
)


def fields_for(
    level: int, causes: Iterable[str] = (), memory_ceiling_gb: float | None = None, default_bits: int | None = None
) -> dict[str, Any]:
    """The directive patch that puts a worker at ``level`` for the given overload causes; ``default_bits``: the
    compression of level 0 (its pool's ``compression_bits``; None: the probe's own default)."""
    if not 0 <= level <= MAX_LEVEL:
        raise ValueError(f"level={level} is invalid: expected 0..{MAX_LEVEL}")
    patch = dict(_LEVELS[level])
    if level == 0:
        patch["compression_bits"] = default_bits
    if level >= 1 and "memory_gb" in set(causes):
        patch["grad_accum_steps"] = max(patch["grad_accum_steps"], ACCUM_STEPS)
        if memory_ceiling_gb is not None:
            patch["memory_quota_gb"] = memory_ceiling_gb
    return patch


def level_of(fields: Mapping[str, Any]) -> int:
    """The ladder level a directive puts a worker at (used to resume breakers after a restart)."""
    if fields.get("async_sampling") is False:
        return 3
    if int(fields.get("grad_accum_steps") or 1) >= ACCUM_STEPS:
        return 2
    if fields.get("compression_bits") == DEGRADED_BITS:
        return 1
    return 0
