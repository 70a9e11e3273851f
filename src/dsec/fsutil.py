"""Crash-safe file writes (temp file, fsync, rename, fsync of the directory), shared by the snapshot store and
the control plane's applied-policy file. No third-party imports: the control plane uses it without torch."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

TMP_PREFIX = ".tmp-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, overwrite: bool = True) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old state or the whole new file.

    With ``overwrite=False`` an existing ``path`` raises FileExistsError and is left untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if the name is taken: two writers can never replace each other's file
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(path.parent)
