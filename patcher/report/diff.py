"""Unified diffs (plain, or coloured on a terminal) and diff stats of a patch report."""

from __future__ import annotations

import difflib
from typing import IO

from ..results import FileResult, Report
from .console import console


def unified_diff(f: FileResult) -> str:
    old = (f.original or "").splitlines(keepends=True)
    new = (f.patched or "").splitlines(keepends=True)
    a = "/dev/null" if f.original is None else f"a/{f.path}"
    lines = difflib.unified_diff(old, new, a, f"b/{f.path}")
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def diff_text(report: Report, created: bool = True) -> str:
    """The unified diff of every changed file; ``created=False`` leaves out files ddpatch adds."""
    return "".join(unified_diff(f) for f in report.changed if created or f.original is not None)


def diff_stat(report: Report) -> str:
    rows = []
    total_add = total_del = 0
    for f in report.changed:
        add = rem = 0
        for line in unified_diff(f).splitlines()[2:]:
            if line.startswith("+"):
                add += 1
            elif line.startswith("-"):
                rem += 1
        total_add, total_del = total_add + add, total_del + rem
        rows.append((f.path, add, rem))
    width = max((len(p) for p, _, _ in rows), default=0)
    out = [f" {p.ljust(width)} | {a + r:4d} {'+' * min(a, 40)}{'-' * min(r, 40)}" for p, a, r in rows]
    out.append(f" {len(rows)} file{'s' if len(rows) != 1 else ''} changed, {total_add} insertions(+), {total_del} deletions(-)")
    return "\n".join(out) + "\n"


def print_diff(report: Report, color: str = "auto", stream: IO[str] | None = None, created: bool = True) -> None:
    con = console(stream, color)
    text = diff_text(report, created)
    if not con.is_terminal or color == "never":
        con.file.write(text)
        return
    from rich.text import Text

    for line in text.splitlines():
        style = ""
        if line.startswith(("+++", "---")):
            style = "bold"
        elif line.startswith("+"):
            style = "green"
        elif line.startswith("-"):
            style = "red"
        elif line.startswith("@@"):
            style = "cyan"
        con.print(Text(line, style=style))
