"""Fixtures of the probe's unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsec.probe.config import ProbeConfig
from dsec.probe.runtime import Probe


@pytest.fixture
def offline_probe() -> Iterator[Probe]:
    """A probe whose control plane is unreachable (nothing listens on port 9): it never registers."""
    cfg = ProbeConfig.from_env({"DSEC_ENDPOINT": "http://127.0.0.1:9", "DSEC_SANDBOX_ID": "p"})
    assert cfg is not None
    p = Probe(cfg)
    yield p
    p.healing = None  # a test's stand-in is not closed again
    p.close()
