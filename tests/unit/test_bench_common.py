"""benchmarks/_common.py: the processes a benchmark starts run the code of the benchmark's own checkout."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import load_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "_common.py"


def _common() -> Any:
    return load_module("bench_common", BENCH)


common = _common()
SRC = str(BENCH.parents[1] / "src")


def test_this_checkouts_src_goes_first_on_pythonpath() -> None:
    env = {"PYTHONPATH": os.pathsep.join(["/elsewhere/src", "/more"]), "KEEP": "1"}
    assert common.own_src_first(env) is env
    assert env["PYTHONPATH"].split(os.pathsep) == [SRC, "/elsewhere/src", "/more"]
    assert env["KEEP"] == "1"
    assert common.own_src_first({})["PYTHONPATH"] == SRC


def test_a_benchmarks_server_and_runs_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere/src")
    monkeypatch.setenv("DSEC_HOME", "/tmp/x")
    env = common.dsec_run_env(EXTRA="1")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == SRC and env["EXTRA"] == "1" and "DSEC_HOME" not in env
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def popen(cmd: list[str], stdout: Any, env: dict[str, str]) -> Any:
        seen["env"] = env
        raise Stop

    monkeypatch.setattr(common.subprocess, "Popen", popen)
    server = object.__new__(common.ServerProcess)
    server.database_url = None
    server._cmd = [sys.executable, "-c", "pass"]
    with pytest.raises(Stop):  # stopped at the spawn: nothing runs
        server._spawn()
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == SRC  # the served control plane is this checkout's
