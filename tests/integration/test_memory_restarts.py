"""DDP groups under the supervisor whose rank 0 runs out of memory, on real processes: two gloo ranks of
tests/fixtures/heal_train.py (plain DDP + Adam, no dsec import) started by ``LocalLauncher``, a real control plane, the
probe's stand-in card (``DSEC_FAKE_CARD``: no GPU here) that both ranks hold memory on, and ``DSEC_CHAOS`` memory
growth on rank 0.

- A burst past the card: the ranks snapshot together ahead of the OOM (the burst snapshot, agreed in the sync
  header), the OOM ends rank 0, the supervisor restarts the whole group, and both ranks restore the same agreed step —
  the burst snapshot's, a few steps before the failure.
- A slow climb into a final limit: rank 0 is drained (a snapshot of its own, then a planned stop), the group
  restarts, and rank 1 — which holds no snapshot of that step — receives rank 0's verified copy, so both resume at
  the drain's step (snapshot/transfer.py), with no OOM.

Either restart was foreseen, so the snapshot cadence is not told to snapshot more often (launch/foreseen.py)."""

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
# ~20 s each; what stays in the default run: the foreseen rule (tests/unit/launch, tests/unit/sim), the burst snapshot
# agreed by two ranks (tests/integration/test_replica_agreement.py), the agreed restore with a transfer (the same file)
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def group_job(tmp_path: Path, chaos: str) -> JobFile:
    return JobFile.model_validate(
        {
            "job": "memory",
            "pool": "pool-a",
            # Periodic snapshots rarely (the failure-history cadence's prior): the burst's or the drain's counts.
            "snapshots": {"dir": str(tmp_path / "snaps"), "interval_s": 600},
            "restart": {"max_restarts": 1, "resume_timeout_s": 60},
            "groups": [
                {
                    "name": "trainers",
                    "world_size": 2,
                    "env": {
                        "DSEC_HEARTBEAT_INTERVAL": "0.2",
                        "OMP_NUM_THREADS": "1",
                        # Both ranks hold 2 GB of a 6 GB card; rank 0's memory grows (each incarnation).
                        "DSEC_FAKE_CARD": f"path={tmp_path / 'card0'},memory_gb=6,base_gb=2",
                        "DSEC_CHAOS": chaos,
                    },
                    "command": [sys.executable, str(FIXTURE), "--stop-file", str(tmp_path / "stop"), "--inner", "4"],
                }
            ],
        }
    )


@pytest.fixture
def supervised(server: Harness, tmp_path: Path) -> Iterator[Callable[[JobFile], tuple[Supervisor, list[Recovery]]]]:
    made: list[Supervisor] = []

    def make(job: JobFile) -> tuple[Supervisor, list[Recovery]]:
        recoveries: list[Recovery] = []
        sup = Supervisor(job, LocalLauncher(log_dir=tmp_path / "logs"), endpoint=server.url,
                         pool_token=server.pool_tokens["pool-a"], poll_s=0.02,
                         on_recovery=recoveries.append)  # fmt: skip
        made.append(sup)
        return sup, recoveries

    yield make
    for sup in made:
        sup.stop()


def supervise_until(sup: Supervisor, cond: Callable[[], Any], timeout: float, what: str, why: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}\n{why()}")
        sup.step()
        time.sleep(0.02)
    return value


def _logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))


def _restores(server: Harness) -> list[dict[str, Any]]:
    return [e["data"] for e in server.admin.all_events(types=["restore"])]


def _held(tmp_path: Path, rank: int) -> dict[int, dict[str, Any]]:
    """Rank ``rank``'s snapshots: step -> manifest."""
    store, worker = LocalDirStore(tmp_path / "snaps"), f"trainers-learner-{rank}"
    manifests = (read_manifest(store, worker, s) for s in store.manifests(worker))
    return {int(m["step"]): m for m in manifests}


