"""Replicas of a DDP group stay identical through snapshots and restores, and drift is caught: real ranks (gloo on
127.0.0.1) under `dsec run` against a real control plane.

- the ranks' periodic snapshots are group snapshots: every rank holds the same steps;
- a group restarted from snapshots taken at *different* steps restores the newest step that verifies on some rank
  (ranks without it receive a verified copy) and ends with bit-identical parameters; ranks that all hold it intact
  restore their own; nothing that verifies anywhere: nothing restored, and the event says why;
- a rank whose weights leave the group's is reported (``replica_drift`` anomaly, critical alert) by the drift check.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness
from dsec.control.server import free_port

torch = pytest.importorskip("torch")

from dsec.snapshot import LocalDirStore, Snapshotter  # noqa: E402
from dsec.snapshot.reader import read_manifest  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ddp_toy.py"
DSEC = Path(sys.executable).with_name("dsec")


@pytest.fixture
def jobs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:  # the whole session: the wrapper, mp.spawn's parent and its ranks
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _run(
    cp: Harness,
    jobs: list[subprocess.Popen[bytes]],
    tmp: Path,
    *,
    world: int,
    steps: int,
    snapdir: Path | None = None,
    restore: bool = False,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    role: str | None = "learner",
) -> dict[str, Any]:
    n = len(jobs)
    out, log = tmp / f"out{n}.json", tmp / f"job{n}.log"
    cmd = [
        str(DSEC), "run", "--endpoint", cp.url, "--sandbox-id", "pool-a", "--token", cp.pool_tokens["pool-a"],
    ]  # fmt: skip
    if role is not None:
        cmd += ["--role", role]
    if snapdir is not None:
        cmd += ["--snapshot-dir", str(snapdir)]
    if restore:
        cmd += ["--restore", "latest"]
    cmd += ["--", sys.executable, str(FIXTURE), "--world", str(world), "--port", str(free_port()),
            "--stop-file", str(tmp / "never"), "--out", str(out), "--max-steps", str(steps), *args]  # fmt: skip
    full_env = {**os.environ, "DSEC_HEARTBEAT_INTERVAL": "0.2", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=full_env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    jobs.append(proc)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    return dict(json.loads(out.read_text()))


def _events(cp: Harness, kind: str) -> list[dict[str, Any]]:
    return list(cp.admin.all_events(types=[kind]))


def _steps_held(snapdir: Path, worker: str) -> set[int]:
    store = LocalDirStore(snapdir)
    return {int(read_manifest(store, worker, seq)["step"]) for seq in store.manifests(worker)}


def test_ranks_snapshot_at_the_same_steps(server: Harness, jobs: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    snapdir = tmp_path / "snaps"
    result = _run(
        server,
        jobs,
        tmp_path,
        world=2,
        steps=160,
        snapdir=snapdir,
        env={"DSEC_SNAPSHOT_INTERVAL_S": "0.3"},
        args=("--sleep", "0.01"),
    )
    assert result["max_param_diff"] == 0.0
    held = [_steps_held(snapdir, f"default-learner-{r}") for r in range(2)]
    # Per-rank timers would give each rank its own steps; group snapshots give both the same ones.
    assert len(held[0]) >= 3 and held[0] == held[1], held
    # The drift check ran (first step, then every 100 synchronized steps) and found the replicas identical.
    workers = server.admin.workers()
    assert len(workers) == 2
    for w in workers:
        assert w["metrics"].get("replica_checks_total", 0) >= 2, w["metrics"]
        assert w["metrics"].get("replica_drift_total") == 0
    assert not [e for e in _events(server, "anomaly") if e["data"].get("kind") == "replica_drift"]


def _write_snapshots(snapdir: Path, worker: str, rank: int, steps: list[int]) -> dict[int, int]:
    """Snapshots of the fixture's model (names as the probe registers them) whose weights encode their step;
    the RNG state differs per rank, so each rank's snapshot has a chunk of its own. Returns step -> seq."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seqs = {}
    with Snapshotter(LocalDirStore(snapdir), worker, level=0) as snap:
        snap.register("model0", model)
        snap.register("optim0", opt)
        for step in steps:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(step / 1000.0)
            torch.manual_seed(1000 * rank + step)
            ticket = snap.take(step=step, wait=True)
            assert ticket.seq is not None
            seqs[step] = ticket.seq
    return seqs


def _damage(snapdir: Path, worker: str, seq: int) -> None:
    """Flip one bit in the snapshot's RNG chunk (its own: the state differs per rank and step)."""
    store = LocalDirStore(snapdir)
    chunk = read_manifest(store, worker, seq)["tensors"]["rng/torch"]["chunk"]
    path = snapdir / "chunks" / chunk[:2] / chunk
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _restores(cp: Harness) -> dict[int, dict[str, Any]]:
    """The restore event of each rank, by rank."""
    return {int(e["data"]["rank"]): e["data"] for e in _events(cp, "restore")}


