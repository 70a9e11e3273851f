"""The simulator's latest plots where the dashboard shows them.

``dsec simulate`` writes its report into a directory of its own, then publishes the plots of that run here: the
plots directory ($DSEC_PLOTS_DIR, else $DSEC_HOME/plots — the control plane reads the same place with the same
environment). Only the file names in :data:`PLOTS` are ever written or served, each with its media type; an index,
``plots.json``, names the run they came from. Publishing replaces the previous run's plots (a plot the new run did
not draw, e.g. the sweep's, is removed) and writes the index last, each file atomically.

No third-party imports: the control plane reads this without the simulator's dependencies.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from dsec.fsutil import write_atomic

INDEX = "plots.json"
MAX_BYTES = 32 << 20  # larger than any plot the simulator draws; a bigger file there is not one of them

# Every file that may be published or served: name -> (media type, title).
PLOTS: dict[str, tuple[str, str]] = {
    "goodput.svg": ("image/svg+xml", "goodput over time, per regime"),
    "progress.png": ("image/png", "cumulative useful training"),
    "hours_lost.png": ("image/png", "GPU-hours lost per day, by cause"),
    "sweep.png": ("image/png", "sensitivity sweep"),
}


def plots_dir(home: Path | None = None) -> Path:
    """$DSEC_PLOTS_DIR, else ``home`` (default: $DSEC_HOME, else ~/.dsec) / plots."""
    explicit = os.environ.get("DSEC_PLOTS_DIR")
    if explicit:
        return Path(explicit)
    if home is None:
        from dsec.control.settings import default_home

        home = default_home()
    return home / "plots"


def publish(report: Path, target: Path, run: dict[str, Any]) -> list[str]:
    """Copy the known plots found in ``report`` into ``target`` and index them with ``run`` (scenario, seed, ...);
    known plots of an earlier run that this one lacks are removed. Returns the names published."""
    target.mkdir(parents=True, exist_ok=True)
    names = [n for n in PLOTS if (report / n).is_file()]
    for name in names:
        write_atomic(target / name, (report / name).read_bytes())
    for stale in set(PLOTS) - set(names):
        (target / stale).unlink(missing_ok=True)
    index = {**run, "published_at": time.time(), "report": str(report.resolve()), "plots": names}
    write_atomic(target / INDEX, (json.dumps(index, indent=2) + "\n").encode())
    return names


def _regular(path: Path) -> bool:
    """A regular file (not a link, a directory or a device) of a plot's size."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES


def latest(target: Path) -> dict[str, Any]:
    """The index of the published run with the plots that are there: ``{"run": {...} | None, "plots": [{name,
    media_type, title, bytes}]}``; no index (nothing published, or unreadable) lists the known plots present."""
    run: dict[str, Any] | None = None
    try:
        loaded = json.loads((target / INDEX).read_text(encoding="utf-8"))
        run = loaded if isinstance(loaded, dict) else None
    except (OSError, ValueError):
        pass
    listed = run.get("plots") if run is not None else None
    names = [n for n in listed if n in PLOTS] if isinstance(listed, list) else list(PLOTS)
    plots = [
        {"name": n, "media_type": PLOTS[n][0], "title": PLOTS[n][1], "bytes": (target / n).lstat().st_size}
        for n in names
        if _regular(target / n)
    ]
    if run is not None:
        run = {k: v for k, v in run.items() if k != "plots"}
    return {"run": run, "plots": plots}


def read(target: Path, name: str) -> tuple[bytes, str] | None:
    """A published plot's bytes and media type; None for a name not in :data:`PLOTS` or a file not there."""
    known = PLOTS.get(name)
    path = target / name
    if known is None or not _regular(path):
        return None
    return path.read_bytes(), known[0]
