"""The failures of apply/check/diff as ``ddpatch: error:`` lines: the cause first, then one short line per refusal.

A refusal is a step's no-match: each site it names, and each anchor no site speaks for, gets one line of at most
``LINE_CHARS`` characters that says where, why (a reason an earlier line of the same step already gave is said
once, "as at PATH:LINE"), and the way forward: ``--exclude`` where the step says no decoder imports the file, else
the edit to make by hand, and ``apply --allow-partial`` for a step the tree stays lossless without.
"""

from __future__ import annotations

from ..results import NO_MATCH, Report

#: The longest line a refusal prints: its reason is cut to fit, its way forward never is.
LINE_CHARS = 1000
#: A reason this long that an earlier refusal of the same step already gave is not given again.
REPEATED_CHARS = 80


def error_lines(report: Report) -> list[str]:
    """One line per failure in ``report``, cause first: skipped files, then each refusal of a step that no longer
    matches, one line per site (or per anchor no site speaks for), each under ``LINE_CHARS``, a reason an earlier
    line of the step gave said once, and each naming the way forward."""
    out = [f"{i.path}:{i.line}: import {i.module}: {i.message}" for i in report.blocking_imports]
    by_reason: dict[str, list[str]] = {}
    for f in report.skipped:
        by_reason.setdefault(f.error, []).append(f.path)
    for reason, paths in by_reason.items():  # one line per reason, not one per file
        names = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        out.append(f"skipped {names}: {reason}" if len(paths) == 1 else f"skipped {len(paths)} files ({names}): {reason}")
        if reason.startswith("read-only"):
            out.append("the tree is read-only here: pass --out DIR to write a patched copy instead")
    elsewhere: dict[str, list[str]] = {}  # a single file: steps whose anchors are simply in other files
    for s in report.no_match:
        failed = [a for a in s.anchors if a.status == NO_MATCH]
        if report.root.is_file() and failed and all(a.path is None and "not defined anywhere" in a.message for a in failed):
            for a in failed:
                elsewhere.setdefault(a.function, []).append(s.spec.id)
            continue
        out += _refusals(report, s, failed)
    if elsewhere:
        steps = sorted({sid for ids in elsewhere.values() for sid in ids})
        out.insert(0 if not report.skipped else len(out), f"{report.root.name} is a single file: {len(steps)} step(s) anchor to functions "
                   f"not in it ({', '.join(elsewhere)}); pass the checkout's root folder")
    return out


def _refusals(report: Report, step, failed) -> list[str]:
    """The lines of one no-match step: each no-match site, then each no-match anchor whose reason no site gave."""
    sites = [x for x in step.sites if x.status == NO_MATCH]
    entries = [(f"{x.path}:{x.line}", _one_line(x.message)) for x in sites]
    said = {m for _where, m in entries}
    entries += [((f"{a.path}:{a.line} " if a.path else "") + f"`{a.function}`", _one_line(a.message)) for a in failed
                if not any(_one_line(a.message).startswith(m) for m in said)]
    if not entries:
        nothing = "nothing matched" + ("" if report.upstream else " (no layout was detected, so no anchor says where the step must act)")
        entries = [("", nothing)]
    lossless = step.spec.id in report.recipe.lossless
    way = (f"without {step.spec.id} the patched tree decodes lossy: make the edit by hand" if lossless
           else "or `apply --allow-partial` writes the other steps and leaves this as it is")
    lines, given = [], []
    for where, message in entries:
        for earlier_where, reason in given:  # a chain an earlier line gave: said once
            cut = _repeated(message, reason)
            if cut is not None:
                message = f"{cut}: as at {earlier_where}"
                break
        else:
            given.append((where, message))
        tail = "" if "--exclude" in message or "--allow-partial" in message else f"; {way}"
        head = f"no-match {step.spec.id}: " + (f"{where}: " if where else "")
        room = LINE_CHARS - len(head) - len(tail) - 1
        lines.append(head + (message if len(message) <= room else message[: room - 1] + "…") + tail)
    return lines


def _one_line(message: str) -> str:
    """A reason that quotes code split over lines (a call with one argument per line), on one line."""
    return " ".join(message.split())


def _repeated(message: str, earlier: str) -> str | None:
    """The head of ``message`` when the rest of it, after a ``": "``, is a reason ``earlier`` ends with."""
    at = message.find(": ")
    while at != -1:
        rest = message[at + 2:]
        if len(rest) >= REPEATED_CHARS and earlier.endswith(rest):
            return message[:at]
        at = message.find(": ", at + 2)
    return None
