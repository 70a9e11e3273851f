"""The public in-process API: ``dsec.attach()`` and the actuator helpers user code may call.

``attach()`` starts the probe from code, configured from keyword arguments or the environment (see
dsec.probe.config). It registers at once, instruments torch and gymnasium, and returns the probe (or
None when no endpoint/sandbox is configured: training then runs without DSec). Attaching twice —
from code and through ``dsec run`` — returns the same probe.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from dsec.probe import bootstrap
from dsec.probe.runtime import Probe


def attach(**overrides: Any) -> Probe | None:
    """Start reporting now (idempotent). Keyword overrides: endpoint, sandbox_id, token, role, group,
    rank, heartbeat_interval_s, device, compression_bits."""
    probe = bootstrap.bootstrap(**overrides)
    if probe is not None:
        # Already started by `dsec run`'s sitecustomize: the code's own settings still apply, as long
        # as the worker has not registered yet.
        probe.reconfigure(**overrides)
        probe.start()
    return probe


def attached() -> Probe | None:
    return bootstrap.current()


def detach() -> None:
    """Flush, deregister and stop the probe started by ``attach()`` or ``dsec run``."""
    bootstrap.shutdown()


def sampling_allowed() -> bool:
    """False while the control plane has paused this worker's asynchronous sampling."""
    probe = bootstrap.current()
    return True if probe is None else probe.actuators.sampling_allowed()


def wait_for_sampling(timeout: float | None = None) -> bool:
    """Block a sampler thread while sampling is paused; True once allowed (False on timeout)."""
    probe = bootstrap.current()
    return True if probe is None else probe.actuators.wait_for_sampling(timeout)


def on_sampling_change(callback: Callable[[bool], None]) -> None:
    """Call ``callback(allowed)`` whenever the control plane pauses or resumes sampling."""
    probe = bootstrap.current()
    if probe is not None:
        probe.actuators.on_sampling_change(callback)


def autocast(device_type: str = "cpu") -> AbstractContextManager[None]:
    """``torch.autocast`` at the precision the control plane asks for (fp32, bf16, fp16)."""
    probe = bootstrap.current()
    return nullcontext() if probe is None else probe.autocast(device_type)
