"""The plain result objects every layer returns and the report layer renders.

The engine returns a ``Report`` (per step and anchor a status, with the ``Site``s behind it,
per file the new text); ``verify`` an ``Outcome`` (the child's result dict and its
check rows, JSON: the renderers read each as a ``Check``, ``patcher/verify/check.py``); ``ci`` a ``CIResult`` (a ``CommitEval`` per evaluated commit and a ``Finding`` per
status change). They are data: no I/O, no rendering. Each ``as_dict`` is its plain-data
form (what the JSON report prints and what ``ci`` stores per commit).

Imports: stdlib and ``patcher.__version__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__

# ----------------------------------------------------------------------------- statuses
APPLIED = "applied"
ALREADY_APPLIED = "already-applied"
FIXED_UPSTREAM = "fixed-upstream"
NO_MATCH = "no-match"
#: Statuses given after the engine has run: ``pending`` is an ``applied`` site that was not
#: written (check, diff, a blocked apply); ``skipped`` is a site or anchor in a file that was skipped.
PENDING, SKIPPED = "pending", "skipped"
#: Not a status but a note: a site a step saw and left alone because it could not tell what it is (a bare cache given
#: to a model that nothing says is the target). The engine moves these out of the sites into ``FileResult.notes``.
UNCLASSIFIED = "unclassified"
#: The statuses that say a step holds.
GREEN = frozenset({APPLIED, ALREADY_APPLIED, FIXED_UPSTREAM})
#: The exit codes of every command, as ruff's (documented once, in docs/exit-codes.md):
#: 0 clean; 1 findings (changes pending in check/diff, a no-match step, a skipped file, a failed
#: verify check, a lossy step selection); 2 usage or input error; 3 internal crash; 130 Ctrl-C.
EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
#: Another name for ``EXIT_FAILED``: the run found something (not an error of the input).
EXIT_FINDINGS = EXIT_FAILED
#: Pseudo-step of ci findings about upstream-layout detection.
LAYOUT = "(layout)"


# ----------------------------------------------------------------------------- the engine
@dataclass
class Site:
    status: str
    line: int
    column: int
    function: str | None
    message: str
    step: str = ""
    path: str = ""
    #: The node, until the engine places the site (it computes positions only for a file with sites).
    node: Any = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "function": self.function,
            "message": self.message,
        }


@dataclass
class ImportIssue:
    """An import of the tree that resolves to nothing (``blocking``: in a file the decoders import, so ``verify``
    cannot load them and ``apply`` writes nothing)."""

    path: str
    line: int
    module: str
    message: str
    blocking: bool
    #: in a file the decoders import (blocking, or a module merely not installed here)
    reached: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "line": self.line, "module": self.module, "message": self.message, "blocking": self.blocking,
                "reached": self.reached}


@dataclass
class FileResult:
    path: str
    original: str | None  # None for a file ddpatch creates
    patched: str | None = None  # None when unchanged
    sites: list[Site] = field(default_factory=list)
    #: sites a step left alone because it could not tell what they are (``UNCLASSIFIED``): said, never silent
    notes: list[Site] = field(default_factory=list)
    functions: dict[str, int] = field(default_factory=dict)  # name -> line
    needs_runtime: bool = False
    error: str | None = None
    encoding: str = "utf-8"  # the file's own (PEP 263 cookie or BOM: "utf-8-sig"); kept when written

    @property
    def changed(self) -> bool:
        return self.patched is not None and self.patched != self.original

    def encoded(self) -> bytes:
        """The patched text as the bytes to write, in the file's own encoding."""
        return (self.patched or "").encode(self.encoding)


@dataclass
class AnchorResult:
    function: str
    status: str
    message: str
    path: str | None = None
    line: int | None = None

    def as_dict(self) -> dict:
        return {"function": self.function, "status": self.status, "message": self.message, "path": self.path, "line": self.line}


@dataclass
class StepResult:
    spec: Any  # patcher.engine.recipe.StepSpec
    status: str
    anchors: list[AnchorResult]
    sites: list[Site]

    def as_dict(self) -> dict:
        return {
            "id": self.spec.id,
            "codemod": self.spec.codemod,
            "status": self.status,
            "anchors": [a.as_dict() for a in self.anchors],
            "sites": [s.as_dict() for s in self.sites],
        }


