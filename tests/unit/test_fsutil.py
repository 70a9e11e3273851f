"""dsec.fsutil: private files are private from their first byte (docs/security.md, finding 2)."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.fsutil import PRIVATE_FILE, private_dir, private_file, write_atomic


@pytest.fixture
def usual_umask() -> Iterator[None]:
    old = os.umask(0o022)  # what most accounts run with: new files readable by everyone unless made otherwise
    try:
        yield
    finally:
        os.umask(old)


def test_a_private_file_is_never_seen_with_a_wider_mode(tmp_path: Path, usual_umask: None) -> None:
    """Another local user polling the directory (here a thread doing the same) must never find the file, or its
    temporary name, readable: the mode is set when the file is created, not by a chmod after the write."""
    seen: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for entry in os.scandir(tmp_path):
                with contextlib.suppress(FileNotFoundError):  # renamed away meanwhile
                    seen.add(stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode))

    watcher = threading.Thread(target=watch, name="test-watcher")
    watcher.start()
    try:
        for i in range(300):
            write_atomic(tmp_path / "secrets.json", b'{"secret": "%d"}' % i, mode=PRIVATE_FILE)
    finally:
        stop.set()
        watcher.join()
    assert seen == {0o600}


def test_the_default_mode_is_unchanged_for_shared_files(tmp_path: Path, usual_umask: None) -> None:
    write_atomic(tmp_path / "chunk", b"x")
    assert stat.S_IMODE((tmp_path / "chunk").stat().st_mode) == 0o644


def test_private_dir_creates_0700_and_leaves_an_existing_one(tmp_path: Path, usual_umask: None) -> None:
    made = private_dir(tmp_path / "a" / "home")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    private_dir(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755


def test_private_file_creates_or_narrows(tmp_path: Path, usual_umask: None) -> None:
    private_file(tmp_path / "new.db")
    assert stat.S_IMODE((tmp_path / "new.db").stat().st_mode) == 0o600
    old = tmp_path / "old.db"
    old.write_bytes(b"data")
    assert stat.S_IMODE(old.stat().st_mode) == 0o644
    private_file(old)
    assert stat.S_IMODE(old.stat().st_mode) == 0o600 and old.read_bytes() == b"data"


# -- durability: the fsync / rename order a crash relies on -----------------------------------------------------
class Syscalls:
    """Records os.fsync / os.replace / os.link as (call, what) in order, then performs them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, object]] = []
        real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

        def fsync(fd: int) -> None:
            st = os.fstat(fd)
            self.calls.append(("fsync_dir" if stat.S_ISDIR(st.st_mode) else "fsync_file", st.st_ino))
            real_fsync(fd)

        def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            self.calls.append(("replace", Path(dst)))
            real_replace(src, dst)

        def link(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            self.calls.append(("link", Path(dst)))
            real_link(src, dst)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "link", link)


@pytest.mark.parametrize(("overwrite", "publish"), [(True, "replace"), (False, "link")])
def test_write_atomic_fsyncs_the_file_before_the_rename_and_the_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool, publish: str
) -> None:
    target = tmp_path / "sub" / "state.json"
    rec = Syscalls(monkeypatch)
    write_atomic(target, b"new contents", overwrite=overwrite)
    # The data reaches the disk before its name can point at it, and the name reaches the disk after.
    file_ino, dir_ino = target.stat().st_ino, target.parent.stat().st_ino
    assert rec.calls == [("fsync_file", file_ino), (publish, target), ("fsync_dir", dir_ino)]
    assert target.read_bytes() == b"new contents"
