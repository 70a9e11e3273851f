"""A DDP group under the supervisor whose rank 0 bursts past its card: the ranks snapshot together ahead of the OOM
(the burst snapshot, agreed in the sync header), the OOM ends rank 0, the supervisor restarts the whole group, and
both ranks restore the same agreed step — the burst snapshot's, a few steps before the failure. The failure was
foreseen, so the snapshot cadence is not told to snapshot more often (launch/foreseen.py).

Real processes throughout: two gloo ranks of tests/fixtures/heal_train.py (plain DDP + Adam, no dsec import) started
by ``LocalLauncher``, a real control plane, the probe's stand-in card (``DSEC_FAKE_CARD``: no GPU here) that both
ranks hold memory on, and ``DSEC_CHAOS`` memory growth on rank 0."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness
from dsec.launch.jobfile import JobFile
from dsec.launch.local import LocalLauncher
from dsec.launch.supervisor import Recovery, Supervisor

pytest.importorskip("torch")

from dsec.snapshot import LocalDirStore
from dsec.snapshot.reader import read_manifest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "heal_train.py"
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # ~15 s; the rule itself: tests/unit/launch, tests/unit/sim


@pytest.fixture
def supervisor(server: Harness, tmp_path: Path) -> Iterator[tuple[Supervisor, list[Recovery]]]:
    job = JobFile.model_validate(
        {
            "job": "burst",
            "pool": "pool-a",
            # Periodic snapshots rarely (the failure-history cadence's prior): the burst's is the one that counts.
            "snapshots": {"dir": str(tmp_path / "snaps"), "interval_s": 600},
            "restart": {"max_restarts": 1, "resume_timeout_s": 60},
            "groups": [
                {
                    "name": "trainers",
                    "world_size": 2,
                    "env": {
                        "DSEC_HEARTBEAT_INTERVAL": "0.2",
                        "OMP_NUM_THREADS": "1",
                        # Both ranks hold 2 GB of a 6 GB card; rank 0 bursts at 0.4 GB/s from 1 s after its start
                        # and fills the card ~5 s later (each incarnation).
                        "DSEC_FAKE_CARD": f"path={tmp_path / 'card0'},memory_gb=6,base_gb=2",
                        "DSEC_CHAOS": "memory_growth_mb_per_s=410,max_mb=4096,rank=0,after_s=1",
                    },
                    "command": [sys.executable, str(FIXTURE), "--stop-file", str(tmp_path / "stop"), "--inner", "4"],
                }
            ],
        }
    )
    recoveries: list[Recovery] = []
    sup = Supervisor(job, LocalLauncher(log_dir=tmp_path / "logs"), endpoint=server.url,
                     pool_token=server.pool_tokens["pool-a"], poll_s=0.02, on_recovery=recoveries.append)  # fmt: skip
    try:
        yield sup, recoveries
    finally:
        sup.stop()


def supervise_until(sup: Supervisor, cond: Callable[[], Any], timeout: float, what: str, why: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}\n{why()}")
        sup.step()
        time.sleep(0.02)
    return value


def test_a_group_restarted_after_a_bursts_oom_resumes_both_ranks_from_the_burst_snapshot(
    server: Harness, supervisor: tuple[Supervisor, list[Recovery]], tmp_path: Path
) -> None:
    sup, recoveries = supervisor

    def logs() -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))

    def restores() -> list[dict[str, Any]]:
        return [e["data"] for e in server.admin.all_events(types=["restore"])]

    sup.start()
    (rec,) = supervise_until(sup, lambda: recoveries, 120, "the group's restart after rank 0's OOM", logs)
    assert rec.mode == "restart" and rec.worker == "trainers-0" and rec.code not in (0, None), rec
    done = supervise_until(sup, lambda: len(restores()) == 2 and restores(), 90, "both ranks' restores", logs)
    assert "OutOfMemoryError" in logs()

    # The ranks snapshotted together ahead of the OOM: the same steps on both, rank 0's newest asked for by its burst.
    store = LocalDirStore(tmp_path / "snaps")
    held = [
        {int(read_manifest(store, f"trainers-learner-{r}", s)["step"]): read_manifest(store, f"trainers-learner-{r}", s)
         for s in store.manifests(f"trainers-learner-{r}")}
        for r in range(2)
    ]  # fmt: skip
    assert held[0] and set(held[0]) == set(held[1]), held
    burst_step = max(held[0])
    assert "memory_burst" in held[0][burst_step]["requests"]
    oom = [e["data"] for e in server.admin.all_events(types=["log"]) if "oom" in (e["data"] or {})]
    assert oom and burst_step <= oom[0]["step"], (burst_step, oom)

    # Both ranks restored that step (agreed), and the supervisor did not count the foreseen failure as a rollback.
    assert {d["status"] for d in done} == {"ok"} and {d["agreed_step"] for d in done} == {burst_step}, done
    assert sup.rollbacks == {"trainers": 0} and sup.history("trainers")[1] == 0