@dataclass
class VendoredFolder:
    """A folder of the tree that looks like a copy of a third-party package (``patcher.engine.vendored``)."""

    path: str  # tree-relative
    reason: str  # "named third_party", "has its own pyproject.toml", "holds rich-13.7.1.dist-info"
    files: int  # Python files in it
    #: What kept it in the run ("defines ddtree_generate in x.py"); None: left out, its files not parsed.
    decoder: str | None = None

    @property
    def left_out(self) -> bool:
        return self.decoder is None

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason, "files": self.files, "checked": not self.left_out,
                "decoder": self.decoder}


@dataclass
class Report:
    recipe: Any  # patcher.engine.recipe.Recipe
    root: Path
    upstream: str | None
    files: list[FileResult]
    steps: list[StepResult]
    missing_anchors: list[str]
    #: Folders that look vendored: those left out (not parsed) and those checked after all.
    vendored: list[VendoredFolder] = field(default_factory=list)
    #: the files that hold a decoder (the tree survey), each with why
    decoders: dict[str, str] = field(default_factory=dict)
    #: what the run left out: the --exclude globs, and per file the glob (or reason) that left it out
    exclude: tuple[str, ...] = ()
    excluded: dict[str, str] = field(default_factory=dict)
    #: imports that resolve to nothing (the blocking ones stop apply)
    import_issues: list[ImportIssue] = field(default_factory=list)

    @property
    def changed(self) -> list[FileResult]:
        return [f for f in self.files if f.changed]

    @property
    def notes(self) -> list[Site]:
        return [n for f in self.files for n in f.notes]

    @property
    def blocking_imports(self) -> list[ImportIssue]:
        return [i for i in self.import_issues if i.blocking]

    @property
    def skipped(self) -> list[FileResult]:
        return [f for f in self.files if f.error]

    @property
    def no_match(self) -> list[StepResult]:
        return [s for s in self.steps if s.status == NO_MATCH]

    def exit_code(self, pending: bool) -> int:
        """1 (a finding) if a step is no-match, a file was skipped, an import the decoders need resolves to nothing,
        or ``pending`` and a file would change; else 0."""
        if self.no_match or self.skipped or self.blocking_imports:
            return EXIT_FAILED
        return EXIT_FAILED if pending and self.changed else EXIT_OK

    def as_dict(self) -> dict:
        return {
            "recipe": self.recipe.name,
            "recipe_version": self.recipe.version,
            "ddpatch": __version__,
            "root": str(self.root),
            "upstream": self.upstream,
            "layout_detected": self.upstream is not None,
            "missing_anchors": self.missing_anchors,
            "decoders": self.decoders,
            "vendored": [v.as_dict() for v in self.vendored],
            "exclude": list(self.exclude),
            "excluded": [{"path": p, "by": by} for p, by in self.excluded.items()],
            "unresolved_imports": [i.as_dict() for i in self.import_issues],
            "notes": [n.as_dict() for n in self.notes],
            "steps": [s.as_dict() for s in self.steps],
            "files": [
                {"path": f.path, "changed": f.changed, "created": f.original is None, "error": f.error}
                for f in self.files
                if f.changed or f.error
            ],
        }


@dataclass
class ApplyResult:
    """What ``apply`` did: the report, the files written (under ``out``, or in place), and whether a
    no-match step or a skipped file blocked every write."""

    report: Report
    written: list[str] = field(default_factory=list)
    out: Path | None = None
    blocked: bool = False
    #: Lossless steps the selection left out (``api.lossy_steps``).
    lossy: list[str] = field(default_factory=list)


@dataclass
class RevertResult:
    """What ``revert`` did: the files restored; with ``--force``, (file, backup) for each file whose
    later edits it overwrote; or the journal that was already reverted (nothing to do)."""

    restored: list[str] = field(default_factory=list)
    overwritten: list[tuple[str, str]] = field(default_factory=list)
    already_reverted: str | None = None


@dataclass
class StepDoc:
    """A recipe step as ``recipes show`` presents it: its spec and its codemod's own documentation."""

    spec: Any  # patcher.engine.recipe.StepSpec
    description: str
    params: dict[str, Any]
    #: (before, after, note) examples, dedented; ``before == after`` marks code the step leaves alone.
    examples: list[Any]


# ----------------------------------------------------------------------------- verify
@dataclass
class Outcome:
    result: dict
    seconds: float
    log: list[str] = field(default_factory=list)

    @property
    def checks(self) -> list[dict]:
        """Every check row as JSON, the run's own then each model's (live: ``api`` settles hints into them)."""
        return list(self.result.get("checks", [])) + [c for m in self.result.get("models", []) for c in m["checks"]]

    @property
    def passed(self) -> bool:
        checks = self.checks
        return bool(checks) and all(c["passed"] for c in checks) and not self.result.get("fatal")


