"""Plain-text and markdown tables, the way people read results in a terminal.

The one table renderer (STYLE.md rule 13): the benchmark, the pruning run, the evaluation report
and the reproduction report differ only in how a cell is formatted and whether numbers line up
on the right, which are arguments here.
"""

from __future__ import annotations

from collections.abc import Callable

Format = Callable[[dict, str], str]  # (row, column) -> cell text


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"
    return str(value)


def _default_fmt(row: dict, column: str) -> str:
    return _cell(row.get(column, ""))


def render(rows: list[dict], columns: list[str], *, fmt: Format | None = None, numbers_right: bool = True,
           rule: bool = True, trim: bool = False) -> str:
    """A fixed-width table, columns two spaces apart.

    `fmt(row, column)` gives a cell's text (default: floats to 2 decimals, thousands separated);
    `numbers_right` right-aligns columns whose values are all numbers (else every column is
    left-aligned); `rule` puts a dashed line under the header; `trim` drops trailing spaces.
    """
    fmt = fmt or _default_fmt
    cells = [[fmt(r, c) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[k]) for row in cells)) if cells else len(c) for k, c in enumerate(columns)]
    numeric = [numbers_right and all(isinstance(r.get(c), (int, float)) for r in rows if r.get(c) is not None)
               for c in columns]

    def line(values):
        text = "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric))
        return text.rstrip() if trim else text

    out = [line(columns)] + (["  ".join("-" * w for w in widths)] if rule else [])
    out += [line(row) for row in cells]
    return "\n".join(out)


def markdown(rows: list[dict], columns: list[str], *, fmt: Format | None = None) -> str:
    """A markdown table; a "|" inside a cell is escaped so it cannot split the row."""
    fmt = fmt or _default_fmt
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(fmt(r, c).replace("|", "\\|") for c in columns) + " |" for r in rows]
    return "\n".join(out)
