"""Whether a group's failure was foreseen: its ranks snapshotted ahead of it, so restarting it lost next to nothing.

The snapshot cadence (``dsec.decide.cadence``) spaces periodic snapshots by Young's interval for the failures that
roll a learner back to a snapshot of unknown age. A burst that runs into its memory bound is announced: the probe
snapshots at the step it sees the burst heading there (``dsec.quota.trend.burst_at_risk``; the snapshot's manifest
lists the request ``memory_burst``). When the group then fails, it restarts from that snapshot and redoes a few
steps, whatever the cadence — so such a failure is no evidence that snapshots should come more often, and the
supervisor does not count it as a rollback. Nor a drain (probe/recycle.py): a slow climb into a final limit stops its
process right after a snapshot taken for it (``memory_recycle``), and the restart loses nothing. The simulator counts
the same way (``DsecRegime._foreseen``; a drain is not a failure there).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from dsec.snapshot.manifest import CorruptSnapshot
from dsec.snapshot.reader import read_manifest
from dsec.snapshot.store import LocalDirStore, StoreError

log = logging.getLogger(__name__)

#: The requests of the snapshots taken ahead of a failure (probe/runtime.py): a burst heading into its bound, and the
#: drain's last snapshot before its process stops.
FORESEEN_REQUESTS = frozenset({"memory_burst", "memory_recycle"})
#: How long before a failure a burst's snapshot still covers it. The probe snapshots when the burst would reach its
#: bound within ~2 s; a bound the control plane raises meanwhile lets the burst run on for a few seconds more (real
#: runs failed 1-19 s after the snapshot, docs/benchmarks.md). Past this, the failure is another one.
FORESEEN_WINDOW_S = 30.0


def foreseen_failure(
    snapshot_dir: Path, group: str, failed_at: float, window_s: float = FORESEEN_WINDOW_S, rank: int | None = None
) -> bool:
    """True when the newest snapshot of a rank of ``group`` (of ``rank`` only, when given: a process restarted
    alone; snapshot names ``<group>-<role>-<rank>``, probe/snapshots.py) was taken for a memory burst or a drain less
    than ``window_s`` before ``failed_at``. Anything unreadable counts as not foreseen: the cadence then errs
    towards snapshotting more often, never less."""
    if not snapshot_dir.is_dir():
        return False
    ranks = r"\d+" if rank is None else str(int(rank))
    name = re.compile(rf"^{re.escape(group)}-[A-Za-z]+-{ranks}$")
    try:
        store = LocalDirStore(snapshot_dir)
        for worker in (w for w in store.workers() if name.match(w)):
            seqs = store.manifests(worker)
            if not seqs:
                continue
            m = read_manifest(store, worker, seqs[-1])
            created = m.get("created")
            if (
                FORESEEN_REQUESTS.intersection(m.get("requests") or ())
                and isinstance(created, (int, float))
                and failed_at - window_s <= created <= failed_at + 1.0  # +1 s: the writer's clock and ours
            ):
                return True
    except (StoreError, CorruptSnapshot, OSError, ValueError) as exc:
        log.warning("group %s: cannot tell whether its failure was foreseen (%s); counted as a rollback", group, exc)
    return False
