"""Zero-touch snapshots under `dsec run`: the control plane asks for a lossless snapshot through the directive,
the probe takes it from the script's own model and optimizer, reports it as an event; a restart with
``--restore latest`` resumes from it and the run continues *bit-identically* (weights, Adam state and the RNG
that draws the batches), and the restore time reaches ``dsec_snapshot_recovery_time``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, stop_process_group, wait_for

pytest.importorskip("torch")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "snapshot_train.py"
DSEC = Path(sys.executable).with_name("dsec")


def _run(
    cp: Harness, snapdir: Path, out: Path, *extra: str, script_args: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DSEC_HEARTBEAT_INTERVAL": "0.2"}
    cmd = [
        str(DSEC), "run", "--endpoint", cp.url, "--sandbox-id", "pool-a", "--token", cp.pool_tokens["pool-a"],
        "--role", "learner", "--snapshot-dir", str(snapdir), *extra, "--", sys.executable, str(FIXTURE), *script_args,
    ]  # fmt: skip
    with out.open("wb") as fh:
        return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.startswith("{")]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    stop_process_group(proc)


def test_directive_snapshot_then_restore_continues_bit_identically(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    cp = server_factory(pools=True)
    snapdir, stop = tmp_path / "snaps", tmp_path / "stop"
    first = _run(cp, snapdir, tmp_path / "first.log", script_args=("--stop-file", str(stop)))
    try:
        wait_for(lambda: cp.admin.workers(state="active"), timeout=60, what="the worker registering")
        wid = cp.admin.workers(state="active")[0]["id"]
        cp.admin.set_directive(wid, snapshot_compression_level=0, snapshot_now="test-1")

        def snapshot_events() -> list[dict[str, Any]]:
            return [e for e in cp.admin.all_events(worker_id=wid, types=["snapshot"]) if e["data"]["status"] == "ok"]

        wait_for(snapshot_events, timeout=30, what="a snapshot event")
        snap = snapshot_events()[0]["data"]
        assert snap["requests"] == ["test-1"]
        assert snap["mode"] == "lossless" and snap["kind"] == "base"
        assert snap["bytes"] > 0 and snap["full_bytes"] >= 4 * (32 * 128 + 128 + 128 * 4 + 4) * 3
        assert snap["blocking_ms"] >= 0 and snap["total_ms"] >= snap["blocking_ms"]
        stop.touch()
        _stop(first)
    finally:
        stop.touch()
        _stop(first)
    assert first.returncode == 0, (tmp_path / "first.log").read_text()[-2000:]
    before = {ln["i"]: ln["digest"] for ln in _lines(tmp_path / "first.log")}
    step = snap["step"]
    assert step + 4 <= max(before), "the first run must go on past the snapshot"

    second = _run(cp, snapdir, tmp_path / "second.log", "--restore", "latest", script_args=("--iters", "4"))
    _stop(second)
    assert second.returncode == 0, (tmp_path / "second.log").read_text()[-2000:]
    after = {ln["i"]: ln["digest"] for ln in _lines(tmp_path / "second.log")}
    # The restore happened when the script built its optimizer, before any training: iteration 1 of the restarted
    # run replays the first run's iteration step+1 exactly (weights, Adam state, and the batch its RNG draws).
    assert after[1] == before[step + 1]
    assert after[2] == before[step + 2]
    assert after[3] == before[step + 3]
    restores = [e for e in cp.admin.all_events(types=["restore"]) if e["data"].get("status") == "ok"]
    assert len(restores) == 1 and restores[0]["data"]["id"].endswith(f"/{snap['id'].rsplit('/', 1)[1]}")
    assert restores[0]["data"]["lossless"] is True
    gauge = [
        ln for ln in cp.admin.metrics_text().splitlines() if ln.startswith('dsec_snapshot_recovery_time{pool="pool-a"}')
    ]
    assert gauge and 0 < float(gauge[0].split()[-1]) < 10


def test_restore_without_snapshots_reports_none_and_training_goes_on(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    cp = server_factory(pools=True)
    proc = _run(cp, tmp_path / "empty", tmp_path / "run.log", "--restore", "latest", script_args=("--iters", "3"))
    _stop(proc)
    assert proc.returncode == 0
    assert len(_lines(tmp_path / "run.log")) == 3  # no step skipped: nothing was restored
    events = cp.admin.all_events(types=["restore"])
    assert [e["data"]["status"] for e in events] == ["none"]


def test_restore_flag_is_validated(tmp_path: Path) -> None:
    bad = subprocess.run(
        [str(DSEC), "run", "--restore", "newest", "--snapshot-dir", str(tmp_path), "--", sys.executable, "-c", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "--restore 'newest' is invalid" in bad.stderr
    env = {k: v for k, v in os.environ.items() if k != "DSEC_SNAPSHOT_DIR"}
    nodir = subprocess.run(
        [str(DSEC), "run", "--restore", "latest", "--", sys.executable, "-c", "0"],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert nodir.returncode == 2 and "--restore needs --snapshot-dir" in nodir.stderr


@pytest.mark.slow  # ~20 s of waiting for the interval to stretch; the rule: tests/unit/decide/test_cadence.py
def test_cadence_from_failure_history_stretches_the_interval_of_a_group_that_never_rolled_back(
    server_factory: Callable[..., Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same script twice, snapshots configured every 1 s: ``fixed`` takes one a second; ``failure_history``
    with a long quiet history (what the supervisor passes for ``snapshots.cadence: failure_history``) takes the
    first at 1 s (no cost measured before), then Young's interval for its measured cost — tens of seconds."""
    cp = server_factory(pools=True)
    monkeypatch.setenv("DSEC_SNAPSHOT_INTERVAL_S", "1")
    counts: dict[str, list[dict[str, Any]]] = {}
    for mode in ("fixed", "failure_history"):
        monkeypatch.setenv("DSEC_SNAPSHOT_CADENCE", mode)
        monkeypatch.setenv("DSEC_SNAPSHOT_HISTORY", "1000000:0")
        stop = tmp_path / f"stop-{mode}"
        proc = _run(cp, tmp_path / f"snaps-{mode}", tmp_path / f"{mode}.log", script_args=("--stop-file", str(stop)))
        try:
            wait_for(lambda: cp.admin.workers(state="active"), timeout=60, what=f"the {mode} worker registering")
            wid = cp.admin.workers(state="active")[0]["id"]

            def snaps(w: str = wid) -> list[dict[str, Any]]:
                return [e["data"] for e in cp.admin.all_events(worker_id=w, types=["snapshot"])
                        if e["data"]["status"] == "ok"]  # fmt: skip

            wait_for(snaps, timeout=30, what=f"{mode}: a first snapshot")
            time.sleep(4.0)
            counts[mode] = snaps()
        finally:
            stop.touch()
            _stop(proc)
        assert proc.returncode == 0, (tmp_path / f"{mode}.log").read_text()[-2000:]
        wait_for(lambda: not cp.admin.workers(state="active"), timeout=30, what=f"the {mode} worker leaving")
    assert len(counts["fixed"]) >= 3, counts["fixed"]
    assert "interval_s" not in counts["fixed"][0]
    assert len(counts["failure_history"]) == 1, counts["failure_history"]
    assert counts["failure_history"][0]["interval_s"] >= 30.0  # the floor at least: ~sqrt(2 x cost x 1e6) here
