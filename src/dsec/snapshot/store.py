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
from types import TracebackType
from typing import Protocol

from dsec.errors import StorageError
from dsec.fsutil import TMP_PREFIX as _TMP_PREFIX
from dsec.fsutil import write_atomic

_WORKER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class StoreError(StorageError):
    """The snapshot store failed: a missing file, or the filesystem refused (the OSError is the cause)."""


class ManifestExists(StoreError, FileExistsError):
    """``put_manifest``: the snapshot number is taken. Still a FileExistsError: writers caught that before."""


class _translated:  # lower case: used like contextlib.suppress
    """OSError -> StoreError at the store's boundary: callers handle one exception type whatever the backend.

    A class rather than @contextmanager so that type checkers know it never swallows an exception."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, OSError) and not isinstance(exc, StoreError):  # ManifestExists is both
            raise StoreError(f"{self.what}: {exc.strerror or exc}") from exc


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
        with _translated(f"cannot create the snapshot store at {self.root}"):
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
        with _translated(f"cannot look up chunk {chunk_id[:12]}"):
            if not path.exists():
                return False
        # Refresh its age: garbage collection spares recently used chunks, so a writer that reuses a chunk
        # it found here cannot lose it to a concurrent collection before its manifest is published.
        with contextlib.suppress(OSError):
            os.utime(path)
        return True

    def put_chunk(self, chunk_id: str, data: bytes) -> None:
        path = self._chunk_path(chunk_id)
        with _translated(f"cannot write chunk {chunk_id[:12]}"):
            write_atomic(path, data)

    def get_chunk(self, chunk_id: str) -> bytes:
        path = self._chunk_path(chunk_id)
        with _translated(f"cannot read chunk {chunk_id[:12]}"):
            try:
                return path.read_bytes()
            except FileNotFoundError:
                raise StoreError(f"chunk {chunk_id[:12]} is missing") from None

    def chunks(self) -> Iterator[tuple[str, float]]:
        """(chunk id, modification time) of every chunk."""
        with _translated(f"cannot list the chunks in {self.root}"):
            subs = [sub for sub in (self.root / "chunks").iterdir() if sub.is_dir()]
        for sub in subs:
            with _translated(f"cannot list the chunks in {sub}"):
                found = []
                for path in sub.iterdir():
                    if not path.name.startswith(_TMP_PREFIX):
                        with contextlib.suppress(FileNotFoundError):  # collected while we listed
                            found.append((path.name, path.stat().st_mtime))
            yield from found

    def delete_chunk(self, chunk_id: str) -> None:
        path = self._chunk_path(chunk_id)
        with _translated(f"cannot delete chunk {chunk_id[:12]}"), contextlib.suppress(FileNotFoundError):
            path.unlink()

    # -- manifests --------------------------------------------------------------------------------------
    def _manifest_path(self, worker: str, seq: int) -> Path:
        return self.root / "manifests" / check_worker(worker) / f"{seq:08d}.json"

    def put_manifest(self, worker: str, seq: int, data: bytes) -> None:
        """Publish a manifest; ManifestExists (a FileExistsError) when ``worker/seq`` is already taken."""
        path = self._manifest_path(worker, seq)
        with _translated(f"cannot write snapshot {worker}/{seq}"):
            try:
                write_atomic(path, data, overwrite=False)
            except FileExistsError as exc:
                # Only a taken name means "use the next number"; a file where the worker's folder should be
                # raises FileExistsError too, and a writer retrying on it would loop for ever.
                if path.is_file():
                    raise ManifestExists(f"snapshot {worker}/{seq} already exists") from exc
                raise

    def get_manifest(self, worker: str, seq: int) -> bytes:
        path = self._manifest_path(worker, seq)
        with _translated(f"cannot read snapshot {worker}/{seq}"):
            try:
                return path.read_bytes()
            except FileNotFoundError:
                raise StoreError(f"snapshot {worker}/{seq} does not exist") from None

    def manifests(self, worker: str) -> list[int]:
        folder = self.root / "manifests" / check_worker(worker)
        with _translated(f"cannot list the snapshots of {worker}"):
            if not folder.is_dir():
                return []
            return sorted(int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit())

    def workers(self) -> list[str]:
        """Workers with a manifest folder; folders whose names no worker can have (someone else's, a typo with a
        space) are not workers and are skipped."""
        with _translated(f"cannot list the workers in {self.root}"):
            return sorted(
                p.name for p in (self.root / "manifests").iterdir() if p.is_dir() and _WORKER_RE.match(p.name)
            )

    def delete_manifest(self, worker: str, seq: int) -> None:
        path = self._manifest_path(worker, seq)
        with _translated(f"cannot delete snapshot {worker}/{seq}"), contextlib.suppress(FileNotFoundError):
            path.unlink()

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
