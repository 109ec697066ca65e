"""The upstream hunk behind a status change: the diff between the two commits, cut down to the
step's files and to the hunks near its sites and anchors."""

from __future__ import annotations

import re

from ..results import LAYOUT, CommitEval, Finding
from .git import Repo



_HUNK_HEAD = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")


def _places(ev: CommitEval, step: str) -> tuple[set[str], dict[str, set[int]], set[str]]:
    paths: set[str] = set()
    lines: dict[str, set[int]] = {}
    names: set[str] = set()
    entry = ev.steps.get(step)
    if not entry:
        return paths, lines, names
    for item in [*entry.get("anchors", []), *entry.get("sites", [])]:
        if item.get("function"):
            names.add(item["function"])
        if item.get("path"):
            paths.add(item["path"])
            if item.get("line"):
                lines.setdefault(item["path"], set()).add(int(item["line"]))
    return paths, lines, names


def hunk(repo: Repo, f: Finding, max_lines: int) -> tuple[str, list[str]]:
    """The upstream diff between the two commits, limited to the step's files and to the hunks near its sites."""
    if f.step == LAYOUT:
        text = repo.diff(f.previous.sha, f.commit.sha, ["*.py"], stat=True)
        return _trim(text, max_lines), []
    old_paths, old_lines, old_names = _places(f.previous, f.step)
    new_paths, new_lines, new_names = _places(f.commit, f.step)
    paths = sorted(old_paths | new_paths)
    text = repo.diff(f.previous.sha, f.commit.sha, paths) if paths else ""
    if not text.strip():
        paths = ["*.py"]
        text = repo.diff(f.previous.sha, f.commit.sha, paths)
    if not text.strip():
        return "", paths
    # by line first (the hunks that touch a site or anchor); by name when no line is touched
    kept = _relevant_hunks(text, set(), old_lines, new_lines) or _relevant_hunks(text, old_names | new_names, old_lines, new_lines)
    return _trim(kept or text, max_lines), paths

_WINDOW = 5  # context lines kept around a relevant line inside a long hunk


def _relevant_hunks(text: str, names: set[str], old_lines: dict[str, set[int]], new_lines: dict[str, set[int]]) -> str:
    """The parts of the diff near the step's sites and anchors.

    A hunk is kept if a changed line, or the enclosing ``def`` in its header, names one of
    the step's functions, or if it reaches one of the step's site or anchor lines (old
    side: the previous commit's, new side: the changed commit's). A long kept hunk (a new
    file, a rewritten function) is cut down to windows around those lines, with correct
    ``@@`` headers.
    """
    out: list[str] = []
    blocks = re.split(r"(?m)^(?=diff --git )", text)
    name_re = re.compile(r"\b(?:%s)\b" % "|".join(map(re.escape, sorted(names)))) if names else None
    for block in blocks:
        if not block.strip():
            continue
        lines = block.splitlines(keepends=True)
        head: list[str] = []
        hunks: list[list[str]] = []
        for line in lines:
            if line.startswith("@@"):
                hunks.append([line])
            elif hunks:
                hunks[-1].append(line)
            else:
                head.append(line)
        old_file = next((l[6:].strip() for l in head if l.startswith("--- a/")), None)
        new_file = next((l[6:].strip() for l in head if l.startswith("+++ b/")), None)
        for l in head:
            if l.startswith("rename from "):
                old_file = l[len("rename from "):].strip()
            elif l.startswith("rename to "):
                new_file = l[len("rename to "):].strip()
        olds, news = old_lines.get(old_file or "", set()), new_lines.get(new_file or "", set())
        keep: list[str] = []
        for hunk in hunks:
            m = _HUNK_HEAD.match(hunk[0].rstrip("\n"))
            if not m:
                continue
            o_no, n_no = int(m.group(1)), int(m.group(3))
            o_no += m.group(2) == "0"  # "-k,0": nothing of the old side, the hunk comes after line k
            n_no += m.group(4) == "0"
            body = hunk[1:]
            numbered = []  # (old line number or None, new line number or None) per body line
            cur = []  # (next old line, next new line) before each body line
            for line in body:
                cur.append((o_no, n_no))
                kind = line[:1]
                if kind == "-":
                    numbered.append((o_no, None))
                    o_no += 1
                elif kind == "+":
                    numbered.append((None, n_no))
                    n_no += 1
                elif kind == " ":
                    numbered.append((o_no, n_no))
                    o_no += 1
                    n_no += 1
                else:  # "\ No newline at end of file"
                    numbered.append((None, None))
            hot = [
                i for i, (line, (o, n)) in enumerate(zip(body, numbered))
                if (o is not None and o in olds) or (n is not None and n in news)
                or (name_re is not None and line[:1] in "+-" and name_re.search(line))
            ]
            if not hot and not (name_re is not None and name_re.search(hunk[0])):
                continue
            if not hot or len(body) <= 4 * _WINDOW + 1:
                keep.append("".join(hunk))
                continue
            wanted = sorted({j for i in hot for j in range(max(0, i - _WINDOW), min(len(body), i + _WINDOW + 1))})
            groups: list[list[int]] = []
            for j in wanted:
                if groups and j == groups[-1][-1] + 1:
                    groups[-1].append(j)
                else:
                    groups.append([j])
            for g in groups:
                part = [body[j] for j in g]
                o_first, n_first = cur[g[0]]
                o_count = sum(1 for l in part if l[:1] in " -")
                n_count = sum(1 for l in part if l[:1] in " +")
                # unified-diff convention: an empty side names the line before it
                keep.append(f"@@ -{o_first if o_count else o_first - 1},{o_count} +{n_first if n_count else n_first - 1},{n_count} @@\n")
                keep.extend(part)
        if keep:
            out.append("".join(head) + "".join(keep))
        elif not hunks and any(l.startswith("rename ") for l in head):
            out.append("".join(head))  # a pure rename of a file that held the step's code
    return "".join(out)


def _trim(text: str, max_lines: int) -> str:
    lines = text.splitlines()
    if max_lines > 0 and len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines; run git diff to see all)"]
    return "\n".join(lines) + ("\n" if lines else "")
