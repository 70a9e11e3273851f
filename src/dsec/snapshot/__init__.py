"""State snapshots: minimal, quantized, incremental, asynchronous; restore verified and falling back past damage.

    from dsec.snapshot import LocalDirStore, Snapshotter

    snap = Snapshotter(LocalDirStore("snapshots"), "learner-0")   # level 2 (q8-lite) by default
    snap.register("policy", model)
    snap.register("adam", optimizer)
    ...
    snap.take(step=i)             # returns at once; the next optimizer.step() waits only if the read is unfinished
    snap.restore_latest()         # newest snapshot that verifies, into the registered objects

Modes, formats and guarantees: codec.py (encodings), manifest.py (format), store.py (durability).
"""

from dsec.snapshot.codec import DEFAULT_LEVEL, MODES, Mode, mode_for
from dsec.snapshot.manifest import CorruptSnapshot
from dsec.snapshot.reader import Loaded, load, load_latest, verify
from dsec.snapshot.retention import collect_garbage, compact, listing
from dsec.snapshot.snapshotter import RestoreReport, Snapshotter, Ticket, replay_metadata
from dsec.snapshot.store import LocalDirStore, ManifestExists, SnapshotStore, StoreError

__all__ = [
    "DEFAULT_LEVEL",
    "MODES",
    "CorruptSnapshot",
    "Loaded",
    "LocalDirStore",
    "ManifestExists",
    "Mode",
    "RestoreReport",
    "SnapshotStore",
    "Snapshotter",
    "StoreError",
    "Ticket",
    "collect_garbage",
    "compact",
    "listing",
    "load",
    "load_latest",
    "mode_for",
    "replay_metadata",
    "verify",
]
