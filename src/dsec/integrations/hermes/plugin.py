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

import atexit
import importlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dsec.probe.config import PLUGIN_NAME, plugin_env
from dsec.probe.reporter import Reporter, ReporterConfig
from dsec.probe.telemetry import Telemetry
from dsec.yamlconf import ConfigError

log = logging.getLogger("dsec.integrations.hermes")

CONFIG_ENV = "DSEC_CONFIG"  # path of a harness plugin file (``plugins: - name: dsec_monitor ...``)
SCORER_ENV = "DSEC_HERMES_SCORER"  # "package.module:function" computing an episode's return
ABANDON_ENV = "DSEC_HERMES_ABANDON_AFTER"  # seconds without a hook call after which an open run has ended
CONFIG_FILE_NAME = "dsec_monitor.yaml"  # looked up in HERMES_HOME when DSEC_CONFIG is not set
DEFAULT_ROLE = "actor"
DEFAULT_GROUP = "hermes"

# The probe's episode metrics (dsec.probe.telemetry), forwarded as they are.
EPISODE_METRICS = (
    "episodes_total",
    "terminated_total",
    "truncated_total",
    "interrupted_total",
    "consecutive_interrupted",
    "episode_return_mean",
    "episode_length_mean",
    "episode_length_cv",
    "reward_variance_shift",
)
_ENV_KEYS = (
    "DSEC_ENDPOINT",
    "DSEC_SANDBOX_ID",
    "DSEC_TOKEN",
    "DSEC_ROLE",
    "DSEC_GROUP",
    "DSEC_HEARTBEAT_INTERVAL",
    "DSEC_STUCK_EPISODES",
)


class HookContext(Protocol):
    """What the plugin uses of Hermes' ``PluginContext``."""

    def register_hook(self, hook_name: str, callback: Callable[..., Any]) -> None: ...


@dataclass(frozen=True)
class EpisodeResult:
    """One finished agent run, as handed to a scorer."""

    session_id: str
    task_id: str
    completed: bool  # Hermes: the run ended with a final answer
    interrupted: bool  # Hermes: the user (or the harness) interrupted it
    llm_calls: int
    llm_errors: int
    tool_calls: int
    tool_failures: int
    duration_s: float
    user_message: str | None
    final_response: str | None
    ended_by: str  # "session_end", or "abandoned" when Hermes never closed it (an API failure, exit)

    @property
    def success(self) -> bool:
        return self.completed and not self.interrupted


Scorer = Callable[[EpisodeResult], "float | None"]


@dataclass(frozen=True)
class HermesSettings:
    reporter: ReporterConfig
    stuck_episode_threshold: int = 3
    scorer: str | None = None
    # A run Hermes never closed (it returns early, without on_session_end, on most failures) counts as
    # ended, unsuccessfully, after this long without any hook call.
    abandon_after_s: float = 600.0
    source: str = "environment"


def _hermes_home(env: Mapping[str, str]) -> Path:
    try:  # Hermes' own resolution (profiles); this module also imports without Hermes
        from hermes_constants import get_hermes_home

        return Path(get_hermes_home())
    except Exception:
        return Path(env.get("HERMES_HOME") or Path.home() / ".hermes")


