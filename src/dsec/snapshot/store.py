"""Where snapshots live: content-addressed chunks plus one manifest per snapshot.

The store interface is small so that shared filesystems and object storage can implement it later; the local
directory implementation is the default. Layout::

    ROOT/chunks/ab/abcdef...        zstd frame; the file name is the sha256 of the file's bytes
    ROOT/manifests/WORKER/000042.json

Durability: every file is written to a temporary name in its final directory, fsynced, renamed into place, and the
directory fsynced; a manifest is written only after all its chunks are durable, so a snapshot is listed only once it
is complete. A writer killed midway leaves at most temporary files (removed by :meth:`LocalDirStore.sweep`) and
chunks no manifest references (removed by garbage collection after a grace period). Chunks are shared by content:
ranks of a DDP job with identical weights store them once.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from dsec.fsutil import TMP_PREFIX as _TMP_PREFIX
from dsec.fsutil import write_atomic

_WORKER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class StoreError(Exception):
    pass


def check_worker(worker: str) -> str:
    if not _WORKER_RE.match(worker):
        raise ValueError(f"worker name {worker!r} is invalid for a snapshot store: use letters, digits, . _ -")
    return worker


class SnapshotStore(Protocol):
    def has_chunk(self, chunk_id: str) -> bool: ...
    def put_chunk(self, chunk_id: str, data: bytes) -> None: ...
    def get_chunk(self, chunk_id: str) -> bytes: ...
    def put_manifest(self, worker: str, seq: int, data: bytes) -> None: ...
    def get_manifest(self, worker: str, seq: int) -> bytes: ...
    def manifests(self, worker: str) -> list[int]: ...
    def workers(self) -> list[str]: ...
    def delete_manifest(self, worker: str, seq: int) -> None: ...
    def chunks(self) -> Iterator[tuple[str, float]]: ...
    def delete_chunk(self, chunk_id: str) -> None: ...


class LocalDirStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        (self.root / "chunks").mkdir(parents=True, exist_ok=True)
        (self.root / "manifests").mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalDirStore({str(self.root)!r})"

    # -- chunks -----------------------------------------------------------------------------------------
    def _chunk_path(self, chunk_id: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", chunk_id):
            raise StoreError(f"chunk id {chunk_id!r} is not a sha256 hex digest")
        return self.root / "chunks" / chunk_id[:2] / chunk_id

    def has_chunk(self, chunk_id: str) -> bool:
        path = self._chunk_path(chunk_id)
        if not path.exists():
            return False
        # Refresh its age: garbage collection spares recently used chunks, so a writer that reuses a chunk
        # it found here cannot lose it to a concurrent collection before its manifest is published.
        with contextlib.suppress(OSError):
            os.utime(path)
        return True

    def put_chunk(self, chunk_id: str, data: bytes) -> None:
        write_atomic(self._chunk_path(chunk_id), data)

    def get_chunk(self, chunk_id: str) -> bytes:
        try:
            return self._chunk_path(chunk_id).read_bytes()
        except FileNotFoundError:
            raise StoreError(f"chunk {chunk_id[:12]} is missing") from None

    def chunks(self) -> Iterator[tuple[str, float]]:
        """(chunk id, modification time) of every chunk."""
        for sub in (self.root / "chunks").iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if not path.name.startswith(_TMP_PREFIX):
                    with contextlib.suppress(FileNotFoundError):
                        yield path.name, path.stat().st_mtime

    def delete_chunk(self, chunk_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._chunk_path(chunk_id).unlink()

    # -- manifests --------------------------------------------------------------------------------------
    def _manifest_path(self, worker: str, seq: int) -> Path:
        return self.root / "manifests" / check_worker(worker) / f"{seq:08d}.json"

    def put_manifest(self, worker: str, seq: int, data: bytes) -> None:
        """Publish a manifest; FileExistsError when ``worker/seq`` is already taken."""
        write_atomic(self._manifest_path(worker, seq), data, overwrite=False)

    def get_manifest(self, worker: str, seq: int) -> bytes:
        try:
            return self._manifest_path(worker, seq).read_bytes()
        except FileNotFoundError:
            raise StoreError(f"snapshot {worker}/{seq} does not exist") from None

    def manifests(self, worker: str) -> list[int]:
        folder = self.root / "manifests" / check_worker(worker)
        if not folder.is_dir():
            return []
        return sorted(int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit())

    def workers(self) -> list[str]:
        """Workers with a manifest folder; folders whose names no worker can have (someone else's, a typo with a
        space) are not workers and are skipped."""
        return sorted(p.name for p in (self.root / "manifests").iterdir() if p.is_dir() and _WORKER_RE.match(p.name))

    def delete_manifest(self, worker: str, seq: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._manifest_path(worker, seq).unlink()

    # -- housekeeping -----------------------------------------------------------------------------------
    def sweep(self, older_than_s: float = 600.0) -> int:
        """Remove temporary files left by killed writers (older than ``older_than_s``); returns how many."""
        cutoff = time.time() - older_than_s
        removed = 0
        for path in _walk_tmp(self.root):
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
        return removed


def _walk_tmp(root: Path) -> Iterable[Path]:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if name.startswith(_TMP_PREFIX):
                yield Path(dirpath) / name
