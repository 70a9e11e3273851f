"""The probe on a learner that averages its gradients itself (no DDP): examples/a2c_cartpole_allreduce.py with two
real gloo ranks under `dsec run`, against a real control plane. Its all-reduces are judged as gradient sync, a
4-bit directive is acked and shrinks the upload, accumulation is answered ``directive_unappliable`` (event and
worker view), and the replicas stay identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, stop_process_group, wait_for

pytest.importorskip("torch")
pytest.importorskip("gymnasium")

EXAMPLE = Path(__file__).resolve().parents[2] / "src" / "dsec" / "data" / "a2c_cartpole_allreduce.py"
DSEC = Path(sys.executable).with_name("dsec")


def _by_rank(server: Harness) -> dict[int, dict[str, Any]]:
    # Active or lost: a loaded machine may miss beats for a moment (lost, then active again on the next beat).
    return {w["rank"]: w for w in server.admin.workers() if w["state"] != "deregistered"}


def _settled(server: Harness, rank: int, name: str, beats: int = 3) -> float:
    start = _by_rank(server)[rank]["beats"]
    wait_for(lambda: _by_rank(server)[rank]["beats"] >= start + beats, timeout=20, what=f"{beats} beats")
    return float(_by_rank(server)[rank]["metrics"].get(name, 0.0))


# Per-parameter all-reduce in make test-slow (~10 s): the flat-buffer loop stays in the default run.
@pytest.mark.parametrize("sync", [pytest.param("param", marks=pytest.mark.slow), "flat"])
def test_hand_written_gradient_all_reduce(server: Harness, tmp_path: Path, sync: str) -> None:
    stop, out, log = tmp_path / "stop", tmp_path / "out.json", tmp_path / "job.log"
    env = {**os.environ, "DSEC_HEARTBEAT_INTERVAL": "0.3", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [
        str(DSEC), "run", "--endpoint", server.url, "--sandbox-id", "pool-a", "--token", server.pool_tokens["pool-a"],
        "--role", "learner", "--",
        sys.executable, str(EXAMPLE), "--world-size", "2", "--sync", sync, "--sleep", "0.003", "--log-every", "0",
        "--stop-file", str(stop), "--out", str(out),
    ]  # fmt: skip
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
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
            assert m["sync_errors_total"] == 0
            for key in ("sync_latency_ms_p99", "sync_cost_ms_p50", "grad_upload_bytes_per_s", "bytes_per_sync"):
                assert key in m, key
        fp32 = _settled(server, 1, "bytes_per_sync")

        d = server.admin.set_directive(ranks[1]["id"], compression_bits=4)
        wait_for(
            lambda: server.admin.directive(ranks[1]["id"])["acked_version"] >= d["desired_version"],
            timeout=20,
            what="4-bit ack",
        )
        four = _settled(server, 1, "bytes_per_sync")
        assert _by_rank(server)[1]["metrics"]["compression_bits"] == 4
        # Per-parameter syncs include biases of a few values (whole 256-value blocks + the 32-byte header).
        assert fp32 / four >= (6.0 if sync == "flat" else 2.0), (fp32, four)

        d = server.admin.set_directive(ranks[0]["id"], grad_accum_steps=4)

        def unappliable() -> list[dict[str, Any]]:
            page = server.admin.events(worker_id=ranks[0]["id"], types=["directive_unappliable"])
            return list(page["items"])

        events = wait_for(unappliable, timeout=20, what="directive_unappliable event")
        assert events[0]["data"]["field"] == "grad_accum_steps" and events[0]["data"]["reason"]
        assert events[0]["data"]["version"] == d["desired_version"]
        view = server.admin.directive(ranks[0]["id"])
        w0 = _by_rank(server)[0]
        assert "grad_accum_steps" in w0["directive"]["unappliable"], w0["directive"]
        assert view["acked_version"] < d["desired_version"]
        assert w0["metrics"]["grad_accum_steps"] == 1

        stop.touch()
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        result = json.loads(out.read_text())
        assert result["finite"] and result["replica_max_abs_diff"] == 0.0, result
    finally:
        stop.touch()
        stop_process_group(proc)