def load_settings(env: Mapping[str, str] | None = None, hermes_home: Path | None = None) -> HermesSettings | None:
    """The plugin's settings, or None when no endpoint or sandbox is configured.

    The harness plugin file comes from ``$DSEC_CONFIG``, else ``$HERMES_HOME/dsec_monitor.yaml`` if it
    exists; its ``dsec_monitor`` entry is read by the same validator as ``dsec run --config`` (errors
    name file:line:column) and, as there, wins over the ambient ``DSEC_*`` variables. Raises
    :class:`~dsec.yamlconf.ConfigError` for an invalid file.
    """
    env = os.environ if env is None else env
    merged = {k: env[k] for k in _ENV_KEYS if env.get(k)}
    source = "environment"
    path = env.get(CONFIG_ENV)
    if not path:
        candidate = (hermes_home or _hermes_home(env)) / CONFIG_FILE_NAME
        path = str(candidate) if candidate.is_file() else None
    if path:
        merged.update(plugin_env(path))
        source = path
    endpoint, pool = merged.get("DSEC_ENDPOINT"), merged.get("DSEC_SANDBOX_ID")
    if not endpoint or not pool:
        return None
    rank_raw = env.get("RANK", "")
    try:
        interval = float(merged.get("DSEC_HEARTBEAT_INTERVAL", "5"))
        stuck = int(merged.get("DSEC_STUCK_EPISODES", "3"))
        abandon = float(env.get(ABANDON_ENV) or 600)
    except ValueError as exc:
        raise ConfigError([f"{source}: {exc}"]) from None
    if stuck < 1:
        raise ConfigError([f"{source}: DSEC_STUCK_EPISODES={stuck} is invalid: expected >= 1"])
    if not abandon > 0:
        raise ConfigError([f"{ABANDON_ENV}={abandon} is invalid: expected > 0 seconds"])
    try:
        reporter = ReporterConfig(
            endpoint=endpoint,
            pool=pool,
            token=merged.get("DSEC_TOKEN"),
            role=merged.get("DSEC_ROLE", DEFAULT_ROLE),
            group=merged.get("DSEC_GROUP", DEFAULT_GROUP),
            rank=int(rank_raw) if rank_raw.isdigit() else 0,
            heartbeat_interval_s=interval,
        )
    except ValueError as exc:
        raise ConfigError([f"{source}: {exc}"]) from None
    return HermesSettings(
        reporter=reporter,
        stuck_episode_threshold=stuck,
        scorer=env.get(SCORER_ENV) or None,
        abandon_after_s=abandon,
        source=source,
    )