def test_a_group_restarted_after_a_bursts_oom_resumes_both_ranks_from_the_burst_snapshot(
    server: Harness, supervised: Callable[[JobFile], tuple[Supervisor, list[Recovery]]], tmp_path: Path
) -> None:
    # Rank 0 bursts at 0.4 GB/s from 1 s after its start and fills the card ~5 s later.
    sup, recoveries = supervised(group_job(tmp_path, "memory_growth_mb_per_s=410,max_mb=4096,rank=0,after_s=1"))

    def logs() -> str:
        return _logs(tmp_path)

    sup.start()
    (rec,) = supervise_until(sup, lambda: recoveries, 120, "the group's restart after rank 0's OOM", logs)
    assert rec.mode == "restart" and rec.worker == "trainers-0" and rec.code not in (0, None), rec
    done = supervise_until(sup, lambda: len(_restores(server)) == 2 and _restores(server), 90, "both restores", logs)
    assert "OutOfMemoryError" in logs()

    # The ranks snapshotted together ahead of the OOM: the same steps on both, rank 0's newest asked for by its burst.
    held = [_held(tmp_path, r) for r in range(2)]
    assert held[0] and set(held[0]) == set(held[1]), held
    burst_step = max(held[0])
    assert "memory_burst" in held[0][burst_step]["requests"]
    oom = [e["data"] for e in server.admin.all_events(types=["log"]) if "oom" in (e["data"] or {})]
    assert oom and burst_step <= oom[0]["step"], (burst_step, oom)

    # Both ranks restored that step (agreed), and the supervisor did not count the foreseen failure as a rollback.
    assert {d["status"] for d in done} == {"ok"} and {d["agreed_step"] for d in done} == {burst_step}, done
    assert sup.rollbacks == {"trainers": 0} and sup.history("trainers")[1] == 0


def test_a_drained_rank_of_a_group_brings_its_peer_to_the_drains_step(
    server: Harness, supervised: Callable[[JobFile], tuple[Supervisor, list[Recovery]]], tmp_path: Path
) -> None:
    # The pool's ceiling 2.5 GB: each rank's limit stops there (final), and rank 0 climbs 0.045 GB/s into it from
    # 1 s after its start (~10 s), with the card's room (4 GB) far away: the drain's case, not the burst's.
    spec = {k: v for k, v in server.admin.request("GET", "/v1/pools/pool-a").items() if k != "name"}
    server.admin.put_pool("pool-a", **{**spec, "memory_base_gb": 2.0, "memory_ceiling_gb": 2.5})
    sup, recoveries = supervised(group_job(tmp_path, "memory_growth_mb_per_s=46,max_mb=4096,rank=0,after_s=1"))
    sup.start()
    (rec,) = supervise_until(sup, lambda: recoveries, 120, "the group's restart after rank 0's drain",
                             lambda: _logs(tmp_path))  # fmt: skip
    assert rec.mode == "restart" and rec.worker == "trainers-0", rec
    done = supervise_until(sup, lambda: len(_restores(server)) == 2 and _restores(server), 90, "both restores",
                           lambda: _logs(tmp_path))  # fmt: skip
    drains = [e["data"] for e in server.admin.all_events(types=["log"]) if "memory_recycle" in (e["data"] or {})]
    assert len(drains) == 1 and not [e for e in server.admin.all_events(types=["log"]) if "oom" in (e["data"] or {})]
    held = [_held(tmp_path, r) for r in range(2)]
    drain_step = max(held[0])
    assert "memory_recycle" in held[0][drain_step]["requests"] and drain_step not in held[1], held
    # Both resume at the drain's step: rank 1 from rank 0's copy (it held none of that step).
    assert {d["status"] for d in done} == {"ok"} and {d["agreed_step"] for d in done} == {drain_step}, done
    assert [d.get("source_rank") for d in sorted(done, key=lambda d: d["rank"])] == [0, 0], done
    assert sup.rollbacks == {"trainers": 0}
