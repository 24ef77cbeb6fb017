"""Plain-text tables for launcher output."""

from __future__ import annotations

import re
from collections.abc import Sequence

_NUMBER = re.compile(r"^[-+]?[\d.,]+(e[-+]?\d+)?[%x]?$")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns separated by ``|``; cells that read as numbers are right-aligned, text left-aligned."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if _NUMBER.match(c) else c.ljust(w) for c, w in zip(row, widths, strict=True)]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])
