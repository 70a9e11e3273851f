"""A real control plane on loopback keeps the interpreter's finer GIL switch interval for as long as it serves, and puts
the interval back when it stops (control/cpu_thread.py: a batch's commit must not wait out 5 ms turns behind the
event loop answering the batch)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from conftest import DEFAULT_SWITCH_S
from dsec.control.cpu_thread import FINE_SWITCH_S

DEFAULT = DEFAULT_SWITCH_S
pytestmark = pytest.mark.usefixtures("default_switch_interval")


def test_the_interval_is_finer_while_the_control_plane_serves(server_factory: Callable[..., Any]) -> None:
    h = server_factory(pools=True)
    with h.http() as http:
        assert http.get("/healthz").status_code == 200
    assert sys.getswitchinterval() == pytest.approx(FINE_SWITCH_S, rel=0.05)
    h.close()
    assert sys.getswitchinterval() == pytest.approx(DEFAULT, rel=0.05)
