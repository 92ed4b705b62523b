"""Plain tables for terminals and notebooks (one renderer for every table the workbench prints)."""

from __future__ import annotations

import html
from collections.abc import Sequence


def text_table(columns: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> str:
    """Columns padded to their widest cell, a rule under the header, an optional title line."""
    table = [tuple(columns), *(tuple(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = [title] if title else []
    for n, row in enumerate(table):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def html_table(columns: Sequence[str], rows: Sequence[Sequence[str]], title: str = "", css_class: str = "workbench-table") -> str:
    """The same table as HTML; cells are escaped."""
    head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    heading = f"<p><b>{html.escape(title)}</b></p>" if title else ""
    return f"<div class='{css_class}'>{heading}<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
