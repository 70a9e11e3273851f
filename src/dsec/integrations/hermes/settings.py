"""The ``dsec_monitor`` plugin's settings: the harness plugin file (``$DSEC_CONFIG``, else
``$HERMES_HOME/dsec_monitor.yaml``) and the ambient ``DSEC_*`` variables, validated as ``dsec run --config``
validates them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dsec.probe.config import plugin_env
from dsec.probe.reporter import ReporterConfig
from dsec.yamlconf import ConfigError

CONFIG_ENV = "DSEC_CONFIG"  # path of a harness plugin file (``plugins: - name: dsec_monitor ...``)
SCORER_ENV = "DSEC_HERMES_SCORER"  # "package.module:function" computing an episode's return
ABANDON_ENV = "DSEC_HERMES_ABANDON_AFTER"  # seconds without a hook call after which an open run has ended
CONFIG_FILE_NAME = "dsec_monitor.yaml"  # looked up in HERMES_HOME when DSEC_CONFIG is not set
DEFAULT_ROLE = "actor"
DEFAULT_GROUP = "hermes"
_ENV_KEYS = (
    "DSEC_ENDPOINT",
    "DSEC_SANDBOX_ID",
    "DSEC_TOKEN",
    "DSEC_ROLE",
    "DSEC_GROUP",
    "DSEC_HEARTBEAT_INTERVAL",
    "DSEC_STUCK_EPISODES",
)


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
