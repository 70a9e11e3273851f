"""DSec: a state-aware elastic compute coordinator for distributed RL training.

Public API: ``attach()`` / ``detach()`` (the in-process probe), the actuator helpers
(``sampling_allowed``, ``wait_for_sampling``, ``on_sampling_change``, ``autocast``), the low-level
``Reporter``, and ``__version__``.

The names are resolved on first use (PEP 562): importing a core package such as ``dsec.breaker``
runs this module first, and an eager ``from dsec.probe import ...`` here would drag the probe,
httpx and pydantic into every process that only wants the decision code.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def _installed_version() -> str:
    # A source checkout on PYTHONPATH without `pip install -e` has no distribution metadata.
    try:
        return metadata.version("dsec")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


__version__ = _installed_version()

# public name -> the module that defines it
_LAZY: dict[str, str] = {
    "attach": "dsec.probe.attach",
    "attached": "dsec.probe.attach",
    "autocast": "dsec.probe.attach",
    "detach": "dsec.probe.attach",
    "on_sampling_change": "dsec.probe.attach",
    "sampling_allowed": "dsec.probe.attach",
    "wait_for_sampling": "dsec.probe.attach",
    "Reporter": "dsec.probe.reporter",
    "ReporterConfig": "dsec.probe.reporter",
}

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


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        # AttributeError (not ImportError) so `from dsec import quant` falls back to the submodule.
        raise AttributeError(f"module 'dsec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
