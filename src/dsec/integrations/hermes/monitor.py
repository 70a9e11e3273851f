"""The ``dsec_monitor`` plugin's monitor: Hermes hook calls turned into DSec metrics, episodes and their anomalies
(what is reported: plugin.py)."""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from dsec.integrations.hermes.episodes import EpisodeResult, Scorer, _Episode, load_scorer
from dsec.integrations.hermes.settings import HermesSettings
from dsec.probe.reporter import Reporter
from dsec.probe.telemetry import Telemetry

log = logging.getLogger("dsec.integrations.hermes")

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
