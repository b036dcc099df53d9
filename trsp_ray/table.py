"""Plain-text and markdown tables, the way people read results in a terminal."""

from __future__ import annotations


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"
    return str(value)


def render(rows: list[dict], columns: list[str]) -> str:
    """A fixed-width table with a header rule; numbers right-aligned."""
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[k]) for row in cells)) if cells else len(c) for k, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) for r in rows if r.get(c) is not None) for c in columns]
    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric))
    out = [line(columns), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    return "\n".join(out)


def markdown(rows: list[dict], columns: list[str]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(out)
