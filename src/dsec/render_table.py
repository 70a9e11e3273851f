"""How a listing of :mod:`dsec.render` is laid out: its columns, the default and the wide view, id columns as wide
as their longest id, and the cell formats listings share."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Console, JustifyMethod, OverflowMethod, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

Record = Mapping[str, Any]


@dataclass(frozen=True)
class _Col:
    """One column of a listing: its header, how a record fills it, and in which views it appears."""

    header: str
    cell: Callable[[Record], RenderableType]
    justify: JustifyMethod = "left"
    ident: bool = False  # an id or name people copy: as wide as the longest, folded, never cut
    overflow: OverflowMethod = "ellipsis"
    default: bool = True  # in the default (narrow) view; every column is in the wide view
    drop: int = 0  # > 0: the default view leaves it out when the terminal is too narrow, highest first


def _cell_len(cell: RenderableType) -> int:
    return cell.cell_len if isinstance(cell, Text) else Text.from_markup(cell).cell_len if isinstance(cell, str) else 0


def _table(
    title: str | None, cols: Sequence[_Col], records: Sequence[Record], wide: bool, width: int | None = None
) -> Table:
    """The wide view has every column; the default view its ``default`` ones, less those marked ``drop`` (highest
    first) while the table is wider than ``width``."""
    shown = [c for c in cols if wide or c.default]
    table = _build(title, shown, records)
    droppable = sorted((c for c in shown if c.drop), key=lambda c: -c.drop)
    while not wide and width is not None and droppable and _natural_width(table) > width:
        shown.remove(droppable.pop(0))
        table = _build(title, shown, records)
    return table


def _build(title: str | None, shown: Sequence[_Col], records: Sequence[Record]) -> Table:
    rows = [[c.cell(r) for c in shown] for r in records]
    t = Table(title=title, expand=False)
    for i, c in enumerate(shown):
        if c.ident:
            # A fixed width keeps rich's first way to fit a wide table (wrapping the widest columns) off the ids.
            width = max([cell_len(c.header), *(_cell_len(r[i]) for r in rows)])
            t.add_column(c.header, justify=c.justify, width=width, overflow="fold")
        else:
            t.add_column(c.header, justify=c.justify, overflow=c.overflow)
    for row in rows:
        t.add_row(*row)
    return t


def _natural_width(table: Table) -> int:
    console = Console(width=10_000)
    return Measurement.get(console, console.options, table).maximum


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"
