"""DSec: a state-aware elastic compute coordinator for distributed RL training.

Public API: ``attach()`` / ``detach()`` (the in-process probe), the actuator helpers
(``sampling_allowed``, ``wait_for_sampling``, ``on_sampling_change``, ``autocast``), the low-level
``Reporter``, and ``__version__``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from dsec.probe.attach import (
    attach,
    attached,
    autocast,
    detach,
    on_sampling_change,
    sampling_allowed,
    wait_for_sampling,
)
from dsec.probe.reporter import Reporter, ReporterConfig

__all__ = [
    "Reporter",
    "ReporterConfig",
    "__version__",
    "attach",
    "attached",
    "autocast",
    "detach",
    "on_sampling_change",
    "sampling_allowed",
    "wait_for_sampling",
]
