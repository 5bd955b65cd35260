"""Plain-text rendering shared by the report, the audit and the command line.

Tables travel as data (:class:`Table`) and become text at the edge: aligned plain text here, rich and
markdown in :mod:`rope_dedup.tools.render`. Plain text keeps within :data:`TEXT_WIDTH` columns by
splitting a wide table into several that each repeat its first column, and by wrapping a cell that is
wider than the room left: nothing is cut.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Callable, Sequence

# A terminal, a CI log pane or a PR comment shows 100 columns without scrolling.
TEXT_WIDTH = 100


@dataclass(frozen=True)
class Row:
    """One row's cells; ``flagged`` rows are the ones a caption's mark explains, ``section`` starts a group
    of rows (a new layer) that a renderer may set apart."""

    cells: tuple[str, ...]
    flagged: bool = False
    section: bool = False


@dataclass(frozen=True)
class Table:
    """A titled table: short column names, rows, and the legend that spells the names out (``caption``)."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[Row, ...]
    caption: str | None = None

    def cells(self) -> list[tuple[str, ...]]:
        return [row.cells for row in self.rows]


def split_columns(count: int, fits: Callable[[list[int]], bool]) -> list[list[int]]:
    """Column indices per part of a table too wide to show whole: each part is column 0 (what names the
    row) and as many of the next columns as ``fits`` allows. A column that fits nowhere gets a part of its
    own, where its cells must wrap."""
    parts, current = [], [0]
    for column in range(1, count):
        if len(current) > 1 and not fits([*current, column]):
            parts.append(current)
            current = [0]
        current.append(column)
    parts.append(current)
    return parts


def format_table(rows: Sequence[tuple[str, ...]], width: int | None = TEXT_WIDTH) -> list[str]:
    """``rows`` (the first is the header) as aligned lines no wider than ``width`` (None: as wide as the
    cells). A table that does not fit is split into parts under one another, each repeating column 0; a
    cell wider than the room its part leaves wraps onto further lines of its column."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    if width is None:
        return [_line(row, widths) for row in rows]
    widths[0] = min(widths[0], width // 2)  # a very long row name wraps rather than crowd out the rest

    def line_width(columns: list[int]) -> int:
        return 2 + sum(widths[c] for c in columns) + 2 * (len(columns) - 1)

    lines: list[str] = []
    for part in split_columns(len(widths), lambda columns: line_width(columns) <= width):
        room = width - line_width(part[:1]) - 2 * (len(part) - 1) - sum(widths[c] for c in part[1:-1])
        shown = [widths[c] for c in part[:-1]] + [max(8, min(widths[part[-1]], room))]
        if lines:
            lines.append("")
        for row in rows:
            wrapped = [_wrap(row[c], w) for c, w in zip(part, shown)]
            for depth in range(max(map(len, wrapped))):
                lines.append(_line(tuple(cell[depth] if depth < len(cell) else "" for cell in wrapped), shown))
    return lines


def wrap(line: str, width: int = TEXT_WIDTH) -> list[str]:
    """A line of prose (a note, a list of paths) broken at spaces to ``width``; continuation lines are
    indented two spaces past the line's own indent."""
    if len(line) <= width:
        return [line]
    body = line.lstrip()
    indent = line[:len(line) - len(body)]
    return textwrap.wrap(body, width, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=True, break_on_hyphens=False)


def format_bytes(n: int) -> str:
    if abs(n) < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("KB", "MB", "GB"):
        value /= 1000
        if abs(value) < 1000 or unit == "GB":
            break
    return f"{value:.1f} {unit}"


def _line(cells: tuple[str, ...], widths: list[int]) -> str:
    return "  " + "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()


def _wrap(cell: str, width: int) -> list[str]:
    if len(cell) <= width:
        return [cell]
    return textwrap.wrap(cell, width, break_long_words=True, break_on_hyphens=False) or [""]
