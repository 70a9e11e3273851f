"""DSec plugin ``dsec_monitor`` for the Hermes agent framework (hermes-agent); see docs/hermes.md.

Hermes imports this package either through the ``hermes_agent.plugins`` entry point or, copied or linked
into ``~/.hermes/plugins/dsec_monitor/``, as a directory plugin (``plugin.yaml`` + this file). Both call
``register(ctx)``. The state lives in :mod:`dsec.integrations.hermes.plugin`, so a harness that imports
this package shares it with the loaded plugin whichever way Hermes loaded it.
"""

from __future__ import annotations

from dsec.integrations.hermes.plugin import (
    EpisodeResult,
    HermesMonitor,
    HermesSettings,
    get_monitor,
    load_settings,
    register,
    set_scorer,
)

__all__ = [
    "EpisodeResult",
    "HermesMonitor",
    "HermesSettings",
    "get_monitor",
    "load_settings",
    "register",
    "set_scorer",
]