@dataclass
class Refereed:
    """``ddpatch referee``'s result: plain data (``patcher.referee.run``), and the exit code its verdict means."""

    result: dict

    @property
    def passed(self) -> bool:
        return bool(self.result.get("verdict", {}).get("passed"))


    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.passed else EXIT_FAILED


# ----------------------------------------------------------------------------- ci
@dataclass
class CommitEval:
    """The recipe's result on one commit."""

    sha: str
    date: str = ""
    subject: str = ""
    upstream: str | None = None
    #: step id -> StepResult.as_dict() (status, anchors, sites); a step that does not apply is absent.
    steps: dict[str, dict] = field(default_factory=dict)
    missing_anchors: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    error: str | None = None
    verify: dict | None = None
    seconds: float = 0.0

    @property
    def short(self) -> str:
        return self.sha[:7]

    def status(self, step: str) -> str | None:
        if step == LAYOUT:
            return self.upstream
        entry = self.steps.get(step)
        return entry["status"] if entry else None

    @property
    def no_match(self) -> list[str]:
        """Steps that fail here: no-match, or not checked because a file they need was skipped."""
        return [sid for sid, s in self.steps.items() if s["status"] not in GREEN]

    @property
    def verify_failed(self) -> bool:
        return self.verify is not None and self.verify.get("passed") is False

    @property
    def green(self) -> bool:
        return bool(self.steps) and not self.no_match and not self.error and not self.verify_failed

    def as_dict(self) -> dict:
        return {
            "commit": self.sha,
            "short": self.short,
            "date": self.date,
            "subject": self.subject,
            "upstream": self.upstream,
            "error": self.error,
            "missing_anchors": self.missing_anchors,
            "skipped_files": self.skipped,
            "changed_files": self.changed,
            "steps": [{"id": sid, **{k: v for k, v in s.items() if k != "id"}} for sid, s in self.steps.items()],
            "verify": self.verify,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Finding:
    """A step's status changed between two consecutive commits of the range."""

    step: str
    before: str | None
    after: str | None
    previous: CommitEval
    commit: CommitEval
    first: bool  # the first change of this step in the range
    hunk: str = ""
    hunk_files: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        step = self.commit.steps.get(self.step, {})
        return {
            "step": self.step,
            "from": self.before,
            "to": self.after,
            "first": self.first,
            "commit": self.commit.sha,
            "short": self.commit.short,
            "date": self.commit.date,
            "subject": self.commit.subject,
            "previous": self.previous.sha,
            "anchors": step.get("anchors", []),
            "hunk_files": self.hunk_files,
            "hunk": self.hunk,
        }


@dataclass
class CIResult:
    recipe: Any
    repo: Any  # patcher.ci.git.Repo
    rev: str
    since: str | None
    forced_upstream: str | None
    commits: list[str]
    infos: dict[str, tuple[str, str]]
    evals: dict[str, CommitEval]
    findings: list[Finding]
    bisected: bool
    verify: bool
    lock: dict | None = None
    seconds: float = 0.0

    @property
    def tip(self) -> CommitEval:
        return self.evals[self.commits[-1]]

    @property
    def evaluated(self) -> list[CommitEval]:
        return [self.evals[c] for c in self.commits if c in self.evals]

    @property
    def step_ids(self) -> list[str]:
        return [s.id for s in self.recipe.steps]

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.tip.green else EXIT_FAILED

    def first_change(self, step: str) -> Finding | None:
        return next((f for f in self.findings if f.step == step and f.first), None)

    def change_in_effect(self, step: str) -> Finding | None:
        """The newest change of ``step`` in the range: the one whose status holds at the tip (what to blame)."""
        return next((f for f in reversed(self.findings) if f.step == step), None)

    def as_dict(self) -> dict:
        tip = self.tip
        return {
            "command": "ci",
            "ddpatch": __version__,
            "recipe": self.recipe.name,
            "recipe_version": self.recipe.version,
            "repository": str(self.repo.path),
            "rev": self.rev,
            "since": self.since,
            "forced_upstream": self.forced_upstream,
            "range": self.commits,
            "bisected": self.bisected,
            "evaluated": len(self.evals),
            "steps": self.step_ids,
            "commits": [e.as_dict() for e in self.evaluated],
            "findings": [f.as_dict() for f in self.findings],
            "tip": {"commit": tip.sha, "upstream": tip.upstream, "no_match": tip.no_match, "verify_failed": tip.verify_failed,
                    "green": tip.green},
            "lock": self.lock,
            "passed": self.exit_code == EXIT_OK,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 2),
        }

