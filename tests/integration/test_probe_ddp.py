"""The zero-touch probe on real DDP processes (gloo on 127.0.0.1) under `dsec run`, against a real
control plane: metrics for every rank, compression and accumulation directives applied and acked,
ranks kept identical, and training that never waits for the control plane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, make_settings, stop_process_group, wait_for
from dsec.control.server import free_port

pytest.importorskip("torch")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ddp_toy.py"
DSEC = Path(sys.executable).with_name("dsec")


@dataclass
class Job:
    proc: subprocess.Popen[bytes]
    stop_file: Path
    out: Path
    log: Path

    def result(self, timeout: float = 60) -> dict[str, Any]:
        self.stop_file.touch()
        code = self.proc.wait(timeout=timeout)
        assert code == 0, self.log.read_text()[-3000:]
        return dict(json.loads(self.out.read_text()))


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def start(endpoint: str, token: str, pool: str = "pool-a", extra_env: dict[str, str] | None = None) -> Job:
        n = len(jobs)
        stop, out, log = tmp_path / f"stop{n}", tmp_path / f"out{n}.json", tmp_path / f"job{n}.log"
        env = {**os.environ, "DSEC_HEARTBEAT_INTERVAL": "0.3", "GLOO_SOCKET_IFNAME": "lo", **(extra_env or {})}
        cmd = [
            str(DSEC),
            "run",
            "--endpoint",
            endpoint,
            "--sandbox-id",
            pool,
            "--token",
            token,
            "--role",
            "learner",
            "--",
            sys.executable,
            str(FIXTURE),
            "--port",
            str(free_port()),
            "--stop-file",
            str(stop),
            "--out",
            str(out),
        ]
        with log.open("wb") as fh:
            proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        job = Job(proc, stop, out, log)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.stop_file.touch()
        stop_process_group(job.proc)


def _by_rank(server: Harness) -> dict[int, dict[str, Any]]:
    return {w["rank"]: w for w in server.admin.workers(state="active")}


def _metric(server: Harness, rank: int, name: str) -> float:
    return float(_by_rank(server)[rank]["metrics"].get(name, 0.0))


def _settled(server: Harness, rank: int, name: str, beats: int = 3) -> float:
    """The metric after a few more beats, so a whole interval ran under the current setting."""
    start = _by_rank(server)[rank]["beats"]
    wait_for(lambda: _by_rank(server)[rank]["beats"] >= start + beats, timeout=20, what=f"{beats} beats")
    return _metric(server, rank, name)


def _acked(server: Harness, worker_id: str, version: int) -> bool:
    d = server.admin.directive(worker_id)
    return bool(d["acked_version"] >= version)


def test_metrics_compression_and_accumulation(server: Harness, launch: Callable[..., Job]) -> None:
    job = launch(server.url, server.pool_tokens["pool-a"])
    wait_for(
        lambda: (
            len(_by_rank(server)) == 2
            and all(w["metrics"].get("sync_ops_total", 0) > 10 for w in _by_rank(server).values())
        ),
        timeout=60,
        what="both ranks reporting gradient syncs",
    )
    ranks = _by_rank(server)
    for w in ranks.values():
        m = w["metrics"]
        assert w["role"] == "learner" and w["pool"] == "pool-a"
        for key in (
            "updates_total",
            "grad_norm",
            "sync_latency_ms_p50",
            "sync_latency_ms_p99",
            "grad_upload_bytes_per_s",
            "memory_used_gb",
            "collective_ops_total",
            "compute_ms_p50",
        ):
            assert key in m, key
        assert m["sync_errors_total"] == 0
        assert 0 < m["compute_ms_p50"] < 60_000
    fp32 = _settled(server, 1, "bytes_per_sync")

    # 4-bit on rank 1 only: its upload shrinks >= 6x; rank 0 keeps sending float32.
    d = server.admin.set_directive(ranks[1]["id"], compression_bits=4)
    wait_for(lambda: _acked(server, ranks[1]["id"], d["desired_version"]), timeout=20, what="4-bit ack")
    four = _settled(server, 1, "bytes_per_sync")
    assert fp32 / four >= 6.0, (fp32, four)
    assert _metric(server, 1, "compression_bits") == 4
    assert _settled(server, 0, "bytes_per_sync", beats=1) == pytest.approx(fp32, rel=0.01)

    d = server.admin.set_directive(ranks[1]["id"], compression_bits=8)
    wait_for(lambda: _acked(server, ranks[1]["id"], d["desired_version"]), timeout=20, what="8-bit ack")
    eight = _settled(server, 1, "bytes_per_sync")
    assert fp32 / eight >= 3.5, (fp32, eight)

    # Accumulate 4 steps (asked of rank 0; the group runs the largest accumulation any rank asks for).
    d = server.admin.set_directive(ranks[0]["id"], grad_accum_steps=4)
    wait_for(lambda: _acked(server, ranks[0]["id"], d["desired_version"]), timeout=20, what="accum ack")
    _settled(server, 0, "sync_ops_total", beats=2)  # the interval that held the switch is over
    before = {r: _by_rank(server)[r]["metrics"] for r in (0, 1)}
    _settled(server, 0, "sync_ops_total", beats=4)
    after = {r: _by_rank(server)[r]["metrics"] for r in (0, 1)}
    for r in (0, 1):
        syncs = after[r]["sync_ops_total"] - before[r]["sync_ops_total"]
        updates = after[r]["updates_total"] - before[r]["updates_total"]
        skipped = after[r]["skipped_updates_total"] - before[r]["skipped_updates_total"]
        backwards = updates + skipped
        assert after[r]["grad_accum_steps"] == 4
        assert backwards >= 20
        # one sync (and one optimizer update) per 4 backward passes, give or take the window's edges
        assert syncs / backwards == pytest.approx(0.25, abs=0.06), (syncs, backwards)
        assert updates == pytest.approx(syncs, abs=2)

    result = job.result()
    assert result["finite"] and result["max_param_diff"] == 0.0, result


def test_training_never_waits_for_the_control_plane(
    server_factory: Callable[..., Harness], tmp_path: Path, launch: Callable[..., Job]
) -> None:
    port = free_port()
    settings = make_settings(tmp_path / "cp")
    # Control plane down at start: the job trains anyway.
    bootstrap = server_factory(settings=settings, pools=True)
    token = bootstrap.pool_tokens["pool-a"]
    bootstrap.close()
    job = launch(f"http://127.0.0.1:{port}", token)
    time.sleep(4)
    assert job.proc.poll() is None, job.log.read_text()[-2000:]

    # Up: both ranks register; a directive is delivered and acked.
    cp = server_factory(settings=settings, port=port)
    wait_for(lambda: len(_by_rank(cp)) == 2, timeout=40, what="ranks registering after the control plane came up")
    w1 = _by_rank(cp)[1]
    d = cp.admin.set_directive(w1["id"], compression_bits=8)
    wait_for(lambda: _acked(cp, w1["id"], d["desired_version"]), timeout=20, what="8-bit ack")

    # Down mid-run: training continues with the last directive (fail-static).
    cp.close()
    time.sleep(3)
    assert job.proc.poll() is None, job.log.read_text()[-2000:]

    # Back on the same file and port: the same workers resume beating and take new directives.
    cp2 = server_factory(settings=settings, port=port)
    wait_for(
        lambda: _by_rank(cp2).get(1, {}).get("id") == w1["id"] and _by_rank(cp2)[1]["beats"] > w1["beats"],
        timeout=30,
        what="rank 1 beating again after restart",
    )
    d = cp2.admin.set_directive(w1["id"], compression_bits=4)
    wait_for(lambda: _acked(cp2, w1["id"], d["desired_version"]), timeout=20, what="4-bit ack after restart")
    assert _by_rank(cp2)[1]["metrics"]["compression_bits"] in (8.0, 4.0)
    result = job.result()
    assert result["max_param_diff"] == 0.0 and result["steps"] > 100
