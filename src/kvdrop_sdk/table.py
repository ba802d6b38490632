"""Plain-text tables for reports (metrics, policy lists, benchmarks): one small helper, no deps."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from itertools import zip_longest
from typing import Any

__all__ = ["format_table", "format_value"]


def format_value(value: Any) -> str:
    """Render a cell: floats with 4 significant digits (3 decimals when >= 1000), else ``str``."""
    if isinstance(value, bool) or value is None:
        return "-" if value is None else ("yes" if value else "no")
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    title: str | None = None,
    width: int | None = None,
) -> str:
    """``rows`` (dicts) as an aligned text table: numbers right-aligned, text left-aligned.

    With ``width`` (a terminal's columns) the widest text columns are narrowed (none below its
    header, its longest word or 12 characters) and their cells wrap onto more lines so that the
    table fits."""
    columns = list(columns if columns is not None else (rows[0].keys() if rows else []))
    cells = [[format_value(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    numeric = [
        all(
            isinstance(row.get(c), (int, float)) and not isinstance(row.get(c), bool)
            for row in rows
        )
        and bool(rows)
        for c in columns
    ]

    if width is not None:  # no column narrower than its header or longest word
        words = [
            max([len(c), *(len(w) for r in cells for w in r[i].split())])
            for i, c in enumerate(columns)
        ]
        _narrow(widths, numeric, words, width)

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    def lines(values: Sequence[str]) -> list[str]:
        wrapped = [
            textwrap.wrap(v, w, break_on_hyphens=False) or [""] if len(v) > w else [v]
            for v, w in zip(values, widths)
        ]
        return [line(part) for part in zip_longest(*wrapped, fillvalue="")]

    out = []
    if title:
        out.append(title)
    out.append(line(columns))
    out.append("  ".join("-" * w for w in widths))
    for r in cells:
        out.extend(lines(r))
    return "\n".join(out)


def _narrow(widths: list[int], numeric: list[bool], least: list[int], width: int) -> None:
    """Shrink the widest text columns (none below ``least`` or 12) until the row fits."""
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    while excess > 0:
        text = [i for i, num in enumerate(numeric) if not num and widths[i] > max(least[i], 12)]
        if not text:
            return
        widest = max(text, key=lambda i: widths[i])
        others = [widths[i] for i in text if i != widest]
        floor = max(least[widest], 12, max(others, default=0))
        cut = min(excess, widths[widest] - floor) or 1
        widths[widest] -= cut
        excess -= cut
