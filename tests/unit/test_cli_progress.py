"""Progress bars on stderr for long CLI work: the hooks report real units (monotonic, up to the total), the bar shows
on stderr when asked for, and stdout (tables, ``--json``) is the same with or without it."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dsec.cli import app
from dsec.cli_progress import bars, wanted

TIMING = ("wall_s", "sim_speedup", "peak_rss_mb")  # measured wall-clock figures: differ from run to run


def _monotonic_to_total(calls: list[tuple[float, float]]) -> None:
    assert calls, "the hook was never called"
    dones = [d for d, _ in calls]
    assert dones == sorted(dones), dones
    assert all(0 <= d <= t for d, t in calls), calls
    assert len({t for _, t in calls}) == 1, calls  # one total throughout
    assert dones[-1] == pytest.approx(calls[-1][1])


def test_wanted_follows_the_flag_else_whether_stderr_is_a_terminal() -> None:
    assert wanted(True) and not wanted(False)
    assert wanted(None) is False  # pytest captures stderr: not a terminal


def test_without_bars_tasks_do_nothing_and_lines_go_where_they_belong(capsys: pytest.CaptureFixture[str]) -> None:
    with bars(False) as b:
        t = b.task("x", total=3)
        t.update(1)
        t.advance()
        b.note("to stderr")
        b.out("to stdout")
    assert b.shown is False
    captured = capsys.readouterr()
    assert captured.out == "to stdout\n" and captured.err == "to stderr\n"


# -- the simulator --------------------------------------------------------------------------------------------------
np = pytest.importorskip("numpy")

from dsec.sim.engine import Simulation  # noqa: E402
from dsec.sim.regimes import Baseline  # noqa: E402
from dsec.sim.runner import simulate  # noqa: E402
from dsec.sim.scenario import Scenario  # noqa: E402

SMALL: dict[str, Any] = {
    "name": "progress",
    "seed": 3,
    "duration_h": 0.5,
    "cluster": {"nodes": 1, "gpus_per_node": 4, "workers_per_gpu": 2},
    "groups": {"count": 1, "actors": 4},
}


def test_simulation_reports_ticks_up_to_the_horizon() -> None:
    sc = Scenario.model_validate(SMALL)
    calls: list[tuple[float, float]] = []
    Simulation(sc, Baseline(sc)).run(lambda k, n: calls.append((k, n)))
    _monotonic_to_total(calls)
    assert calls[-1][1] == int(0.5 * 3600 / sc.sample_interval_s)
    assert len(calls) == 3  # every 10 simulated minutes


def test_simulate_reports_simulated_hours_over_every_regime() -> None:
    calls: list[tuple[float, float]] = []
    simulate(Scenario.model_validate(SMALL), on_progress=lambda d, t: calls.append((d, t)))
    _monotonic_to_total(calls)
    assert calls[-1] == pytest.approx((1.5, 1.5))  # three regimes x 0.5 simulated hours
    assert [round(d, 4) for d, _ in calls[:3]] == [round(1 / 6, 4), round(2 / 6, 4), 0.5]


def _scenario(tmp_path: Path) -> Path:
    f = tmp_path / "s.yaml"
    f.write_text(json.dumps(SMALL))  # JSON is YAML
    return f


def _strip_timing(line: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(line)
    return {k: v for k, v in data.items() if k not in TIMING}


def test_simulate_progress_goes_to_stderr_and_json_is_unchanged(tmp_path: Path) -> None:
    f = _scenario(tmp_path)
    runs = {}
    for flag in ("--progress", "--no-progress"):
        r = CliRunner().invoke(app, ["simulate", str(f), "--no-report", "--json", flag], env={"COLUMNS": "120"})
        assert r.exit_code == 0, r.output
        runs[flag] = r
    shown, hidden = runs["--progress"], runs["--no-progress"]
    assert "simulating progress" in shown.stderr and "100%" in shown.stderr and "1.5/1.5 simulated h" in shown.stderr
    assert hidden.stderr == ""
    for r in (shown, hidden):
        assert "simulating progress" not in r.stdout and "100%" not in r.stdout
    last = [r.stdout.strip().splitlines()[-1] for r in (shown, hidden)]
    assert _strip_timing(last[0]) == _strip_timing(last[1])
    # The table is the same bytes (the line under it ends with the measured wall-clock speed, which varies).
    tables = [r.stdout.split("goodput ratio DSec")[0] for r in (shown, hidden)]
    assert tables[0] == tables[1] and "GPU-hours lost per day" in tables[0]


# -- snapshots ------------------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")

from dsec.snapshot import LocalDirStore, Snapshotter, compact  # noqa: E402
from dsec.snapshot.reader import read_manifest  # noqa: E402


@pytest.fixture
def store(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    for worker in ("learner-0", "learner-1"):
        with Snapshotter(LocalDirStore(tmp_path / "s"), worker, level=0, base_every=2) as snap:
            snap.register("model", model)
            for i in range(3):
                snap.take(step=i, wait=True)
    return tmp_path / "s"


def test_compact_reports_tensors_written(store: Path) -> None:
    calls: list[tuple[float, float]] = []
    s = LocalDirStore(store)
    n = len(read_manifest(s, "learner-0", 3)["tensors"])
    compact(s, "learner-0", 3, on_progress=lambda d, t: calls.append((d, t)))
    _monotonic_to_total(calls)
    assert n >= 4 and calls == [(i, n) for i in range(n + 1)]


def _cli(*args: str) -> Any:
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    return r


def test_snapshot_commands_draw_bars_on_stderr_only(store: Path, tmp_path: Path) -> None:
    root = ["--dir", str(store)]
    shown, hidden = _cli("snapshots", "verify", *root, "--progress"), _cli("snapshots", "verify", *root)
    assert shown.stdout == hidden.stdout and shown.stdout.count("ok ") == 6
    assert "verifying" in shown.stderr and "6/6 snapshots" in shown.stderr and hidden.stderr == ""
    shown = _cli("snapshots", "restore", "learner-1", "-o", str(tmp_path / "a.pt"), *root, "--progress")
    hidden = _cli("snapshots", "restore", "learner-1", "-o", str(tmp_path / "b.pt"), *root, "--no-progress")
    assert shown.stdout.split(" in ")[0] == hidden.stdout.split(" in ")[0]
    assert shown.stdout.startswith("restored learner-1/3 (")
    assert "decoding learner-1/3" in shown.stderr and "MiB" in shown.stderr and "100%" in shown.stderr
    assert hidden.stderr == ""
    a, b = (torch.load(tmp_path / n, weights_only=True) for n in ("a.pt", "b.pt"))
    assert all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in b["tensors"])
    shown = _cli("snapshots", "compact", "learner-0", *root, "--progress")
    assert shown.stdout == "compacted learner-0/3 -> learner-0/4\n"
    n = len(read_manifest(LocalDirStore(store), "learner-0", 3)["tensors"])
    assert "compacting learner-0/3" in shown.stderr and f"{n}/{n} tensors" in shown.stderr


def test_on_a_terminal_lines_print_above_the_bar_not_on_it(store: Path) -> None:
    """stdout and stderr both the terminal (a pty): the bar redraws in place, each `ok` line stands on its own."""
    primary, secondary = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    cmd = [sys.executable, "-m", "dsec.cli", "snapshots", "verify", "--dir", str(store)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, env=env)
    os.close(secondary)
    data = b""
    with contextlib.suppress(OSError):  # EIO once the child closed the terminal
        while chunk := os.read(primary, 65536):
            data += chunk
    os.close(primary)
    assert proc.wait(timeout=60) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", data.decode())  # colours, cursor moves, line erases
    # What the screen shows of each line: the text after its last carriage return (the bar erases its line first).
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n")]
    oks = [line for line in lines if "ok " in line]
    assert len(oks) == 6 and all(line.startswith("ok ") for line in oks), lines
    assert "6/6 snapshots" in text and "100%" in text  # drawn without --progress: stderr is a terminal
