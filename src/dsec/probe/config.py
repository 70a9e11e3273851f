"""Probe configuration: environment variables, optionally seeded from a harness plugin file.

Environment (what every process started by ``dsec run`` inherits):

=========================  ====================================================  =========
variable                   meaning                                               default
=========================  ====================================================  =========
DSEC_ENDPOINT              control-plane URL (the probe is off without it)       -
DSEC_SANDBOX_ID            pool the worker belongs to                            -
DSEC_TOKEN                 pool token used to register                           -
DSEC_ROLE                  auto | actor | learner | other (auto: inferred)       auto
DSEC_ROLE_ACTOR_STEPS      auto: env steps without an optimizer step -> actor   1000
DSEC_GROUP                 worker group name                                     default
DSEC_HEARTBEAT_INTERVAL    seconds between beats                                 5
DSEC_COMPRESSION_BITS      gradient compression when no directive asks (32/16/8/4) 32
DSEC_INTERRUPT_KEYS        info keys marking an interrupted episode (comma list) collision,crash,interrupted
DSEC_STUCK_EPISODES        consecutive interrupted episodes that raise an alert  3
DSEC_SNAPSHOT_DIR          snapshot store (snapshots off without it)             -
DSEC_RESTORE               latest | N: restore before training resumes          -
DSEC_SNAPSHOT_NAME         the worker's name in the snapshot store              <group>-<role>-<rank>
DSEC_DRIFT_CHECK_STEPS     synchronized steps between replica fingerprints (0 off) 100
DSEC_DEVICE                the device this worker runs on (set by dsec launch)   -
RANK                       torch.distributed rank (also learned from init)       0
=========================  ====================================================  =========

Harness plugin file (``dsec run --config FILE``)::

    plugins:
      - name: dsec_monitor
        config:
          endpoint: "http://127.0.0.1:8080"
          heartbeat_interval: 5   # seconds
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dsec.probe.reporter import ReporterConfig
from dsec.probe.roles import AUTO, DEFAULT_ACTOR_ENV_STEPS, ROLES
from dsec.probe.sync_header import DEFAULT_EVERY as DEFAULT_HEADER_EVERY
from dsec.yamlconf import ConfigError, load_marked, validate

PLUGIN_NAME = "dsec_monitor"


@dataclass(frozen=True)
class ProbeConfig:
    reporter: ReporterConfig
    rank: int | None = None
    default_compression_bits: int = 32
    block_size: int = 256
    error_feedback: bool = True
    interrupt_info_keys: tuple[str, ...] = ("collision", "crash", "interrupted")
    stuck_episode_threshold: int = 3
    drift_check_steps: int = 100
    # The DDP comm hook's sync header rides every Nth synchronized step in its all_reduce path (ddp.py).
    header_every: int = DEFAULT_HEADER_EVERY
    # --role auto: the worker registers as ``other`` and the probe infers its role (dsec.probe.roles).
    infer_role: bool = False
    role_actor_env_steps: int = DEFAULT_ACTOR_ENV_STEPS
    instrument_torch: bool = True
    instrument_gym: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default_compression_bits not in (32, 16, 8, 4):
            raise ValueError(
                f"compression_bits={self.default_compression_bits} is invalid: expected one of [32, 16, 8, 4]"
            )
        if self.stuck_episode_threshold < 1:
            raise ValueError(f"stuck_episode_threshold={self.stuck_episode_threshold} is invalid: expected >= 1")
        if self.drift_check_steps < 0:
            raise ValueError(f"drift_check_steps={self.drift_check_steps} is invalid: expected >= 0 (0: off)")
        if self.header_every < 1:
            raise ValueError(f"header_every={self.header_every} is invalid: expected >= 1")
        if self.role_actor_env_steps < 1:
            raise ValueError(f"role_actor_env_steps={self.role_actor_env_steps} is invalid: expected >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ProbeConfig | None:
        """None when no endpoint or sandbox is configured (the probe then stays off)."""
        env = os.environ if env is None else env
        endpoint = overrides.pop("endpoint", None) or env.get("DSEC_ENDPOINT")
        pool = overrides.pop("sandbox_id", None) or env.get("DSEC_SANDBOX_ID")
        if not endpoint or not pool:
            return None
        rank_raw = env.get("RANK")
        rank = int(rank_raw) if rank_raw and rank_raw.isdigit() else None
        rank = overrides.pop("rank", rank)
        role = overrides.pop("role", None) or env.get("DSEC_ROLE") or AUTO
        if role not in (AUTO, *ROLES):
            raise ValueError(f"role={role!r} is invalid: expected one of {[AUTO, *ROLES]}")
        reporter = ReporterConfig(
            endpoint=endpoint,
            pool=pool,
            token=overrides.pop("token", None) or env.get("DSEC_TOKEN"),
            role="other" if role == AUTO else role,
            group=overrides.pop("group", None) or env.get("DSEC_GROUP", "default"),
            rank=rank or 0,
            heartbeat_interval_s=float(
                overrides.pop("heartbeat_interval_s", None) or env.get("DSEC_HEARTBEAT_INTERVAL", "5")
            ),
            device=overrides.pop("device", None) or env.get("DSEC_DEVICE") or None,
        )
        keys = env.get("DSEC_INTERRUPT_KEYS")
        return cls(
            reporter=reporter,
            rank=rank,
            default_compression_bits=int(
                overrides.pop("compression_bits", None) or env.get("DSEC_COMPRESSION_BITS", "32")
            ),
            interrupt_info_keys=tuple(k.strip() for k in keys.split(",") if k.strip())
            if keys
            else ("collision", "crash", "interrupted"),
            stuck_episode_threshold=int(env.get("DSEC_STUCK_EPISODES", "3")),
            drift_check_steps=int(overrides.pop("drift_check_steps", env.get("DSEC_DRIFT_CHECK_STEPS", "100"))),
            header_every=int(overrides.pop("header_every", env.get("DSEC_HEADER_EVERY", str(DEFAULT_HEADER_EVERY)))),
            infer_role=role == AUTO,
            role_actor_env_steps=int(env.get("DSEC_ROLE_ACTOR_STEPS", str(DEFAULT_ACTOR_ENV_STEPS))),
            **overrides,
        )


class PluginSettings(BaseModel):
    """``config:`` of the dsec_monitor plugin entry."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    endpoint: str = Field(..., pattern=r"^https?://")
    heartbeat_interval: float = Field(5.0, ge=0.05, le=3600)
    sandbox_id: str | None = None
    token: str | None = None
    role: str | None = Field(None, pattern=r"^(auto|actor|learner|other)$")
    compression_bits: int | None = Field(None, description="32, 16, 8 or 4")
    interrupt_keys: list[str] | None = None


class PluginEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    config: dict[str, Any] = Field(default_factory=dict)


class HarnessFile(BaseModel):
    model_config = ConfigDict(extra="allow")  # a harness file holds other sections too
    plugins: list[PluginEntry] = Field(default_factory=list)


def plugin_env(path: str | Path) -> dict[str, str]:
    """Environment variables for the ``dsec_monitor`` entry of a harness plugin file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror}"]) from exc
    marked = load_marked(text, str(p))
    harness = validate(HarnessFile, marked, str(p))
    for i, entry in enumerate(harness.plugins):
        if entry.name != PLUGIN_NAME:
            continue
        sub = type(marked)(
            entry.config, {k[3:]: v for k, v in marked.marks.items() if k[:3] == ("plugins", i, "config")}
        )
        try:
            s = validate(PluginSettings, sub, str(p))
        except ConfigError as exc:
            raise ConfigError([m.replace(": ", f": plugins[{i}].config.", 1) for m in exc.problems]) from None
        if s.compression_bits is not None and s.compression_bits not in (32, 16, 8, 4):
            line, col = marked.marks.get(("plugins", i, "config", "compression_bits"), (1, 1))
            raise ConfigError([f"{p}:{line}:{col}: plugins[{i}].config.compression_bits: expected 32, 16, 8 or 4"])
        env = {"DSEC_ENDPOINT": s.endpoint, "DSEC_HEARTBEAT_INTERVAL": str(s.heartbeat_interval)}
        for key, value in (
            ("DSEC_SANDBOX_ID", s.sandbox_id),
            ("DSEC_TOKEN", s.token),
            ("DSEC_ROLE", s.role),
            ("DSEC_COMPRESSION_BITS", s.compression_bits),
        ):
            if value is not None:
                env[key] = str(value)
        if s.interrupt_keys is not None:
            env["DSEC_INTERRUPT_KEYS"] = ",".join(s.interrupt_keys)
        return env
    raise ConfigError([f"{p}:1:1: plugins: no entry named {PLUGIN_NAME!r}"])
