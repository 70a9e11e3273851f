"""``dsec top``'s keyboard: the view state the keys change (pure, tested without a terminal) and a raw-mode reader
that degrades to no keys when stdin is not a terminal."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO


# -- keys ------------------------------------------------------------------------------------------------------
@dataclass
class ViewState:
    """What the keys change: the filter (and whether it is being typed), the selected row, the worker whose detail
    is shown. :meth:`apply` is pure of I/O so that the key map is tested without a terminal."""

    match: str = ""
    editing: bool = False
    selected: int = 0
    detail: str | None = None
    quit: bool = False

    def apply(self, key: str, row_ids: Sequence[str]) -> None:
        if self.editing:
            if key in ("\r", "\n"):
                self.editing = False
            elif key == "esc":
                self.editing, self.match = False, ""
            elif key in ("\x7f", "\b"):
                self.match = self.match[:-1]
            elif len(key) == 1 and key.isprintable():
                self.match += key
            self.selected = 0
            return
        if key == "q":
            self.quit = True
        elif self.detail is not None:
            if key in ("esc", "\r", "\n", "d", "b", "\x7f", "\b"):
                self.detail = None
        elif key in ("/", "f"):
            self.editing = True
        elif key == "esc":
            self.match, self.selected = "", 0
        elif key in ("j", "down"):
            self.selected = min(self.selected + 1, max(len(row_ids) - 1, 0))
        elif key in ("k", "up"):
            self.selected = max(self.selected - 1, 0)
        elif key in ("\r", "\n", "d") and row_ids:
            self.detail = row_ids[min(self.selected, len(row_ids) - 1)]


_ARROWS = {"\x1b[A": "up", "\x1b[B": "down", "\x1bOA": "up", "\x1bOB": "down"}


def split_keys(data: str) -> list[str]:
    """Characters read from the terminal as keys: arrows as ``up``/``down``, a lone escape as ``esc``, other escape
    sequences dropped."""
    keys: list[str] = []
    i = 0
    while i < len(data):
        if data[i] == "\x1b":
            seq = data[i : i + 3]
            if seq in _ARROWS:
                keys.append(_ARROWS[seq])
                i += 3
                continue
            if len(seq) >= 2 and seq[1] in "[O":
                i += 3  # another sequence (left/right, function keys): ignored
                continue
            keys.append("esc")
            i += 1
            continue
        keys.append(data[i])
        i += 1
    return keys


class Keys:
    """Single keys from stdin while it is a terminal (cbreak mode, restored on exit). Otherwise (a pipe, a file,
    no termios) :meth:`wait` only sleeps: the view refreshes until Ctrl-C."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.fd: int | None = None
        self._saved: Any = None

    def __enter__(self) -> Keys:
        try:
            import termios
            import tty

            if self.stream.isatty():
                fd = self.stream.fileno()
                self._saved = termios.tcgetattr(fd)
                tty.setcbreak(fd)
                self.fd = fd
        except (ImportError, OSError, ValueError):
            self.fd = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self.fd = None

    @property
    def interactive(self) -> bool:
        return self.fd is not None

    def wait(self, timeout: float) -> list[str]:
        """The keys pressed within ``timeout`` seconds (returns at the first)."""
        if self.fd is None:
            time.sleep(max(timeout, 0.0))
            return []
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0.0))
        if not ready:
            return []
        return split_keys(os.read(self.fd, 64).decode(errors="ignore"))
