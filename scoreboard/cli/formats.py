"""`--format table|json|csv|md` for the commands that print results (`round show`, `ladder`, `compare`).

Markdown is a GitHub pipe table with numbers right-aligned, as `llama-bench -o md` writes it, to paste into a
PR; csv is RFC 4180 with a header row, one row per result; json is each command's own structured output.
Numbers in csv and md are written in full (no thousands separators, no units in the cell).
"""

from __future__ import annotations

import csv
import io
from typing import Any, Sequence

from ..errors import InputError

FORMATS = ("table", "json", "csv", "md")


def pick_format(fmt: str | None, json_flag: bool) -> str:
    """The format asked for: `--format`, or json for the older `--json` flag; refuses an unknown one."""
    if fmt is not None and fmt not in FORMATS:
        import difflib

        near = difflib.get_close_matches(fmt, FORMATS, n=1)
        raise InputError(f"--format {fmt}: not one of {', '.join(FORMATS)}",
                         f"did you mean --format {near[0]}?" if near else f"pass --format {FORMATS[0]}")
    if json_flag and fmt not in (None, "json"):
        raise InputError(f"--json and --format {fmt} ask for two formats", "pass only --format")
    return "json" if json_flag else (fmt or "table")


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}" if abs(v) < 1e6 else f"{v:.0f}"
    return str(v)


def markdown(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A pipe table; a column whose cells are all numbers (or empty) is right-aligned."""
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) and rows for i in range(len(columns))]
    head = "| " + " | ".join(columns) + " |"
    rule = "| " + " | ".join(("-" * max(len(c) - 1, 3) + ":") if numeric[i] else "-" * max(len(c), 3)
                             for i, c in enumerate(columns)) + " |"
    body = ["| " + " | ".join(_cell(v).replace("|", "\\|") for v in r) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def csv_text(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([_cell(v) for v in r])
    return buf.getvalue().rstrip("\n")


def flat(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str) -> str:
    """`rows` as csv or md."""
    return csv_text(columns, rows) if fmt == "csv" else markdown(columns, rows)
