"""Progress bars for long CLI work (``dsec simulate``, ``dsec snapshots verify | restore | compact``, ``dsec launch``
start-up), drawn with ``rich.progress`` on stderr.

A bar is shown when stderr is a terminal, or when ``--progress`` asks for one (``--no-progress`` never shows one). The
bar is never written to stdout: tables, ids and ``--json`` lines are the same bytes with or without it. (When stdout
is a terminal as well, the lines a command prints while a bar runs go through the bar's console, above the bar, so
that the two do not garble each other on the screen.) On a stderr that is not a terminal (a forced bar in a log file),
rich draws nothing while it runs and prints the final state once.

The bars count real units of work that the code below reports through ``on_progress(done, total)`` hooks: simulated
hours, sweep points, snapshots verified, tensors decoded or written, ranks registered. Work that has no hook (reading
and checking a snapshot chain) shows a spinner with no percentage, never an estimate.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Task as RichTask
from rich.text import Text

ShowProgress = Annotated[
    bool | None,
    typer.Option(
        "--progress/--no-progress",
        show_default=False,
        help="Progress bar on stderr (default: only when stderr is a terminal); never written to stdout.",
    ),
]

OnProgress = Callable[[float, float], None]


def wanted(flag: bool | None) -> bool:
    """``--progress`` / ``--no-progress`` when given, else whether stderr is a terminal."""
    return sys.stderr.isatty() if flag is None else flag


class Bars:
    """One ``rich.progress.Progress`` on stderr, or nothing (every method then does nothing).

    ``share``: stdout is a terminal too (in practice the same one), and lines meant for stdout are printed by the
    bars' console, above the bars; printed by another console they would land on the bar's line and garble it."""

    def __init__(self, progress: Progress | None, share: bool = False) -> None:
        self.progress = progress
        self.share = share
        self._stdout = Console()

    @property
    def shown(self) -> bool:
        return self.progress is not None

    def out(self, *objects: Any, **kwargs: Any) -> None:
        """``Console.print`` on stdout (above the bars when both are the terminal)."""
        console = self.progress.console if self.progress is not None and self.share else self._stdout
        console.print(*objects, **kwargs)

    def task(self, description: str, total: float | None = None, unit: str = "") -> Task:
        if self.progress is None:
            return Task(None, None)
        return Task(self.progress, self.progress.add_task(description, total=total, unit=f" {unit}" if unit else ""))

    def note(self, text: str) -> None:
        """A line above the bars (on stderr), or on stderr alone when there are no bars."""
        console = self.progress.console if self.progress is not None else Console(stderr=True)
        console.print(text, markup=False, highlight=False, soft_wrap=True)


class Task:
    """One bar. ``update(done, total)`` is an ``on_progress`` hook."""

    def __init__(self, progress: Progress | None, task: TaskID | None) -> None:
        self._progress = progress
        self._task = task

    def update(self, done: float, total: float | None = None) -> None:
        if self._progress is not None and self._task is not None:
            if total is None:
                self._progress.update(self._task, completed=done)
            else:
                self._progress.update(self._task, completed=done, total=total)

    def advance(self, by: float = 1.0) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, by)


def _number(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() or abs(x) >= 100 else f"{x:.1f}"


class Count(ProgressColumn):
    """``done/total unit``: whole numbers as such, fractions (simulated hours) to one decimal."""

    def render(self, task: RichTask) -> Text:
        if task.total is None:  # a spinner: nothing counted yet
            return Text("")
        done, total = _number(task.completed), _number(task.total)
        return Text(f"{done}/{total}{task.fields.get('unit', '')}", style="progress.download")


def _columns() -> list[ProgressColumn]:
    return [
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        Count(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    ]


@contextmanager
def bars(flag: bool | None) -> Iterator[Bars]:
    """Progress bars on stderr while the block runs when :func:`wanted`; otherwise a :class:`Bars` that does nothing.

    Print stdout lines with :meth:`Bars.out` and stderr lines with :meth:`Bars.note` while the bars run, and raise
    errors after the block: a line written by another console would land on the bars' line. When stdout is not a
    terminal (a pipe, a file), :meth:`Bars.out` writes to stdout itself and nothing else ever does."""
    if not wanted(flag):
        yield Bars(None)
        return
    share = sys.stdout.isatty()
    progress = Progress(
        *_columns(), console=Console(stderr=True), redirect_stdout=share, redirect_stderr=share, transient=False
    )
    with progress:
        yield Bars(progress, share)
