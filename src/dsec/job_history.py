"""A job's failure history, shared by its supervisor with its learners (``snapshots.cadence: failure_history``).

The supervisor rewrites one small JSON file whenever a group starts, restarts or is given up: per group, the seconds
trained by its earlier incarnations plus the current one up to ``written_at``, whether it is running now, and the
restarts that rolled it back to its snapshots. A learner reads it (at most every ``REFRESH_S``) for the history of
the job's *other* groups, its cadence's prior (dsec.decide.cadence); a running group's exposure goes on growing
after ``written_at`` (wall clocks: the same machine, or hosts in NTP sync). The file sits in the job's snapshot
directory, which every learner of the job writes to anyway. A file that cannot be read means no peers (the
group's own history alone), never an error in training. No third-party imports: the probe loads it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dsec.fsutil import write_atomic

log = logging.getLogger(__name__)

REFRESH_S = 30.0  # how often a learner re-reads the file: a restart elsewhere reaches the others within this
VERSION = 1


@dataclass(frozen=True)
class GroupHistory:
    exposure_s: float  # seconds trained up to the file's written_at
    rollbacks: int
    running: bool  # trains on after written_at


def history_path(snapshot_dir: Path, job: str) -> Path:
    return Path(snapshot_dir) / "history" / f"{job}.json"


def write_history(path: Path, groups: Mapping[str, GroupHistory], written_at: float) -> None:
    doc = {
        "version": VERSION,
        "written_at": written_at,
        "groups": {
            name: {"exposure_s": round(h.exposure_s, 3), "rollbacks": h.rollbacks, "running": h.running}
            for name, h in sorted(groups.items())
        },
    }
    write_atomic(path, json.dumps(doc, sort_keys=True).encode())


def peers_of(path: Path, group: str, now: float) -> tuple[float, int] | None:
    """The summed (exposure_s, rollbacks) of every group in the file but ``group``, as of ``now``; None when the
    file is missing or malformed (logged once per call at debug: it is rewritten by the supervisor)."""
    try:
        doc = json.loads(Path(path).read_text())
        written_at = float(doc["written_at"])
        exposure, rollbacks = 0.0, 0
        for name, h in doc["groups"].items():
            if name == group:
                continue
            e, r = float(h["exposure_s"]), h["rollbacks"]
            if not (math.isfinite(e) and e >= 0 and isinstance(r, int) and not isinstance(r, bool) and r >= 0):
                raise ValueError(f"group {name!r}: exposure_s {e!r}, rollbacks {r!r}")
            exposure += e + (max(0.0, now - written_at) if h.get("running") is True else 0.0)
            rollbacks += r
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.debug("dsec: job history %s unreadable (%s): the group's own history alone", path, exc)
        return None
    return exposure, rollbacks
