"""Writing a report's changes: refuse what must not be replaced in place, then write each file atomically."""

from __future__ import annotations

import os
import time
from pathlib import Path, PurePosixPath

from ..results import Report
from .classify import mark_skipped
from .files import atomic_write, install_runtime, runtime_owner, unwritable


def refuse_unwritable(report: Report) -> None:
    """Skip, with the reason, each changed file that an in-place apply must not replace.

    ``atomic_write`` replaces the file through its permissions (the folder is what is
    written), so a file its owner made read-only is reported instead. A runtime helper
    that only skipped files would import is not written either.
    """
    base = report.root if report.root.is_dir() else report.root.parent
    for f in report.changed:
        reason = unwritable(base / f.path)
        if reason:
            f.patched, f.error = None, reason
    # a helper that only skipped files would import is not written; one that a file already patched
    # (or about to be) imports is, so that a stale copy is refreshed
    wanted = {PurePosixPath(f.path).parent for f in report.files if f.needs_runtime and not f.error}
    for f in report.changed:
        if runtime_owner(f.path) is not None and runtime_owner(f.path) not in wanted:
            f.patched = None
    mark_skipped(report)


def write_report(report: Report, dest_root: Path) -> list[str]:
    base = report.root if report.root.is_dir() else report.root.parent
    delay = float(os.environ.get("DDPATCH_TEST_WRITE_DELAY") or 0)  # lets a test kill a run between two files
    written = []
    runtime = [f for f in report.changed if runtime_owner(f.path) is not None]
    written += install_runtime(Path(dest_root if dest_root else base), runtime)  # each copy as a whole folder
    for f in report.changed:
        if runtime_owner(f.path) is not None:
            continue
        atomic_write(Path(dest_root if dest_root else base) / f.path, f.encoded())
        written.append(f.path)
        if delay:
            time.sleep(delay)
    return written
