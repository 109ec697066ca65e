"""What ddpatch does with a variant, through its command line: apply, check, verify.

Shared by ``tests/test_drift.py`` and ``python tests/drift/table.py`` (which prints the
per-variant table that README.md records).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from patcher.results import EXIT_FAILED

#: apply/check found a site they cannot patch (test_drift and table.py read it from here)
EXIT_NO_MATCH = EXIT_FAILED
RECIPE = ["--recipe", "qwen3_6-gdn"]
PRESETS = ["--preset", "tiny-qwen3_5", "--preset", "tiny-qwen3_5-vlm"]
# small but still sensitive: a patch that leaves the recurrent state uncommitted (native crops
# without verify_forward) diverged at new token 12-13 here, and the code-shape-only patch within
# 9; budget 8 on a block of 4 always leaves room for sibling branches in the tree
BLOCK = 4  # verify's default draft block: a round that keeps 1 < a < BLOCK tokens accepted part of it
VERIFY_SETTINGS = ["--seeds", "0", "--prompts", "2", "--max-new-tokens", "24", "--tree-budgets", "8", "--timeout", "300", "--greedy-only"]


def cli(*args, home: Path | None = None) -> tuple[int, dict | None, str]:
    """Run ``ddpatch ARGS --format json`` in process; (exit code, JSON payload or None, raw output)."""
    from click.testing import CliRunner

    from patcher.cli import main

    env = {"DDPATCH_HOME": str(home)} if home is not None else None
    result = CliRunner().invoke(main, [str(a) for a in args] + ["--format", "json"], env=env, catch_exceptions=True)
    raw = getattr(result, "stdout", None) or result.output
    payload = None
    start = raw.find("{")  # a warning printed by upstream code may come first
    if start >= 0:
        try:
            payload = json.loads(raw[start:])
        except json.JSONDecodeError:
            payload = None
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        tb = "".join(traceback.format_exception(result.exception))
        return 99, payload, raw + "\n" + tb
    return result.exit_code, payload, raw


@dataclass
class Report:
    """One ``apply`` or ``check`` run."""

    exit_code: int
    payload: dict | None
    raw: str

    @property
    def statuses(self) -> dict[str, str]:
        return {s["id"]: s["status"] for s in (self.payload or {}).get("steps", [])}

    def sites(self, status: str) -> list[dict]:
        """Every anchor or site entry with ``status``, with its step id."""
        out = []
        for step in (self.payload or {}).get("steps", []):
            for entry in list(step.get("anchors", [])) + list(step.get("sites", [])):
                if entry.get("status") == status:
                    out.append({"step": step["id"], **entry})
        return out

    def no_match_sites(self) -> list[str]:
        return sorted({f"{s['step']} at {s.get('path')}:{s.get('function') or s.get('line')}" for s in self.sites("no-match")})

    @property
    def error(self) -> str | None:
        return (self.payload or {}).get("error")


@dataclass
class VerifyReport:
    exit_code: int
    passed: bool
    failures: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float | None = None
    lossless: set[tuple[str, str]] = field(default_factory=set)  # (model, method) whose lossless check passed
    partial: set[tuple[str, str]] = field(default_factory=set)  # (model, method) with a round that kept part of its block

    def describe(self) -> str:
        if self.passed:
            return f"pass ({self.seconds:.0f} s)" if self.seconds else "pass"
        if self.error:
            return f"error: {self.error}"
        return "FAIL: " + "; ".join(self.failures)


def apply(src: Path, out: Path, home: Path) -> Report:
    return Report(*cli("apply", *RECIPE, src, "--out", out, "-j", "1", home=home))


def check(src: Path, home: Path) -> Report:
    return Report(*cli("check", *RECIPE, src, "-j", "1", home=home))


def verify(tree: Path) -> VerifyReport:
    code, payload, raw = cli("verify", tree, *PRESETS, *VERIFY_SETTINGS)
    payload = payload or {}
    failures = []
    for c in payload.get("checks", []):
        if not c.get("passed"):
            failures.append(f"{c['check']}: {c.get('evidence', '')}")
    lossless, partial = set(), set()
    for m in payload.get("models", []):
        for c in m.get("checks", []):
            if not c.get("passed"):
                failures.append(f"{m['model']} {c['check']}: {c.get('evidence', '')}"[:300])
            elif c["check"].startswith("lossless: "):
                lossless.add((m["model"], c["check"][len("lossless: ") :]))
        for row in m.get("methods", []):
            if any(1 < int(k) < BLOCK for k in (row.get("acceptance_histogram") or {})):
                partial.add((m["model"], row["method"]))
    error = payload.get("error") or (None if payload else raw.strip()[-300:] or "no output")
    passed = bool(payload.get("passed")) and code == 0
    return VerifyReport(code, passed, failures, error, payload.get("seconds"), lossless, partial)


def required_lossless(base: str, methods=None) -> set[tuple[str, str]]:
    """The lossless checks a pass must contain: every method of the layout on both presets (``methods``: a variant's
    own, where its decoder is no longer the layout's, e.g. a drafter's ``spec_generate`` loop)."""
    methods = methods or (["dflash", "ddtree_tb8"] if base == "ddtree" else ["dflash"])
    return {(preset, m) for preset in PRESETS[1::2] for m in methods}


def names_site(entry: dict) -> bool:
    """A no-match entry a user can act on: a file and a function or a line; or, for an anchor
    function that is gone from the tree, that function's name (there is no file to name)."""
    if entry.get("path"):
        return bool(entry.get("function") or entry.get("line"))
    return bool(entry.get("function")) and "not defined" in str(entry.get("message", ""))


def matches(entry: dict, expected) -> bool:
    """Whether a no-match entry is exactly the expected site: its step, its function, and its
    file (a whole path component match; ``file=None`` only for an entry that names no file)."""
    path = str(entry.get("path") or "").replace("\\", "/")
    if expected.file is None:
        where = not path
    else:
        where = bool(path) and (path == expected.file or path.endswith("/" + expected.file))
    return entry["step"] == expected.step and entry.get("function") == expected.function and where


def unexpected_no_matches(entries: list[dict], expected: tuple) -> list[str]:
    """What keeps a run's no-match sites from being exactly ``expected``: every extra site and
    every expected site that is missing (empty when they are the same)."""
    problems = [f"extra: {e['step']} at {e.get('path')}:{e.get('function') or e.get('line')}"
                for e in entries if not any(matches(e, x) for x in expected)]
    problems += [f"missing: {x}" for x in expected if not any(matches(e, x) for e in entries)]
    return problems


os.environ.setdefault("OMP_NUM_THREADS", "1")
