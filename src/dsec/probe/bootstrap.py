"""Process-wide probe start-up, shared by ``sitecustomize`` (``dsec run``) and ``dsec.attach()``.

There is one probe per process because there is one process to observe; starting it twice returns
the same probe. Nothing here raises into the caller: a misconfiguration is logged once and the probe
stays off, so training never depends on DSec.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from dsec.probe.config import ProbeConfig
from dsec.probe.runtime import Probe

log = logging.getLogger(__name__)

_lock = threading.Lock()
_probe: Probe | None = None


def bootstrap(**overrides: Any) -> Probe | None:
    global _probe
    with _lock:
        if _probe is not None:
            return _probe
        try:
            config = ProbeConfig.from_env(**overrides)
        except (TypeError, ValueError) as exc:
            log.warning("dsec: probe off, invalid configuration: %s", exc)
            return None
        if config is None:
            return None
        probe = Probe(config)
        try:
            probe.install()
        except Exception:
            log.warning("dsec: instrumentation failed; reporting only", exc_info=True)
        atexit.register(shutdown)
        _probe = probe
        return probe


def current() -> Probe | None:
    return _probe


def shutdown() -> None:
    """Flush, deregister and stop the probe; restore patched functions."""
    global _probe
    with _lock:
        probe, _probe = _probe, None
    if probe is not None:
        probe.close()
        probe.uninstall()
