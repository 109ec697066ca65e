"""Rendering: unified diffs (plain or coloured), diff stats, and the per-step status table."""

from __future__ import annotations

import difflib
import json
import sys
from typing import IO

from .codemods.base import ALREADY_APPLIED, APPLIED, FIXED_UPSTREAM, NO_MATCH
from .engine import PENDING, SKIPPED, FileResult, Report

STATUS_STYLE = {APPLIED: "green", PENDING: "yellow", ALREADY_APPLIED: "cyan", FIXED_UPSTREAM: "blue", NO_MATCH: "bold red",
                SKIPPED: "bold red"}


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


def console(stream: IO[str] | None = None, color: str = "auto"):
    from rich.console import Console

    stream = stream or sys.stdout
    force = {"always": True, "never": False}.get(color)
    return Console(
        file=stream,
        force_terminal=force,
        no_color=(color == "never"),
        highlight=False,
        soft_wrap=True,
        width=None if (force or stream.isatty()) else 200,
    )


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


def _where(step) -> str:
    if step.anchors:
        parts = []
        for a in step.anchors:
            loc = f"{a.path}:{a.line} " if a.path else ""
            parts.append(f"{loc}{a.function}: {a.status}" + (f" ({a.message})" if a.status in (NO_MATCH, SKIPPED) else ""))
        shown = {a.path for a in step.anchors if a.status == SKIPPED}
        for s in step.sites:  # a skipped file outside the anchors still shows, once
            if s.status == SKIPPED and s.path not in shown:
                shown.add(s.path)
                parts.append(f"{s.path}:{s.line} {s.status} ({s.message})")
        return "\n".join(parts)
    return "\n".join(f"{s.path}:{s.line} {s.status}" for s in step.sites[:6]) or "no site"


def print_summary(report: Report, command: str, verbose: bool = False, color: str = "auto", stream=None) -> None:
    from rich.table import Table

    con = console(stream, color)
    up = report.upstream or "not detected"
    con.print(f"ddpatch {command} · recipe {report.recipe.label} · upstream {up} · {report.root}")
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("step")
    table.add_column("status")
    table.add_column("where")
    for step in report.steps:
        table.add_row(step.spec.id, f"[{STATUS_STYLE.get(step.status, '')}]{step.status}[/]", _where(step))
    con.print(table)
    if verbose:
        for step in report.steps:
            for s in step.sites:
                con.print(f"  {s.path}:{s.line}:{s.column} [{STATUS_STYLE.get(s.status, '')}]{s.status}[/] {step.spec.id}: {s.message}")
    if report.upstream is None:
        markers = "; ".join(f"{u.name}: {', '.join(u.markers)}" for u in report.recipe.upstreams.values())
        con.print(
            f"[yellow]upstream layout not detected[/] (markers {markers}): anchors were not checked and "
            "layout-specific steps were skipped; pass --upstream NAME to check the tree as that layout"
        )
    if report.missing_anchors:
        con.print(f"[yellow]expected but not found in the tree:[/] {', '.join(report.missing_anchors)}")
    # skipped files are failures: the CLI prints one `ddpatch: error:` line each on stderr


def error_lines(report: Report) -> list[str]:
    """One line per failure in ``report``, cause first: skipped files, then steps that no longer match."""
    out = [f"skipped {f.path}: {f.error}" for f in report.skipped]
    for s in report.no_match:
        reasons = "; ".join(a.message for a in s.anchors if a.status == NO_MATCH) or "nothing matched"
        out.append(f"no-match {s.spec.id}: {reasons}")
    return out


def print_json(payload: dict, stream=None) -> None:
    (stream or sys.stdout).write(json.dumps(payload, indent=2) + "\n")
