"""One entry point per result kind for the formats it has: ``render_ci_as`` gives ci's text, JSON, JUnit or SARIF;
``concise_text`` gives a patch report one line per site."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..results import NO_MATCH, PENDING, SKIPPED, CIResult, Report
from .json_report import ci_payload
from .junit import render_junit
from .sarif import render_sarif
from .text import render_ci

CI_FORMATS = ("text", "json", "junit", "sarif")


def render_ci_as(result: CIResult, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(ci_payload(result), indent=2) + "\n"
    if fmt == "junit":
        return render_junit(result)
    if fmt == "sarif":
        return json.dumps(render_sarif(result), indent=2) + "\n"
    return render_ci(result)


def _shown(root: Path, rel: str | None) -> str:
    """A site's path as an editor opens it: relative to the working folder when under it."""
    base = root if root.is_dir() else root.parent
    full = base / rel if rel else root
    try:
        return os.path.relpath(full)
    except ValueError:  # another drive (Windows)
        return str(full)


def concise_text(report: Report) -> str:
    """``--output-format concise``: one ``path:line:col: step status message`` line per site, anchor
    failure, skipped file and file that would change without a site (the runtime copy)."""
    out: list[str] = []
    with_sites = set()
    for step in report.steps:
        for s in step.sites:
            with_sites.add(s.path)
            out.append(f"{_shown(report.root, s.path)}:{s.line}:{s.column}: {step.spec.id} {s.status} {s.message}")
        for a in step.anchors:
            if a.status in (NO_MATCH, SKIPPED):
                out.append(f"{_shown(report.root, a.path)}:{a.line or 1}:1: {step.spec.id} {a.status} {a.function}: {a.message}")
        if not step.sites and not step.anchors and step.status == NO_MATCH:
            out.append(f"{_shown(report.root, None)}:1:1: {step.spec.id} {NO_MATCH} nothing matched")
    for f in report.skipped:
        out.append(f"{_shown(report.root, f.path)}:1:1: - {SKIPPED} {f.error}")
    for n in report.notes:
        out.append(f"{_shown(report.root, n.path)}:{n.line}:{n.column}: {n.step} {n.status} {n.message}")
    for i in report.import_issues:
        out.append(f"{_shown(report.root, i.path)}:{i.line}:1: - {'unresolved-import' if i.blocking else 'warning'} "
                   f"import {i.module}: {i.message}")
    for f in report.changed:
        if f.path not in with_sites:
            what = "new file" if f.original is None else "changed"
            out.append(f"{_shown(report.root, f.path)}:1:1: - {PENDING} {what} (ddpatch runtime copy)")
    def where(line: str) -> tuple:  # by file, then position, as an editor lists them
        path, ln, col, _ = line.split(":", 3)
        return path, int(ln), int(col)

    return "".join(line.rstrip() + "\n" for line in sorted(out, key=where))
