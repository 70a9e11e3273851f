"""Probe configuration from the environment and from a harness plugin file."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.probe.config import ProbeConfig, plugin_env
from dsec.yamlconf import ConfigError


def test_from_env_needs_endpoint_and_sandbox() -> None:
    assert ProbeConfig.from_env({}) is None
    assert ProbeConfig.from_env({"DSEC_ENDPOINT": "http://x"}) is None
    cfg = ProbeConfig.from_env(
        {
            "DSEC_ENDPOINT": "http://127.0.0.1:1",
            "DSEC_SANDBOX_ID": "pool-3",
            "DSEC_ROLE": "actor",
            "RANK": "5",
            "DSEC_HEARTBEAT_INTERVAL": "0.5",
            "DSEC_COMPRESSION_BITS": "8",
            "DSEC_INTERRUPT_KEYS": "collision, timeout",
        }
    )
    assert cfg is not None
    assert (cfg.reporter.pool, cfg.reporter.role, cfg.reporter.rank, cfg.rank) == ("pool-3", "actor", 5, 5)
    assert cfg.reporter.heartbeat_interval_s == 0.5
    assert cfg.default_compression_bits == 8
    assert cfg.interrupt_info_keys == ("collision", "timeout")


def test_invalid_compression_is_named() -> None:
    with pytest.raises(ValueError, match="compression_bits=3"):
        ProbeConfig.from_env({"DSEC_ENDPOINT": "http://x", "DSEC_SANDBOX_ID": "p", "DSEC_COMPRESSION_BITS": "3"})


def test_header_every_defaults_to_1_and_a_bad_value_is_named() -> None:
    base = {"DSEC_ENDPOINT": "http://x", "DSEC_SANDBOX_ID": "p"}
    cfg = ProbeConfig.from_env(base)
    assert cfg is not None and cfg.header_every == 1
    cfg = ProbeConfig.from_env({**base, "DSEC_HEADER_EVERY": "8"})
    assert cfg is not None and cfg.header_every == 8
    with pytest.raises(ValueError, match="header_every=0"):
        ProbeConfig.from_env({**base, "DSEC_HEADER_EVERY": "0"})


def test_plugin_file(tmp_path: Path) -> None:
    f = tmp_path / "harness.yaml"
    f.write_text(
        "model: some-llm\nplugins:\n  - name: other\n  - name: dsec_monitor\n    config:\n"
        '      endpoint: "http://127.0.0.1:8080"\n      heartbeat_interval: 5   # seconds\n'
        "      compression_bits: 8\n"
    )
    env = plugin_env(f)
    assert env == {
        "DSEC_ENDPOINT": "http://127.0.0.1:8080",
        "DSEC_HEARTBEAT_INTERVAL": "5.0",
        "DSEC_COMPRESSION_BITS": "8",
    }


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "plugins:\n  - name: dsec_monitor\n    config:\n      endpoint: ftp://x\n",
            ":4:7: plugins[0].config.endpoint",
        ),
        (
            "plugins:\n  - name: dsec_monitor\n    config:\n      endpoint: http://x\n      heartbeat_interval: -1\n",
            ":5:7: plugins[0].config.heartbeat_interval",
        ),
        (
            "plugins:\n  - name: dsec_monitor\n    config:\n      endpoint: http://x\n      bogus: 1\n",
            ":5:7: plugins[0].config.bogus",
        ),
        ("plugins:\n  - name: other\n", ":1:1: plugins: no entry named 'dsec_monitor'"),
        ("plugins: [\n", "invalid YAML"),
    ],
)
def test_plugin_file_errors_name_line_and_field(tmp_path: Path, body: str, expected: str) -> None:
    f = tmp_path / "h.yaml"
    f.write_text(body)
    with pytest.raises(ConfigError) as err:
        plugin_env(f)
    assert expected in str(err.value)
    assert str(f) in str(err.value)
