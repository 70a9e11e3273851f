"""Framework coverage (issue 18 item 3): a DDP job started with ``torch.multiprocessing.spawn`` under `dsec run`
with no --role, against a real control plane. The spawned ranks (children of the script's process, not of `dsec
run`) are reached by the probe, inferred learners from what they do, their DDP syncs judged, a 4-bit directive
acked by the rank it names, and at the job's normal end every rank is deregistered with reason ``exit`` — none lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, stop_process_group, wait_for
from dsec.control.server import free_port

pytest.importorskip("torch")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ddp_toy.py"
DSEC = Path(sys.executable).with_name("dsec")


def _ranks(server: Harness) -> dict[int, dict[str, Any]]:
    return {w["rank"]: w for w in server.admin.workers(pool="pool-a") if w["rank"] is not None}


def test_mp_spawn_ranks_are_learners_judged_compressed_and_end_deregistered(server: Harness, tmp_path: Path) -> None:
    stop, out, log = tmp_path / "stop", tmp_path / "out.json", tmp_path / "job.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update({"DSEC_HEARTBEAT_INTERVAL": "0.3", "GLOO_SOCKET_IFNAME": "lo"})
    cmd = [
        str(DSEC), "run", "--endpoint", server.url, "--sandbox-id", "pool-a", "--token", server.pool_tokens["pool-a"],
        "--", sys.executable, str(FIXTURE), "--world", "2", "--port", str(free_port()), "--sleep", "0.005",
        "--stop-file", str(stop), "--out", str(out),
    ]  # fmt: skip
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(
            lambda: (
                sorted(_ranks(server)) == [0, 1]
                and all(w["role"] == "learner" for w in _ranks(server).values())
                and all(w["metrics"].get("sync_ops_total", 0) > 10 for w in _ranks(server).values())
            ),
            timeout=90,
            what="two spawned ranks inferred learners, reporting gradient syncs",
        )
        ranks = _ranks(server)
        for w in ranks.values():
            assert w["metrics"].get("sync_errors_total", 0) == 0
            assert "sync_latency_ms_p99" in w["metrics"] and "bytes_per_sync" in w["metrics"]
        d = server.admin.set_directive(ranks[1]["id"], compression_bits=4)
        wait_for(
            lambda: server.admin.directive(ranks[1]["id"])["acked_version"] >= d["desired_version"],
            timeout=30,
            what="rank 1 acking 4-bit compression",
        )
        wait_for(
            lambda: _ranks(server)[1]["metrics"].get("compression_bits") == 4,
            timeout=20,
            what="rank 1 reporting 4-bit syncs",
        )
        stop.touch()
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
    finally:
        stop.touch()
        stop_process_group(proc)
    assert json.loads(out.read_text())["max_param_diff"] == 0.0
    for w in _ranks(server).values():
        assert w["state"] == "deregistered", w
        [inferred] = server.admin.all_events(worker_id=w["id"], types=["role_inferred"])
        assert inferred["data"]["to"] == "learner"
        [dereg] = server.admin.all_events(worker_id=w["id"], types=["deregistered"])
        assert dereg["data"]["reason"] == "exit"
    assert not [w for w in server.admin.workers(pool="pool-a") if w["state"] == "lost"]
