"""A control plane started on another host against the same PostgreSQL continues with nothing lost.

Two ``dsec serve`` processes on 127.0.0.1, each with its own $DSEC_HOME (nothing is shared but the database, as
between two hosts), against a throwaway PostgreSQL (the ``postgres_url`` fixture; skipped without one): the first is
changed through its API, killed with SIGKILL, and the second, on another port, answers for everything the first
acknowledged: pools and their tokens, workers and their sequence numbers, directive versions, placements, applied
policies, events.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ADMIN_TOKEN
from dsec.client import ApiError, Client
from dsec.control.server import free_port
from pg_cluster import reset_postgres

RULE = """
policies:
  - name: tighten
    when: dsec_melt_down_count >= 3
    for: 5m
    then:
      - knob: latency_cap_ms
        by: -10
"""


@contextmanager
def dsec_serve(home: Path, database_url: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``dsec serve`` in a child process on a free port; yields it and its URL once it answers; stops it (if the
    test did not kill it)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update(DSEC_HOME=str(home), DSEC_DATABASE_URL=database_url, DSEC_ADMIN_TOKEN=ADMIN_TOKEN)
    cmd = [sys.executable, "-m", "dsec.cli", "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                assert proc.stderr is not None
                pytest.fail(f"dsec serve exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("dsec serve did not answer within 60 s")
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()


def job(name: str, workers: int) -> dict[str, Any]:
    group = {"name": "g", "workers": [{"name": f"{name}-{i}"} for i in range(workers)]}
    return {"name": name, "pool": "pool-x", "groups": [group]}


def change_everything(admin: Client) -> dict[str, Any]:
    """Every kind of state change, each acknowledged by the first control plane; what the second must answer."""
    admin.put_pool("pool-x", memory_base_gb=2, memory_ceiling_gb=3)
    pool_token = admin.create_token("pool-x", label="takeover")
    for i in range(3):
        admin.request("PUT", f"/v1/devices/gpu{i}", json={"id": f"gpu{i}", "node": "n0", "memory_gb": 80})
    workers = []
    for rank in range(2):
        reg = admin.register("pool-x", role="learner", rank=rank, token=pool_token)
        workers.append((reg["worker_id"], reg["worker_token"]))
    (w0, t0), (w1, t1) = workers
    admin.heartbeat(w0, 1, events=[{"type": "log", "data": {"msg": "first"}}], token=t0)
    directive = admin.set_directive(w0, compression_bits=8)
    # The worker acks version 2 in a beat that carries an event: committed before the answer.
    admin.heartbeat(w0, 2, acked_directive_version=2, events=[{"type": "log", "data": {"msg": "acked"}}], token=t0)
    admin.heartbeat(w1, 1, events=[{"type": "anomaly", "data": {"score": 0.9}}], token=t1)
    admin.set_directive(w1, snapshot_now="req-1")
    admin.set_directive(w1, grad_accum_steps=2)  # desired 3, never acked
    placement = admin.place(job("job-1", 2))
    policies = admin.put_policies(RULE, "tighten.yaml")
    admin.record_event("log", {"text": "by hand"}, pool="pool-x")
    return {
        "pool_token": pool_token,
        "workers": workers,
        "directive": directive,
        "placement": placement,
        "policies": policies,
        "events": admin.all_events(),
        "pools": admin.pools(),
    }


@pytest.mark.slow  # two `dsec serve` starts and PostgreSQL: ~40 s on 2 busy cores
@pytest.mark.timeout(300)
def test_a_second_control_plane_takes_over_after_the_first_is_killed(postgres_url: str, tmp_path: Path) -> None:
    reset_postgres(postgres_url)
    with dsec_serve(tmp_path / "host-1", postgres_url) as (first, url), Client(url, token=ADMIN_TOKEN) as admin:
        before = change_everything(admin)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)

    with dsec_serve(tmp_path / "host-2", postgres_url) as (_, url2), Client(url2, token=ADMIN_TOKEN) as admin:
        assert url2 != url
        # Every acknowledged event, identical (ids, timestamps, data); pools as they were.
        assert admin.all_events()[: len(before["events"])] == before["events"]
        assert admin.pools() == before["pools"]
        (w0, t0), (w1, t1) = before["workers"]
        # Directive versions do not go backwards: the acked one, and the one never acked.
        d0, d1 = admin.directive(w0), admin.directive(w1)
        assert (d0["desired_version"], d0["acked_version"], d0["desired"]["compression_bits"]) == (2, 2, 8)
        assert (d1["desired_version"], d1["desired"]["grad_accum_steps"]) == (3, 2)
        assert admin.set_directive(w1, grad_accum_steps=4)["desired_version"] == 4
        # Workers go on with their own tokens and sequence numbers: the last event beat is a duplicate now.
        assert admin.heartbeat(w0, 2, acked_directive_version=2, token=t0)["duplicate"] is True
        assert admin.heartbeat(w0, 3, acked_directive_version=2, token=t0)["duplicate"] is False
        assert admin.heartbeat(w1, 2, acked_directive_version=3, token=t1)["directive"]["version"] == 4
        assert admin.register("pool-x", token=before["pool_token"])["worker_id"]
        # The placement holds its devices: a second job gets the one left, not job-1's.
        assert admin.placement("job-1") == before["placement"]
        taken = {a["device"] for a in before["placement"]["assignments"]}
        second = admin.place(job("job-2", 1))
        assert {a["device"] for a in second["assignments"]}.isdisjoint(taken)
        with pytest.raises(ApiError):
            admin.request("GET", "/v1/placements/job-never")
        # The applied policy, at its version.
        after = admin.policies()
        assert (after["version"], after["source"], [r["name"] for r in after["rules"]]) == (1, "tighten.yaml",
                                                                                            ["tighten"])  # fmt: skip
        assert before["policies"]["version"] == 1
