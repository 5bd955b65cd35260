"""Plain-text rendering shared by the report, the audit and the command line."""

from __future__ import annotations


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def format_bytes(n: int) -> str:
    if abs(n) < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("KB", "MB", "GB"):
        value /= 1000
        if abs(value) < 1000 or unit == "GB":
            break
    return f"{value:.1f} {unit}"
