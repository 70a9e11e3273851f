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

from dsec.probe import importhook, lifecycle, lifecycle_ray
from dsec.probe.config import ProbeConfig
from dsec.probe.runtime import Probe

log = logging.getLogger(__name__)

_lock = threading.Lock()
_probe: Probe | None = None
_ending: Probe | None = None  # the probe being closed (for the SIGTERM fallback)
_reason: str | None = None  # why the process ends, when known before atexit (a SIGTERM its own handler took)
_sigterm: lifecycle.SigtermChain | None = None


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
        atexit.register(_at_exit)
        _install_sigterm()
        # Ray ends its actors its own way (ray.kill, its own SIGTERM handler): see lifecycle_ray.
        importhook.when_imported("ray", lambda ray: lifecycle_ray.install(ray, end_now))
        _probe = probe
        return probe


def _install_sigterm() -> None:
    global _sigterm
    if _sigterm is not None:
        return
    chain = lifecycle.SigtermChain(lambda reason: shutdown(reason, dying=True), _deregister_now, _note_reason)
    try:
        chain.install()
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        log.debug("dsec: no SIGTERM handler installed", exc_info=True)
    _sigterm = chain


def _note_reason(reason: str) -> None:
    global _reason
    _reason = reason


def _at_exit() -> None:
    shutdown(_reason or lifecycle.exit_reason())


def _deregister_now(reason: str) -> None:
    probe = _ending or _probe
    rep = probe.reporter if probe is not None else None
    if rep is not None:
        rep.deregister_now(reason)


def end_now(reason: str) -> None:
    """The process is about to be killed (``reason``: sigterm, ray_kill): final beat and deregistration, bounded in
    time, without restoring patched functions (other threads may be inside them)."""
    lifecycle.end_within(lambda r: shutdown(r, dying=True), _deregister_now, reason)


def current() -> Probe | None:
    return _probe


def shutdown(reason: str = lifecycle.DETACH, dying: bool = False) -> None:
    """Flush, deregister (``reason``: exit, error, sigterm, detach) and stop the probe; restore patched functions —
    unless ``dying`` (a SIGTERM with the default action follows: the main thread may be inside a patched function)."""
    global _probe, _ending, _sigterm
    with _lock:
        probe, _probe = _probe, None
        _ending = probe
    if probe is not None:
        probe.close(reason, dying=dying)
        if not dying:
            probe.uninstall()
    if not dying and _sigterm is not None:
        _sigterm.uninstall()
        _sigterm = None
