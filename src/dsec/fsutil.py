"""Crash-safe file writes (temp file, fsync, rename, fsync of the directory), shared by the snapshot store and
the control plane's applied-policy file, and private files and directories for what holds secrets. No third-party
imports: the control plane uses it without torch."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import uuid
from pathlib import Path

TMP_PREFIX = ".tmp-"
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700

log = logging.getLogger(__name__)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, overwrite: bool = True, mode: int = 0o666) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old state or the whole new file.

    The file is created with ``mode`` (minus the umask) from its first byte: a private file (``PRIVATE_FILE``) is
    never readable by others, not even as the temporary file before the rename. With ``overwrite=False`` an
    existing ``path`` raises FileExistsError and is left untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
        with open(fd, "wb") as fh:
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


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) with mode 0700 if it does not exist; an existing directory that other
    users can enter is left as it is (it may be shared on purpose) and logged."""
    try:
        path.mkdir(mode=PRIVATE_DIR, parents=True)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            log.warning("%s is accessible to other users (mode %o); DSec's files in it are 0600", path, mode)
    return path


def private_file(path: Path) -> None:
    """Make sure ``path`` exists and is 0600 (created empty with that mode, or an existing file narrowed)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), PRIVATE_FILE)
    except FileExistsError:
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            os.chmod(path, PRIVATE_FILE)
    else:
        os.close(fd)
