"""Control-plane settings: a frozen dataclass built from arguments and the environment."""

from __future__ import annotations

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
    # Policy engine: the rule file (else $DSEC_HOME/policies.yaml when one was applied) and how often rules run.
    policy_file: Path | None = None
    policy_interval_s: float = 15.0
    # Degraded-device detection and probation; None: the defaults of DeviceHealthConfig.
    device_health: DeviceHealthConfig | None = None
    # Policy pushes to agent runtimes: retries and timeouts; None: the defaults of RetryPolicy.
    webhook_retry: RetryPolicy | None = None
    # Healing groups: after a failure, members not known dead are waited for this long before the next epoch
    # forms without them (a supervisor that saw the exit names the dead rank, and nobody waits).
    heal_join_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.lost_after_beats < 1:
            raise ValueError(f"lost_after_beats={self.lost_after_beats} is invalid: expected >= 1")
        if not 0 < self.flush_interval_s <= 60:
            raise ValueError(f"flush_interval_s={self.flush_interval_s} is invalid: expected (0, 60]")
        if not 0 < self.policy_interval_s <= 3600:
            raise ValueError(f"policy_interval_s={self.policy_interval_s} is invalid: expected (0, 3600]")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} is invalid: expected >= 1024")

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Defaults <- environment (DSEC_HOME, DSEC_DATABASE_URL, DSEC_ADMIN_TOKEN) <- explicit overrides."""
        home = Path(str(overrides.pop("home", None) or default_home()))
        url = (
            overrides.pop("database_url", None)
            or os.environ.get("DSEC_DATABASE_URL")
            or (f"sqlite:///{home / 'dsec.db'}")
        )
        admin = overrides.pop("admin_token", None) or os.environ.get("DSEC_ADMIN_TOKEN") or None
        return cls(home=home, database_url=str(url), admin_token=admin and str(admin), **overrides)  # type: ignore[arg-type]
