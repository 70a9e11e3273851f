"""``dsec.attach()``: report this process to a control plane, configured from arguments or the environment.

Environment: DSEC_ENDPOINT, DSEC_SANDBOX_ID (the pool), DSEC_TOKEN (a pool token), DSEC_ROLE,
DSEC_GROUP, DSEC_HEARTBEAT_INTERVAL, and torch.distributed's RANK. Attaching twice returns the same
reporter; the process keeps one reporter because there is one process to report on. Without an
endpoint, or on any error, ``attach()`` logs once and returns None: training never depends on DSec.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

from dsec.probe.reporter import DirectiveHandler, Reporter, ReporterConfig

log = logging.getLogger(__name__)

_lock = threading.Lock()
_reporter: Reporter | None = None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        log.warning("dsec: %s=%r is not a number; using %s", name, raw, default)
        return default


def config_from_env(**overrides: Any) -> ReporterConfig | None:
    endpoint = overrides.pop("endpoint", None) or os.environ.get("DSEC_ENDPOINT")
    pool = overrides.pop("sandbox_id", None) or os.environ.get("DSEC_SANDBOX_ID")
    if not endpoint or not pool:
        return None
    rank_raw = os.environ.get("RANK", "0")
    values: dict[str, Any] = {
        "endpoint": endpoint,
        "pool": pool,
        "token": os.environ.get("DSEC_TOKEN"),
        "role": os.environ.get("DSEC_ROLE", "other"),
        "group": os.environ.get("DSEC_GROUP", "default"),
        "rank": int(rank_raw) if rank_raw.isdigit() else 0,
        "heartbeat_interval_s": _env_float("DSEC_HEARTBEAT_INTERVAL", 5.0),
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ReporterConfig(**values)


def attach(*, on_directive: DirectiveHandler | None = None, **overrides: Any) -> Reporter | None:
    """Start reporting (idempotent). Keyword overrides: endpoint, sandbox_id, token, role, group, rank,
    heartbeat_interval_s, device. Returns the reporter, or None when not configured."""
    global _reporter
    with _lock:
        if _reporter is not None:
            return _reporter
        try:
            config = config_from_env(**overrides)
        except (TypeError, ValueError) as exc:
            log.warning("dsec: not attaching, invalid configuration: %s", exc)
            return None
        if config is None:
            log.info("dsec: DSEC_ENDPOINT / DSEC_SANDBOX_ID not set; not attaching")
            return None
        _reporter = Reporter(config, on_directive=on_directive).start()
        atexit.register(detach)
        return _reporter


def attached() -> Reporter | None:
    return _reporter


def detach() -> None:
    """Flush, deregister and stop the reporter started by ``attach()``."""
    global _reporter
    with _lock:
        reporter, _reporter = _reporter, None
    if reporter is not None:
        reporter.close()
