"""DSec: a state-aware elastic compute coordinator for distributed RL training.

Public API: ``attach()`` (report this process to a control plane and receive directives),
``Reporter`` and its config, and ``__version__``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from dsec.probe.attach import attach, attached, detach
from dsec.probe.reporter import Reporter, ReporterConfig

__all__ = ["Reporter", "ReporterConfig", "__version__", "attach", "attached", "detach"]
