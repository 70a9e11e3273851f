"""How a probed process ends, so the control plane can tell a normal shutdown from a crash.

- The interpreter exits (the script returned, ``sys.exit``, an uncaught exception): ``atexit`` deregisters the worker
  with reason ``exit``, or ``error`` when an uncaught exception ended the script.
- ``SIGTERM`` (torchrun's teardown, a launcher stopping its workers, ``kill``): the handler installed here
  deregisters with reason ``sigterm`` and then does what the process would have done without the probe. With the
  default disposition the signal is raised again with the default action, so the process still dies *by SIGTERM*
  (its exit status is unchanged; ``atexit`` does not run, as before). With a Python handler installed before the
  probe, that handler is called and decides; the process's later exit deregisters with reason ``sigterm``. An
  ignored ``SIGTERM`` stays ignored (no handler is installed).
- ``SIGKILL``, a segfault, ``os._exit``: nothing runs in the process; the control plane marks the worker ``lost``
  after ``lost_after_beats`` missed beats, as before.

A handler the script installs *after* the probe replaces the probe's; such scripts typically exit through
``sys.exit`` from their handler, which deregisters with reason ``exit``.

The deregistration in the handler runs on a helper thread and is waited for a bounded time: the signal may interrupt
the main thread while it holds one of the probe's locks, which the final beat needs. If the helper is not done in
time, a bare deregistration (no final beat) is sent instead.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

#: Why a worker deregistered (the ``reason`` of its ``deregistered`` event).
EXIT, ERROR, SIGTERM, DETACH = "exit", "error", "sigterm", "detach"


def exit_reason() -> str:
    """At interpreter exit: ``error`` when an uncaught exception ended the main script, else ``exit``."""
    return ERROR if getattr(sys, "last_value", None) is not None else EXIT


class SigtermChain:
    """A ``SIGTERM`` handler that lets the probe deregister, then hands the signal on unchanged.

    ``shutdown(reason)`` is the full close (final beat, deregistration); ``fallback(reason)`` a bare deregistration
    used when the full close does not finish within ``wait_s``."""

    def __init__(
        self,
        shutdown: Callable[[str], None],
        fallback: Callable[[str], None],
        note_reason: Callable[[str], None],
        wait_s: float = 6.0,
    ) -> None:
        self._shutdown = shutdown
        self._fallback = fallback
        self._note_reason = note_reason
        self.wait_s = wait_s
        self._previous: Any = None
        self._pid = -1
        self._handling = False
        self.installed = False

    def install(self) -> bool:
        """Install the handler (main thread only). Nothing is installed when SIGTERM is ignored or handled outside
        Python: that choice is the process's."""
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None or previous is signal.SIG_IGN:
            return False
        self._previous = previous
        self._pid = os.getpid()
        signal.signal(signal.SIGTERM, self._handle)
        self.installed = True
        return True

    def uninstall(self) -> None:
        """Put the previous handler back, unless someone replaced ours meanwhile (theirs stays)."""
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous)
        self.installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous
        # A forked child inherits the handler but not the worker: it only chains. A second SIGTERM while the first is
        # handled changes nothing (the first one ends the process).
        if os.getpid() == self._pid and not self._handling:
            self._handling = True
            if callable(previous):
                # The process's own handler decides what SIGTERM means; its exit deregisters (reason sigterm).
                self._note_reason(SIGTERM)
            else:
                self._deregister()
        elif os.getpid() == self._pid:
            return
        if callable(previous):
            previous(signum, frame)
            return
        # The default action: die by the signal, as without the probe.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _deregister(self) -> None:
        end_within(self._shutdown, self._fallback, SIGTERM, self.wait_s)


def end_within(
    shutdown: Callable[[str], None], fallback: Callable[[str], None], reason: str, wait_s: float = 6.0
) -> None:
    """Close the probe with ``reason`` on a helper thread, waiting at most ``wait_s``; if it is not done by then (the
    caller interrupted a thread holding one of the probe's locks), send the bare deregistration ``fallback`` instead.
    For a process about to die: never raises."""
    done = threading.Event()

    def close() -> None:
        try:
            shutdown(reason)
        except Exception:
            log.debug("dsec: closing (%s) failed", reason, exc_info=True)
        finally:
            done.set()

    threading.Thread(target=close, name=f"dsec-{reason}", daemon=True).start()
    if not done.wait(wait_s):
        try:
            fallback(reason)
        except Exception:
            log.debug("dsec: deregistering (%s) failed", reason, exc_info=True)