def load_scorer(spec: str) -> Scorer:
    """``"package.module:function"`` -> the function."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{SCORER_ENV}={spec!r} is invalid: expected 'package.module:function'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{SCORER_ENV}={spec!r} is not callable")
    scorer: Scorer = obj
    return scorer


@dataclass
class _Episode:
    session_id: str
    task_id: str
    started: float
    last_activity: float
    failing: bool = False  # the last LLM request failed (Hermes may have given up on the run)
    llm_calls: int = 0
    llm_errors: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    turn_started: float | None = None
    user_message: str | None = None
    final_response: str | None = None
    request_started: dict[str, float] = field(default_factory=dict)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class HermesMonitor:
    """Turns Hermes hook calls into DSec metrics and episodes. Thread-safe; every hook swallows errors."""

    HOOKS = (
        "on_session_start",
        "pre_llm_call",
        "post_llm_call",
        "pre_api_request",
        "post_api_request",
        "api_request_error",
        "post_tool_call",
        "on_session_end",
        "on_session_finalize",
        "on_session_reset",
    )

    def __init__(
        self,
        settings: HermesSettings,
        *,
        reporter_factory: Callable[..., Reporter] = Reporter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._reporter_factory = reporter_factory
        self._clock = clock
        self._lock = threading.Lock()
        self._episodes: dict[str, _Episode] = {}
        self._abandoned_keys: dict[str, None] = {}  # insertion-ordered
        self._telemetry = Telemetry(clock=clock)
        self._reporter: Reporter | None = None
        self._closed = False
        self._sampling = threading.Event()
        self._sampling.set()
        self._failed_hooks: set[str] = set()
        self._scorer: Scorer | None = None
        if settings.scorer:
            try:
                self._scorer = load_scorer(settings.scorer)
            except Exception:
                log.exception("dsec_monitor: cannot load the scorer %r; returns are 1.0/0.0", settings.scorer)
        self.callbacks: dict[str, Callable[..., None]] = {name: self._guard(name) for name in self.HOOKS}

    # -- wiring -----------------------------------------------------------------------------------
    def _guard(self, name: str) -> Callable[..., None]:
        handler: Callable[[dict[str, Any]], None] = getattr(self, f"_on_{name}")

        def hook(**kwargs: Any) -> None:
            # Returns None on purpose: a value returned from pre_llm_call is injected into the prompt.
            try:
                handler(kwargs)
            except Exception:
                if name not in self._failed_hooks:
                    self._failed_hooks.add(name)
                    log.warning("dsec_monitor: %s hook failed; the agent continues", name, exc_info=True)
                else:
                    log.debug("dsec_monitor: %s hook failed", name, exc_info=True)

        hook.__name__ = hook.__qualname__ = f"dsec_monitor_{name}"
        return hook

    def set_scorer(self, scorer: Scorer | None) -> None:
        self._scorer = scorer

    @property
    def reporter(self) -> Reporter | None:
        return self._reporter

    def _ensure_started(self) -> Reporter | None:
        if self._reporter is not None or self._closed:
            return self._reporter
        with self._lock:
            if self._reporter is None and not self._closed:
                reporter = self._reporter_factory(self.settings.reporter, on_directive=self._on_directive)
                reporter.add_collector(self._collect)
                reporter.start()
                self._reporter = reporter
                atexit.register(self.close)
                c = self.settings.reporter
                log.info("dsec_monitor: reporting to %s as %s/%s in pool %s", c.endpoint, c.group, c.role, c.pool)
        return self._reporter

    def close(self) -> None:
        """Report the runs Hermes never closed, flush a last beat and deregister; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            open_runs = list(self._episodes.values())
            self._episodes.clear()
            reporter = self._reporter
        self._sampling.set()  # release an agent held by a pause
        try:
            for ep in open_runs:
                self._finish(ep, completed=False, interrupted=False, ended_by="abandoned")
        except Exception:
            log.debug("dsec_monitor: reporting open runs failed", exc_info=True)
        if reporter is not None:
            reporter.close()
        atexit.unregister(self.close)

    # -- per beat -----------------------------------------------------------------------------------
    def _collect(self) -> dict[str, float]:
        self._abandon_idle()
        collected = self._telemetry.collect()
        out = {k: float(collected[k]) for k in EPISODE_METRICS if k in collected}
        with self._lock:
            out["episodes_active"] = float(len(self._episodes))
        out["async_sampling"] = 1.0 if self._sampling.is_set() else 0.0
        try:
            import psutil

            out["memory_used_gb"] = psutil.Process().memory_info().rss / 2**30
        except Exception:  # psutil is optional (Hermes installs it)
            pass
        return out

    def _on_directive(self, directive: Mapping[str, Any]) -> bool:
        # Gradient and memory knobs have nothing to act on in an agent process: in force at once, as in
        # a probe without a DDP model. async_sampling pauses the agent before its next LLM request.
        allowed = directive.get("async_sampling", True)
        if allowed is False:
            if self._sampling.is_set():
                log.warning("dsec_monitor: the control plane paused sampling; agent waits before its next LLM call")
            self._sampling.clear()
        else:
            self._sampling.set()
        return True

    def wait_for_sampling(self) -> None:
        """Block while the control plane has paused this actor (returns at once otherwise, or on close)."""
        if self.settings.reporter.role != "actor":
            return
        while not self._sampling.wait(0.5):
            if self._closed:
                return

    # -- episodes --------------------------------------------------------------------------------
    def _episode(self, kw: Mapping[str, Any], start: bool = False) -> _Episode | None:
        """The run these hook arguments belong to (keyed by Hermes' task id), created on first sight.

        ``start``: the hook that opens a run (pre_llm_call). Other hooks of a run already reported as
        abandoned do not open a new one (None).
        """
        session_id = _text(kw.get("session_id")) or ""
        task_id = _text(kw.get("task_id")) or ""
        key = task_id or session_id or "default"
        now = self._clock()
        abandoned: list[_Episode] = []
        with self._lock:
            ep = self._episodes.get(key)
            if ep is None and not task_id and session_id:
                ep = next((e for e in self._episodes.values() if e.session_id == session_id), None)
            if ep is None and not start and key in self._abandoned_keys:
                return None
            if ep is None and not self._closed:
                self._abandoned_keys.pop(key, None)
                # A new run in a session whose open run's last LLM request failed: Hermes gave up on that
                # run (it returns without on_session_end) — it ended, unsuccessfully. (Runs of one session
                # can overlap otherwise: Hermes' background review shares its parent's session id.)
                if session_id:
                    stale = [k for k, e in self._episodes.items() if e.session_id == session_id and e.failing]
                    abandoned = [self._episodes.pop(k) for k in stale]
                    self._remember_abandoned(stale)
                ep = self._episodes[key] = _Episode(
                    session_id=session_id, task_id=task_id, started=now, last_activity=now
                )
            elif ep is not None:
                ep.last_activity = now
        for old in abandoned:
            self._finish(old, completed=False, interrupted=False, ended_by="abandoned")
        return ep

    def _remember_abandoned(self, keys: list[str]) -> None:
        """Keys of runs reported as abandoned (bounded): their late hooks must not count a new run."""
        for k in keys:
            self._abandoned_keys[k] = None
        while len(self._abandoned_keys) > 4096:
            self._abandoned_keys.pop(next(iter(self._abandoned_keys)))

    def _abandon_idle(self) -> None:
        deadline = self._clock() - self.settings.abandon_after_s
        with self._lock:
            idle = [k for k, e in self._episodes.items() if e.last_activity < deadline]
            abandoned = [self._episodes.pop(k) for k in idle]
            self._remember_abandoned(idle)
        for ep in abandoned:
            self._finish(ep, completed=False, interrupted=False, ended_by="abandoned")

    def _finish(self, ep: _Episode, *, completed: bool, interrupted: bool, ended_by: str) -> None:
        result = EpisodeResult(
            session_id=ep.session_id,
            task_id=ep.task_id,
            completed=completed,
            interrupted=interrupted,
            llm_calls=ep.llm_calls,
            llm_errors=ep.llm_errors,
            tool_calls=ep.tool_calls,
            tool_failures=ep.tool_failures,
            duration_s=max(0.0, self._clock() - ep.started),
            user_message=ep.user_message,
            final_response=ep.final_response,
            ended_by=ended_by,
        )
        ret = 1.0 if result.success else 0.0
        if self._scorer is not None:
            try:
                score = self._scorer(result)
            except Exception:
                log.warning("dsec_monitor: the scorer failed; return %.1f used", ret, exc_info=True)
            else:
                value = _number(score)
                if value is not None:
                    ret = value
                elif score is not None:
                    log.warning("dsec_monitor: the scorer returned %r, not a finite number; ignored", score)
        reason = "tool_failure" if ep.tool_failures else "interrupted" if interrupted else None
        self._telemetry.record_episode(
            ret, ep.llm_calls, terminated=completed, truncated=not completed, interrupted=reason is not None
        )
        # As the probe does (Probe.after_episode): N consecutive interrupted episodes are reported at
        # once, then 2N, 4N, ...
        n = self._telemetry.consecutive_interrupted
        k, rest = divmod(n, self.settings.stuck_episode_threshold)
        reporter = self._reporter
        if reason is not None and n and rest == 0 and k & (k - 1) == 0 and reporter is not None:
            reporter.event("anomaly", urgent=True, kind="episode_stuck", reason=reason, count=n)

    # -- hooks (each called by the guard with Hermes' keyword arguments) ------------------------------
    def _on_on_session_start(self, kw: dict[str, Any]) -> None:
        self._ensure_started()

    def _on_pre_llm_call(self, kw: dict[str, Any]) -> None:
        self._ensure_started()
        ep = self._episode(kw, start=True)
        if ep is not None:
            with self._lock:
                ep.turn_started = self._clock()
                ep.user_message = _text(kw.get("user_message")) or ep.user_message

    def _on_post_llm_call(self, kw: dict[str, Any]) -> None:
        reporter = self._ensure_started()
        ep = self._episode(kw)
        if ep is None:
            return
        with self._lock:
            ep.final_response = _text(kw.get("assistant_response"))
            started, ep.turn_started = ep.turn_started, None
        if started is not None and reporter is not None:
            reporter.observe("llm_turn_ms", (self._clock() - started) * 1000)

    def _on_pre_api_request(self, kw: dict[str, Any]) -> None:
        self._ensure_started()
        self.wait_for_sampling()
        ep = self._episode(kw)
        if ep is not None:
            with self._lock:
                ep.request_started[str(kw.get("api_request_id") or "")] = self._clock()

    def _request_ms(self, ep: _Episode | None, kw: Mapping[str, Any]) -> float | None:
        started = None
        if ep is not None:
            with self._lock:
                started = ep.request_started.pop(str(kw.get("api_request_id") or ""), None)
        if started is not None:
            return (self._clock() - started) * 1000
        duration = _number(kw.get("api_duration"))  # seconds; Hermes measures from the first attempt
        return duration * 1000 if duration is not None else None

    def _on_post_api_request(self, kw: dict[str, Any]) -> None:
        reporter = self._ensure_started()
        if reporter is None:
            return
        ep = self._episode(kw)
        if ep is not None:
            with self._lock:
                ep.llm_calls += 1
                ep.failing = False
        ms = self._request_ms(ep, kw)
        if ms is not None:
            reporter.observe("llm_call_ms", ms)
        reporter.inc("llm_calls_total")
        usage = kw.get("usage")
        if isinstance(usage, Mapping):
            tokens_in = _number(usage.get("input_tokens", usage.get("prompt_tokens")))
            tokens_out = _number(usage.get("output_tokens", usage.get("completion_tokens")))
            if tokens_in is not None:
                reporter.inc("llm_input_tokens_total", tokens_in)
            if tokens_out is not None:
                reporter.inc("llm_output_tokens_total", tokens_out)

    def _on_api_request_error(self, kw: dict[str, Any]) -> None:
        reporter = self._ensure_started()
        if reporter is None:
            return
        ep = self._episode(kw)
        if ep is not None:
            with self._lock:
                ep.llm_errors += 1
                ep.failing = True
            self._request_ms(ep, kw)
        reporter.inc("llm_errors_total")

    def _on_post_tool_call(self, kw: dict[str, Any]) -> None:
        reporter = self._ensure_started()
        if reporter is None:
            return
        ep = self._episode(kw)
        failed = kw.get("status") == "error"
        if ep is not None:
            with self._lock:
                ep.tool_calls += 1
                ep.tool_failures += int(failed)
        reporter.inc("tool_calls_total")
        if failed:
            reporter.inc("tool_failures_total")
        ms = _number(kw.get("duration_ms"))
        if ms is not None:
            reporter.observe("tool_call_ms", ms)

    def _on_on_session_end(self, kw: dict[str, Any]) -> None:
        self._ensure_started()
        ep = self._episode(kw)  # a run with no observed activity still counts as an episode
        if ep is None:  # already reported as abandoned
            return
        with self._lock:
            for k, e in list(self._episodes.items()):
                if e is ep:
                    del self._episodes[k]
        self._finish(
            ep, completed=bool(kw.get("completed")), interrupted=bool(kw.get("interrupted")), ended_by="session_end"
        )

    def _on_on_session_finalize(self, kw: dict[str, Any]) -> None:
        # The session is over (CLI exit, /new, gateway expiry): send what was measured now.
        if self._reporter is not None:
            self._reporter.beat_now()

    def _on_on_session_reset(self, kw: dict[str, Any]) -> None:
        self._on_on_session_finalize(kw)


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