def test_ranks_holding_the_same_newest_step_each_restore_their_own(
    server: Harness, jobs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    snapdir = tmp_path / "snaps"
    _write_snapshots(snapdir, "default-learner-0", 0, [10, 20])
    _write_snapshots(snapdir, "default-learner-1", 1, [10, 20])
    result = _run(server, jobs, tmp_path, world=2, steps=5, snapdir=snapdir, restore=True)
    assert result["max_param_diff"] == 0.0 and result["finite"]
    restores = _restores(server)
    assert sorted(restores) == [0, 1] and {d["status"] for d in restores.values()} == {"ok"}, restores
    assert {d["agreed_step"] for d in restores.values()} == {20}
    assert not any("source_rank" in d for d in restores.values())  # nothing travelled: each had it intact


def test_the_newest_step_that_verifies_anywhere_is_shipped_to_the_ranks_without_it(
    server: Harness, jobs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    snapdir = tmp_path / "snaps"
    seqs0 = _write_snapshots(snapdir, "default-learner-0", 0, [10, 20, 30])
    _write_snapshots(snapdir, "default-learner-1", 1, [10, 20, 25])
    _damage(snapdir, "default-learner-0", seqs0[30])

    result = _run(server, jobs, tmp_path, world=2, steps=5, snapdir=snapdir, restore=True)
    # 30 (rank 0 only) is damaged; 25 is held by rank 1 only and verifies: rank 1 sends it to rank 0, and both
    # resume at step 25 with identical parameters — not at 20, the newest step both hold intact.
    assert result["max_param_diff"] == 0.0 and result["finite"]
    restores = _restores(server)
    assert sorted(restores) == [0, 1] and {d["status"] for d in restores.values()} == {"ok"}, restores
    assert {d["agreed_step"] for d in restores.values()} == {25} and {d["step"] for d in restores.values()} == {25}
    assert {d["source_rank"] for d in restores.values()} == {1}
    assert restores[0]["shipped_bytes"] > 0
    skipped = [e["data"] for e in _events(server, "snapshot") if e["data"].get("status") == "skipped"]
    assert [d["id"] for d in skipped] == [f"default-learner-0/{seqs0[30]}"]


def test_a_step_damaged_on_one_rank_is_shipped_from_a_rank_that_holds_it_intact(
    server: Harness, jobs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    snapdir = tmp_path / "snaps"
    _write_snapshots(snapdir, "default-learner-0", 0, [10, 20])
    seqs1 = _write_snapshots(snapdir, "default-learner-1", 1, [10, 20])
    _damage(snapdir, "default-learner-1", seqs1[20])
    result = _run(server, jobs, tmp_path, world=2, steps=3, snapdir=snapdir, restore=True)
    assert result["max_param_diff"] == 0.0 and result["finite"]
    restores = _restores(server)
    assert {d["status"] for d in restores.values()} == {"ok"}, restores
    assert {d["agreed_step"] for d in restores.values()} == {20} and {d["source_rank"] for d in restores.values()} == {
        0
    }
    skipped = [e["data"] for e in _events(server, "snapshot") if e["data"].get("status") == "skipped"]
    assert [d["id"] for d in skipped] == [f"default-learner-1/{seqs1[20]}"]


def test_survivors_far_ahead_of_a_dead_rank_bring_it_to_their_step(
    server: Harness, jobs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """Healing that fails late: the survivor trained and snapshotted long after the dead rank's last snapshot, and
    retention dropped every step both held. The group restarts at the survivor's newest step, not from scratch."""
    snapdir = tmp_path / "snaps"
    _write_snapshots(snapdir, "default-learner-0", 0, [9153, 9277])
    _write_snapshots(snapdir, "default-learner-1", 1, [1205, 1472])
    result = _run(server, jobs, tmp_path, world=2, steps=3, snapdir=snapdir, restore=True)
    assert result["max_param_diff"] == 0.0 and result["finite"]
    restores = _restores(server)
    assert {d["status"] for d in restores.values()} == {"ok"}, restores
    assert {d["agreed_step"] for d in restores.values()} == {9277} and {
        d["source_rank"] for d in restores.values()
    } == {0}


def test_a_group_with_no_snapshot_that_verifies_restores_nothing_and_says_why(
    server: Harness, jobs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    snapdir = tmp_path / "snaps"
    seqs = _write_snapshots(snapdir, "default-learner-0", 0, [10])
    _damage(snapdir, "default-learner-0", seqs[10])
    result = _run(server, jobs, tmp_path, world=2, steps=3, snapdir=snapdir, restore=True)
    assert result["max_param_diff"] == 0.0
    restores = _restores(server)
    assert [d["status"] for d in restores.values()] == ["none", "none"], restores
    assert all("no step verifies" in d["message"] and "step 10" in d["message"] for d in restores.values())


def test_a_rank_that_drifts_is_reported(server: Harness, jobs: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    result = _run(
        server,
        jobs,
        tmp_path,
        world=3,
        steps=40,
        env={"DSEC_DRIFT_CHECK_STEPS": "5"},
        args=("--perturb-rank", "1", "--perturb-step", "12"),
    )
    assert result["max_param_diff"] > 0.0  # the fixture's own check agrees that the replicas differ
    ranks = {w["id"]: w["rank"] for w in server.admin.workers()}
    drift = [e for e in _events(server, "anomaly") if e["data"].get("kind") == "replica_drift"]
    assert drift and {ranks[e["worker_id"]] for e in drift} == {1}
    first = min(drift, key=lambda e: e["data"]["step"])["data"]
    # Perturbed after step 12; fingerprints are due at syncs 15, 20, ... and taken at the first header step after
    # (with the default header every sync: 16; with DSEC_HEADER_EVERY=8 it is 25).
    assert first["step"] == 16 and first["drifted_ranks"] == [1] and first["majority"] is not None
    alerts = [e for e in _events(server, "alert") if "replica_drift" in str(e["data"].get("name", ""))]
    assert alerts and alerts[0]["data"]["severity"] == "critical"


@pytest.mark.slow  # ~16 s; the other restore tests of this file stay in the default run
def test_without_role_the_snapshot_names_are_stable_and_a_restart_restores(
    server: Harness, jobs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """`dsec run` without --role (roles inferred): the ranks' snapshots carry the names a restart — by `dsec run` or by
    `dsec launch`, whose groups are learners — looks for, so the restart restores them (it did not: the name took the
    not-yet-inferred role, ``other``)."""
    snapdir = tmp_path / "snaps"
    env = {"DSEC_SNAPSHOT_INTERVAL_S": "0.3"}
    _run(server, jobs, tmp_path, world=2, steps=120, snapdir=snapdir, env=env, args=("--sleep", "0.01"), role=None)
    assert sorted(LocalDirStore(snapdir).workers()) == ["default-learner-0", "default-learner-1"]
    held = _steps_held(snapdir, "default-learner-0")
    result = _run(server, jobs, tmp_path, world=2, steps=3, snapdir=snapdir, restore=True, role=None)
    assert result["max_param_diff"] == 0.0
    restores = _restores(server)
    assert {d["status"] for d in restores.values()} == {"ok"}, restores
    assert {d["agreed_step"] for d in restores.values()} == {max(held)}


def test_a_burst_on_one_rank_is_snapshotted_by_the_whole_group_at_one_step_before_its_oom(
    server: Harness, jobs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """The burst snapshot (dsec.probe.recycle) asked for by one rank of a DDP group: the ranks agree on it in the sync
    header and each writes its snapshot at the same step, before the bursting rank's OOM; no periodic snapshot here
    (no interval), so those are the only ones and a restart of the group restores one agreed step."""
    snapdir = tmp_path / "snaps"
    n = len(jobs)
    out, log = tmp_path / f"out{n}.json", tmp_path / f"job{n}.log"
    token = server.pool_tokens["pool-a"]
    cmd = [str(DSEC), "run", "--endpoint", server.url, "--sandbox-id", "pool-a", "--token", token, "--role", "learner",
           "--snapshot-dir", str(snapdir), "--", sys.executable, str(FIXTURE), "--world", "2", "--port",
           str(free_port()), "--stop-file", str(tmp_path / "never"), "--out", str(out), "--max-steps", "3000",
           "--sleep", "0.01"]  # fmt: skip
    env = {
        **os.environ,
        "DSEC_HEARTBEAT_INTERVAL": "0.2",
        "GLOO_SOCKET_IFNAME": "lo",
        # Both ranks hold 2 GB of a 6 GB card; rank 0 bursts at 0.4 GB/s from 1 s on and fills it ~5 s later.
        "DSEC_FAKE_CARD": f"path={tmp_path / 'card0'},memory_gb=6,base_gb=2",
        "DSEC_CHAOS": "memory_growth_mb_per_s=410,max_mb=4096,rank=0,after_s=1",
    }
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    jobs.append(proc)
    assert proc.wait(timeout=120) != 0, log.read_text()[-3000:]  # rank 0's OOM ends the job
    text = log.read_text()
    assert "OutOfMemoryError" in text and "the card has 6 GiB" in text, text[-3000:]
    held = [_steps_held(snapdir, f"default-learner-{r}") for r in range(2)]
    assert held[0] and held[0] == held[1], held  # the same steps on both ranks: agreed, not one rank's own
    bursts = [e for e in _events(server, "log") if "memory_burst_snapshot" in e["data"]]
    assert bursts and bursts[0]["data"]["room_gb"] == pytest.approx(4.0, abs=0.01), bursts
    ooms = [e for e in _events(server, "log") if "oom" in e["data"]]
    assert ooms and max(held[0]) <= ooms[0]["data"]["step"], (held, ooms)
