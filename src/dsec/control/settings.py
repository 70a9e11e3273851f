"""Control-plane settings: a frozen dataclass built from arguments and the environment."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsec.control.judge import JudgeConfig
    from dsec.control.runtimes import RetryPolicy
    from dsec.scheduler.device_health import DeviceHealthConfig


def default_home() -> Path:
    return Path(os.environ.get("DSEC_HOME") or Path.home() / ".dsec")


def _truthy(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not a boolean: expected 1/0, true/false, yes/no or on/off")


def _judge_with_memory_pressure(text: str) -> JudgeConfig:
    """The judgment's defaults with the breaker's memory path on at ``text`` x the memory ceiling: for pools whose
    training code shrinks its micro-batch when ``grad_accum_steps`` rises (off by default; dsec.decide.caps_for)."""
    from dsec.control.judge import JudgeConfig

    try:
        value = float(text)
        return JudgeConfig(memory_pressure=value)
    except ValueError:
        raise ValueError(
            f"DSEC_MEMORY_PRESSURE={text!r} is invalid: expected a number in (0, 1] (the breaker's memory cap as a "
            f"fraction of the memory ceiling), or unset (off)"
        ) from None


@dataclass(frozen=True)
class Settings:
    """Everything ``create_app`` needs. I/O seams (clock, store) are passed to ``create_app`` separately."""

    home: Path
    database_url: str
    host: str = "127.0.0.1"
    port: int = 8080
    admin_token: str | None = None
    cluster_file: Path | None = None
    # A worker that misses this many beats (of its own declared interval) becomes `lost`.
    lost_after_beats: int = 3
    default_heartbeat_interval_s: float = 5.0
    # How often the hot in-memory state is written back. Events and registrations do not wait for
    # this: they are group-committed before the request is answered.
    flush_interval_s: float = 1.0
    reconcile_interval_s: float = 0.25
    max_body_bytes: int = 1 << 20
    # Answer heartbeats in a raw ASGI shortcut before FastAPI routing (same handler; see ingest.py).
    heartbeat_shortcut: bool = True
    # Health judgment (breaker, fleet, quotas, precision); None: the defaults of JudgeConfig.
    judge: JudgeConfig | None = None
    # Alert sinks: a structured log line per notification, plus signed webhooks (url, secret).
    alert_log: bool = True
    alert_webhooks: tuple[tuple[str, str], ...] = ()
    alert_group_wait_s: float = 1.0
    alert_group_interval_s: float = 5.0
    alert_repeat_interval_s: float = 300.0
    # Policy engine: the rule file (else the newest version applied through the API, from the store) and how often
    # rules run.
    policy_file: Path | None = None
    policy_interval_s: float = 15.0
    # Degraded-device detection and probation; None: the defaults of DeviceHealthConfig.
    device_health: DeviceHealthConfig | None = None
    # Policy pushes to agent runtimes: retries and timeouts; None: the defaults of RetryPolicy.
    webhook_retry: RetryPolicy | None = None
    # Healing groups: after a failure, members not known dead are waited for this long before the next epoch
    # forms without them (a supervisor that saw the exit names the dead rank, and nobody waits).
    heal_join_timeout_s: float = 5.0

    # -- limits that hold against a hostile token holder (docs/security.md) ------------------------------------
    # Distinct metric names one worker may hold: as many as one beat may carry (names merge across beats, so without
    # this the per-beat cap bounded nothing). With the per-token quota below it bounds what one pool token can make
    # the control plane hold (4096 x 512 names).
    max_metrics_per_worker: int = 512
    # A metric a worker has not sent for more than this many of its beats leaves its metrics and every decision
    # made from them (a name sent once must not steer quotas or device records forever).
    metric_max_age_beats: int = 3
    # Workers registered with one pool token and not deregistered (lost ones count: they may come back).
    max_workers_per_token: int = 4096
    # Events one worker may send: a token bucket (per second, burst); beyond it a beat is answered 429.
    worker_events_per_s: float = 50.0
    worker_events_burst: int = 2000
    # Requests per token on every route but heartbeats (token bucket); admin tokens are not limited.
    rate_limit_per_s: float = 100.0
    rate_limit_burst: int = 2000
    # Deregistered workers leave memory and the store this long after they ended; events older than
    # event_retention_s are pruned (0 keeps them forever). A worker's event time outside
    # [now - event_retention_s, now + max_clock_skew_s] is replaced by the server's (the worker's kept as worker_ts).
    worker_retention_s: float = 86_400.0
    event_retention_s: float = 30 * 86_400.0
    max_clock_skew_s: float = 300.0
    retention_interval_s: float = 60.0  # how often the reconcile loop applies the two retentions
    # A pool's recovery time (dsec_snapshot_recovery_time, read by policies) needs restores reported by this many
    # distinct workers (or by every active worker of a smaller pool); it is their lower median.
    restore_min_reporters: int = 2
    # Worker-sent alert events reach the alert sinks attributed (source=worker, severity at most warning).
    forward_worker_alerts: bool = True
    # Runtime callbacks: private, loopback and link-local destinations are refused unless this is set (tests,
    # the demo, a receiver on the same host); pool tokens may register runtimes only for these hosts (fnmatch
    # patterns); answers are read up to webhook_max_response_bytes; the delivery log keeps this many finished
    # deliveries per runtime, none older than webhook_delivery_retention_s.
    webhook_allow_private: bool = False
    webhook_allowed_hosts: tuple[str, ...] = ()
    webhook_max_response_bytes: int = 64 * 1024
    webhook_deliveries_kept: int = 100
    webhook_delivery_retention_s: float = 86_400.0
    # Cost accounting (GET /v1/cost, dsec_cost_* gauges): the price of one device-hour (currency-neutral; 0: hours
    # only; DSEC_COST_DEVICE_HOUR) and how often the gauges' last-hour report is recomputed.
    cost_device_hour: float = 0.0
    cost_refresh_s: float = 60.0
    # Serve /docs and /redoc (they load scripts from a CDN and describe every route to anyone).
    api_docs: bool = False
    # Where `dsec simulate` publishes its latest plots for the dashboard (DSEC_PLOTS_DIR); None: home / "plots".
    plots_dir: Path | None = None

    @property
    def plots(self) -> Path:
        return self.plots_dir if self.plots_dir is not None else self.home / "plots"

    def __post_init__(self) -> None:
        if self.lost_after_beats < 1:
            raise ValueError(f"lost_after_beats={self.lost_after_beats} is invalid: expected >= 1")
        if not 0 < self.flush_interval_s <= 60:
            raise ValueError(f"flush_interval_s={self.flush_interval_s} is invalid: expected (0, 60]")
        if not 0 < self.policy_interval_s <= 3600:
            raise ValueError(f"policy_interval_s={self.policy_interval_s} is invalid: expected (0, 3600]")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} is invalid: expected >= 1024")
        for name in ("max_metrics_per_worker", "max_workers_per_token", "worker_events_burst", "rate_limit_burst",
                     "restore_min_reporters", "webhook_deliveries_kept", "metric_max_age_beats"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: expected >= 1")
        for name in ("worker_events_per_s", "rate_limit_per_s", "worker_retention_s", "max_clock_skew_s",
                     "retention_interval_s", "webhook_delivery_retention_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: expected > 0")
        if not (math.isfinite(self.cost_device_hour) and self.cost_device_hour >= 0):
            raise ValueError(f"cost_device_hour={self.cost_device_hour} is invalid: expected a finite number >= 0")
        if not self.cost_refresh_s > 0:
            raise ValueError(f"cost_refresh_s={self.cost_refresh_s} is invalid: expected > 0")
        if self.event_retention_s < 0:
            raise ValueError(f"event_retention_s={self.event_retention_s} is invalid: expected >= 0 (0: keep all)")
        if self.webhook_max_response_bytes < 1024:
            raise ValueError(
                f"webhook_max_response_bytes={self.webhook_max_response_bytes} is invalid: expected >= 1024"
            )

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Defaults <- environment (DSEC_HOME, DSEC_DATABASE_URL, DSEC_ADMIN_TOKEN, DSEC_WEBHOOK_ALLOW_PRIVATE,
        DSEC_WEBHOOK_ALLOWED_HOSTS, DSEC_COST_DEVICE_HOUR, DSEC_MEMORY_PRESSURE, DSEC_MAKE_ROOM, DSEC_PLOTS_DIR) <-
        explicit overrides."""
        home = Path(str(overrides.pop("home", None) or default_home()))
        url = (
            overrides.pop("database_url", None)
            or os.environ.get("DSEC_DATABASE_URL")
            or (f"sqlite:///{home / 'dsec.db'}")
        )
        admin = overrides.pop("admin_token", None) or os.environ.get("DSEC_ADMIN_TOKEN") or None
        if "webhook_allow_private" not in overrides and os.environ.get("DSEC_WEBHOOK_ALLOW_PRIVATE"):
            overrides["webhook_allow_private"] = _truthy(os.environ["DSEC_WEBHOOK_ALLOW_PRIVATE"])
        if "webhook_allowed_hosts" not in overrides and os.environ.get("DSEC_WEBHOOK_ALLOWED_HOSTS"):
            hosts = os.environ["DSEC_WEBHOOK_ALLOWED_HOSTS"].split(",")
            overrides["webhook_allowed_hosts"] = tuple(h.strip() for h in hosts if h.strip())
        if "cost_device_hour" not in overrides and os.environ.get("DSEC_COST_DEVICE_HOUR"):
            try:
                overrides["cost_device_hour"] = float(os.environ["DSEC_COST_DEVICE_HOUR"])
            except ValueError:
                raise ValueError(
                    f"DSEC_COST_DEVICE_HOUR={os.environ['DSEC_COST_DEVICE_HOUR']!r} is invalid: expected a number"
                ) from None
        explicit_judge = "judge" in overrides  # an explicit JudgeConfig wins over the environment, as every override
        if not explicit_judge and os.environ.get("DSEC_MEMORY_PRESSURE"):
            overrides["judge"] = _judge_with_memory_pressure(os.environ["DSEC_MEMORY_PRESSURE"])
        if not explicit_judge and os.environ.get("DSEC_MAKE_ROOM"):
            try:
                make_room = _truthy(os.environ["DSEC_MAKE_ROOM"])
            except ValueError as exc:
                raise ValueError(f"DSEC_MAKE_ROOM: {exc}") from None
            if not make_room:
                from dsec.control.judge import JudgeConfig

                judge = overrides.get("judge")
                base = judge if isinstance(judge, JudgeConfig) else JudgeConfig()
                overrides["judge"] = dataclasses.replace(base, make_room=False)
        if "plots_dir" not in overrides:
            from dsec.plots import plots_dir

            overrides["plots_dir"] = plots_dir(home)  # DSEC_PLOTS_DIR, else home/plots: where dsec simulate publishes
        return cls(home=home, database_url=str(url), admin_token=admin and str(admin), **overrides)  # type: ignore[arg-type]
