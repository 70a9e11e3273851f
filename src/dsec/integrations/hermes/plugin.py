"""The ``dsec_monitor`` plugin for the Hermes agent framework (``pip install hermes-agent``).

Hermes loads it through its own plugin loader (``hermes_cli/plugins.py`` in hermes-agent 0.19): either as
the pip entry point ``dsec_monitor`` of the group ``hermes_agent.plugins`` (installed with dsec) or as a
directory plugin (``plugin.yaml`` + ``__init__.py`` with ``register(ctx)``). Like every non-bundled
plugin it is opt-in: ``plugins: {enabled: [dsec_monitor]}`` in Hermes' ``config.yaml``.

What it reports, through one :class:`~dsec.probe.reporter.Reporter` per Hermes process (role ``actor``,
group ``hermes``), started on the first agent activity (so ``hermes plugins list`` registers nothing):

* every agent run (one ``run_conversation``: a task from its user message to the final answer, closed by
  Hermes' ``on_session_end``) as an **episode**, with the probe's episode metrics (``episodes_total``,
  ``episode_return_mean``, ``episode_length_mean``, ``terminated_total``, ``truncated_total``,
  ``interrupted_total``, ``consecutive_interrupted``, ``episode_length_cv``, ``reward_variance_shift``) and
  its ``anomaly`` event ``episode_stuck`` after N consecutive interrupted episodes. Return: the scorer's
  value, else 1.0 when the run completed and 0.0 when it did not; length: the LLM requests it made;
  interrupted: a tool call failed during it (reason ``tool_failure``) or the user interrupted it
  (``interrupted``); terminated: it completed; truncated: it did not (iteration budget, interruption, API
  failure). Hermes returns without ``on_session_end`` when it gives up on a run (the LLM API failing for
  good): such a run counts as ended, unsuccessfully, when the next run of its session starts after its
  failed request, after ``DSEC_HERMES_ABANDON_AFTER`` seconds (600) without a hook call, or at exit;
* each LLM request (``pre_api_request`` / ``post_api_request`` / ``api_request_error``): ``llm_call_ms``
  summaries, ``llm_calls_total``, ``llm_errors_total``, ``llm_input_tokens_total``, ``llm_output_tokens_total``;
  each turn (``pre_llm_call`` -> ``post_llm_call``, LLM requests and tools included): ``llm_turn_ms``;
* each tool call (``post_tool_call``): ``tool_calls_total``, ``tool_failures_total``, ``tool_call_ms``;
* ``memory_used_gb`` (process RSS), ``episodes_active`` and ``async_sampling`` per beat.

Directives are acked at once; ``async_sampling: false`` (the control plane pausing an actor) holds the
agent before its next LLM request until sampling resumes. No hook ever raises into Hermes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from dsec.integrations.hermes.episodes import EpisodeResult, Scorer, load_scorer
from dsec.integrations.hermes.monitor import EPISODE_METRICS, HermesMonitor
from dsec.integrations.hermes.settings import (
    ABANDON_ENV,
    CONFIG_ENV,
    CONFIG_FILE_NAME,
    DEFAULT_GROUP,
    DEFAULT_ROLE,
    SCORER_ENV,
    HermesSettings,
    load_settings,
)
from dsec.probe.config import PLUGIN_NAME
from dsec.yamlconf import ConfigError

# Re-exported: the plugin's names as harnesses and tests import them (settings.py, episodes.py, monitor.py).
__all__ = [
    "ABANDON_ENV",
    "CONFIG_ENV",
    "CONFIG_FILE_NAME",
    "DEFAULT_GROUP",
    "DEFAULT_ROLE",
    "EPISODE_METRICS",
    "SCORER_ENV",
    "EpisodeResult",
    "HermesMonitor",
    "HermesSettings",
    "HookContext",
    "Scorer",
    "get_monitor",
    "load_scorer",
    "load_settings",
    "register",
    "set_scorer",
]

log = logging.getLogger("dsec.integrations.hermes")


class HookContext(Protocol):
    """What the plugin uses of Hermes' ``PluginContext``."""

    def register_hook(self, hook_name: str, callback: Callable[..., Any]) -> None: ...


# -- the plugin entry point ------------------------------------------------------------------------------
_monitor: HermesMonitor | None = None
_monitor_lock = threading.Lock()


def get_monitor() -> HermesMonitor | None:
    """The process's monitor, once ``register`` created it."""
    return _monitor


def set_scorer(scorer: Scorer | None) -> None:
    """Compute episode returns with ``scorer(EpisodeResult) -> float | None`` (None: 1.0/0.0)."""
    if _monitor is None:
        raise RuntimeError("dsec_monitor is not loaded (not enabled in Hermes, or not configured)")
    _monitor.set_scorer(scorer)


def register(ctx: HookContext) -> None:
    """Hermes' plugin entry point: register the hooks (never raises; reporting stays off if misconfigured)."""
    global _monitor
    try:
        with _monitor_lock:
            if _monitor is None:
                settings = load_settings()
                if settings is None:
                    log.warning(
                        "dsec_monitor: no endpoint or sandbox configured (set DSEC_CONFIG to a harness file with a "
                        "%r entry, or DSEC_ENDPOINT and DSEC_SANDBOX_ID); DSec reporting is off",
                        PLUGIN_NAME,
                    )
                    return
                _monitor = HermesMonitor(settings)
            monitor = _monitor
        # Hermes may load the plugin twice (entry point and directory) or rediscover it (force=True):
        # one monitor per process, and each callback at most once per plugin manager.
        manager_hooks = getattr(getattr(ctx, "_manager", None), "_hooks", None)
        for name, callback in monitor.callbacks.items():
            if isinstance(manager_hooks, dict) and callback in manager_hooks.get(name, ()):
                continue
            ctx.register_hook(name, callback)
    except ConfigError as exc:
        log.error("dsec_monitor: %s; DSec reporting is off", exc)
    except Exception:
        log.exception("dsec_monitor: setup failed; DSec reporting is off")
