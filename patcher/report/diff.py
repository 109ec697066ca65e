"""Unified diffs (plain, or coloured on a terminal) and diff stats of a patch report."""

from __future__ import annotations

import difflib
from pathlib import PurePosixPath
from typing import IO

from ..results import FileResult, Report
from .console import console


def unified_diff(f: FileResult) -> str:
    old = (f.original or "").splitlines(keepends=True)
    new = (f.patched or "").splitlines(keepends=True)
    a = "/dev/null" if f.original is None else f"a/{f.path}"
    lines = difflib.unified_diff(old, new, a, f"b/{f.path}")
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


RUNTIME_NAME = "_ddpatch_runtime"


def is_runtime(path: str) -> bool:
    """Whether ``path`` is part of the runtime copy ddpatch adds (``_ddpatch_runtime.py`` or a file of ``_ddpatch_runtime/``)."""
    parts = PurePosixPath(path).parts
    return bool(parts) and (parts[-1] == RUNTIME_NAME + ".py" or RUNTIME_NAME in parts[:-1])


def runtime_line(f: FileResult) -> str:
    """One line for a runtime file in a diff: what it is and how to see all of it."""
    n = len((f.patched or "").splitlines())
    what = "new" if f.original is None else "updated"
    return f"# ddpatch runtime copy: {f.path} ({what}, {n} lines; --runtime-diff prints it)\n"


def diff_text(report: Report, created: bool = True, runtime: bool = True) -> str:
    """The unified diff of every changed file; ``created=False`` leaves out files ddpatch adds,
    ``runtime=False`` puts one line per runtime file in place of its diff."""
    out = []
    for f in report.changed:
        if not created and f.original is None:
            continue
        out.append(unified_diff(f) if runtime or not is_runtime(f.path) else runtime_line(f))
    return "".join(out)


def diff_stat_rows(report: Report) -> list[dict]:
    """Per changed file (the runtime copy once, as one row): path, insertions, deletions."""
    rows: list[dict] = []
    runtime = None
    for f in report.changed:
        add = rem = 0
        for line in unified_diff(f).splitlines()[2:]:
            if line.startswith("+"):
                add += 1
            elif line.startswith("-"):
                rem += 1
        if is_runtime(f.path):
            if runtime is None:
                runtime = {"path": "", "insertions": 0, "deletions": 0, "files": []}
                rows.append(runtime)
            runtime["files"].append(f.path)
            runtime["insertions"] += add
            runtime["deletions"] += rem
            continue
        rows.append({"path": f.path, "insertions": add, "deletions": rem})
    if runtime is not None:
        n = len(runtime["files"])
        runtime["path"] = f"{RUNTIME_NAME} (ddpatch runtime copy, {n} file{'s' if n != 1 else ''})"
    return rows


def diff_stat(report: Report) -> str:
    rows = diff_stat_rows(report)
    width = max((len(r["path"]) for r in rows), default=0)
    out = []
    for r in rows:
        a, d = r["insertions"], r["deletions"]
        out.append(f" {r['path'].ljust(width)} | {a + d:4d} {'+' * min(a, 40)}{'-' * min(d, 40)}".rstrip())
    n = sum(len(r.get("files", [r["path"]])) for r in rows)
    added, removed = sum(r["insertions"] for r in rows), sum(r["deletions"] for r in rows)
    out.append(f" {n} file{'s' if n != 1 else ''} changed, {added} insertions(+), {removed} deletions(-)")
    return "\n".join(out) + "\n"


def print_diff(report: Report, color: str = "auto", stream: IO[str] | None = None, created: bool = True, runtime: bool = True) -> None:
    con = console(stream, color)
    text = diff_text(report, created, runtime)
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
        elif line.startswith(("@@", "# ddpatch runtime copy")):
            style = "cyan"
        con.print(Text(line, style=style))
