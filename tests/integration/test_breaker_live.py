"""The breaker end to end on real DDP processes (gloo on 127.0.0.1) under `dsec run`: latency injected
into one rank's gradient sync -> only that rank escalates, the directive is applied (its bytes per sync
drop), its peer is untouched, and after the injection stops it steps back down to level 0."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, make_settings, stop_process_group, wait_for
from dsec.breaker import BreakerConfig
from dsec.control.judge import JudgeConfig
from dsec.control.server import free_port

pytest.importorskip("torch")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ddp_toy.py"
DSEC = Path(sys.executable).with_name("dsec")


@pytest.fixture
def cp(server_factory: Callable[..., Harness], tmp_path: Path) -> Harness:
    judge = JudgeConfig(breaker=BreakerConfig(window_s=1.5, min_samples=3, recovery_s=1.5, max_recovery_s=6.0))
    return server_factory(settings=make_settings(tmp_path / "cp", judge=judge), pools=True)


@pytest.fixture
def job(cp: Harness, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    stop, out, log = tmp_path / "stop", tmp_path / "out.json", tmp_path / "job.log"
    env = {
        **os.environ,
        "DSEC_HEARTBEAT_INTERVAL": "0.25",
        "GLOO_SOCKET_IFNAME": "lo",
        "DSEC_COMPRESSION_BITS": "8",
        # Rank 1 arrives 150 ms late at every gradient sync for 6 s, starting 4 s after it starts.
        "DSEC_CHAOS": "sync_delay_ms=150,rank=1,after_s=4,for_s=6",
    }
    cmd = [
        str(DSEC), "run", "--endpoint", cp.url, "--sandbox-id", "pool-a", "--token", cp.pool_tokens["pool-a"],
        "--role", "learner", "--", sys.executable, str(FIXTURE), "--port", str(free_port()),
        "--stop-file", str(stop), "--out", str(out), "--sleep", "0.02",
    ]  # fmt: skip
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    yield proc, stop, log
    stop.touch()
    stop_process_group(proc)


def _ranks(cp: Harness) -> dict[int, dict[str, Any]]:
    return {w["rank"]: w for w in cp.admin.workers(state="active")}


def _events(cp: Harness, worker_id: str, *types: str) -> list[dict[str, Any]]:
    return [e for e in cp.admin.events(worker_id=worker_id, limit=1000)["items"] if e["type"] in types]


def test_injected_sync_latency_degrades_only_the_slow_rank_and_it_recovers(
    cp: Harness, job: tuple[subprocess.Popen[bytes], Path, Path]
) -> None:
    proc, stop, log = job
    wait_for(
        lambda: len(_ranks(cp)) == 2 and all(w["metrics"].get("sync_ops_total", 0) > 5 for w in _ranks(cp).values()),
        timeout=60,
        what="both ranks reporting syncs",
    )
    ranks = _ranks(cp)
    slow, punctual = ranks[1]["id"], ranks[0]["id"]
    healthy_bytes = ranks[1]["metrics"]["bytes_per_sync"]

    # Detected on rank 1 only, by its own lateness (sync cost), and answered with 4-bit compression.
    wait_for(lambda: _events(cp, slow, "meltdown"), timeout=30, what="rank 1 meltdown")
    melt = _events(cp, slow, "meltdown")[0]["data"]
    assert melt["level_to"] == 1 and "latency_ms" in melt["evidence"]["over"], melt
    assert melt["evidence"]["over"]["latency_ms"]["median"] >= 100
    wait_for(lambda: _ranks(cp)[1]["metrics"].get("compression_bits") == 4, timeout=20, what="4-bit in force")
    wait_for(
        lambda: _ranks(cp)[1]["metrics"].get("bytes_per_sync", healthy_bytes) < healthy_bytes / 1.7,
        timeout=20,
        what="rank 1's bytes per sync dropping under 4-bit",
    )
    # It keeps escalating one acked level at a time while the fault lasts.
    wait_for(lambda: _ranks(cp)[1]["breaker"]["level"] >= 2, timeout=30, what="rank 1 at level 2")

    # After the injection stops: stepped down to level 0, breaker closed, directive back to the baseline.
    def recovered() -> bool:
        w = _ranks(cp)[1]
        return w["breaker"]["phase"] == "closed" and w["directive"]["in_sync"]

    wait_for(recovered, timeout=60, what="rank 1 recovered to level 0")
    final = _ranks(cp)[1]["directive"]["desired"]
    assert (final["compression_bits"], final["grad_accum_steps"], final["async_sampling"]) == (None, 1, True)
    assert _events(cp, slow, "recovered")
    steps_down = [e["data"]["level_to"] for e in _events(cp, slow, "breaker") if e["data"]["action"] == "step_down"]
    assert steps_down and steps_down == sorted(steps_down, reverse=True), steps_down

    # The punctual rank was never touched: no breaker transitions, level 0, and low sync cost.
    assert _events(cp, punctual, "meltdown", "breaker", "recovered") == []
    w0 = _ranks(cp)[0]
    assert w0["breaker"]["level"] == 0 and w0["meltdowns"] == 0
    status = cp.admin.status()
    pool = next(p for p in status["pools"] if p["name"] == "pool-a")
    assert pool["meltdowns"] == 1

    stop.touch()
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
