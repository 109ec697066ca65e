"""``ddpatch ci``: re-run a recipe against upstream commits and say exactly what changed.

Upstream research code moves: files are renamed, functions move between modules,
arguments are dropped, and some of the problems a recipe fixes get fixed upstream in
another form. A recipe that silently stops matching is the worst outcome, so this
command evaluates the recipe on each commit of a range and names, per step, the first
commit at which the step's status changed, with the upstream hunk that changed it.

The pipeline:

    list commits (git rev-list) -> export each commit's tree to a temp dir (git ls-tree +
    cat-file: the user's checkout, index and refs are never touched; bare repos work)
    -> run_recipe -> [write the patched tree, run_verify] -> bisect per step -> render

Every commit of a short range is evaluated, and a step changed at a commit when its status
there differs from its status at each of the commit's parents (the real parents, so that a
side branch's older code does not look like a change on the main line). A longer range
(more than ``BISECT_THRESHOLD`` commits) is bisected per step along the first-parent line:
the endpoints first, then a binary search for the first commit whose status differs from
its first parent's; a change at a merge is followed into the merged branch, like
``git bisect``. Bisection assumes that a status does not change and change back between two
evaluated commits; ``--all-commits`` evaluates every commit. Evaluated commits are cached
and shared by all steps.

The exit status is judged on the newest commit (``--rev``): older commits of the range are
reported, but a commit that broke the recipe and was fixed since does not fail the run.

Only stdlib and click are imported at module level, so that ``ddpatch --help`` stays fast.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import click

EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2
APPLIED, ALREADY_APPLIED, FIXED_UPSTREAM, NO_MATCH = "applied", "already-applied", "fixed-upstream", "no-match"
GREEN = frozenset({APPLIED, ALREADY_APPLIED, FIXED_UPSTREAM})
#: Ranges longer than this are bisected per step instead of evaluated commit by commit.
BISECT_THRESHOLD = 8
#: Lines of upstream diff shown per finding.
HUNK_LINES = 60
WORKFLOW_TEMPLATE = "ddpatch-upstream-ci.yml"
_LAYOUT = "(layout)"  # pseudo-step of findings about upstream-layout detection


class CIError(Exception):
    """Bad input or an unreadable repository: one line for the user, exit 2."""


# ----------------------------------------------------------------------------- git
def _git_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):
        # a caller's GIT_DIR / GIT_INDEX_FILE / GIT_WORK_TREE must not redirect our reads
        if key.startswith("GIT_") and key not in ("GIT_CONFIG_NOSYSTEM", "GIT_CONFIG_GLOBAL", "GIT_CEILING_DIRECTORIES"):
            del env[key]
    env["GIT_TERMINAL_PROMPT"] = "0"
    env["GIT_OPTIONAL_LOCKS"] = "0"  # reads only: never take the index lock of the user's checkout
    return env


class Repo:
    """Read-only access to a git repository (a checkout or a bare repository)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise CIError(f"repository path does not exist: {self.path}")
        if not self.path.is_dir():
            raise CIError(f"not a git repository (not a directory): {self.path}")
        self.path = self.path.resolve()
        self._env = _git_env()
        self._parents: dict[str, list[str]] = {}
        self._chains: dict[tuple[str, str], list[str]] = {}
        self.git_dir: str | None = None
        try:
            git_dir = self.git("rev-parse", "--absolute-git-dir").strip()
        except CIError as exc:
            raise CIError(f"not a git repository: {self.path} ({exc})") from None
        # From here on, talk to the object store only: no work tree, so a path given inside a
        # checkout changes nothing (pathspecs are from the top) and the checkout is never read.
        self.git_dir = git_dir

    def run(self, *args: str, input: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess:
        where = ["--git-dir", self.git_dir] if self.git_dir else ["-C", str(self.path)]
        try:
            proc = subprocess.run(
                ["git", *where, "-c", "core.quotepath=off", *args],
                input=input,
                capture_output=True,
                env=self._env,
                cwd=self.git_dir or self.path,
            )
        except FileNotFoundError:
            raise CIError("git is not installed (needed by ddpatch ci)") from None
        if check and proc.returncode != 0:
            lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            raise CIError(lines[-1] if lines else f"git {args[0]} failed with status {proc.returncode}")
        return proc

    def git(self, *args: str) -> str:
        return self.run(*args).stdout.decode("utf-8", "replace")

    def commit(self, rev: str, flag: str = "--rev") -> str:
        """The full sha of a commit-ish, or a one-line error."""
        if not rev or rev.startswith("-"):
            raise CIError(f"{flag}: not a revision: {rev!r}")
        proc = self.run("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
        sha = proc.stdout.decode().strip()
        if proc.returncode != 0 or not sha:
            raise CIError(f"{flag}: unknown revision {rev!r} in {self.path}")
        return sha

    def range(self, since: str | None, tip: str) -> list[str]:
        """``since`` (the baseline) then ``since..tip`` oldest first, in topological order; or just ``tip``."""
        if since is None:
            return [tip]
        if since != tip and self.run("merge-base", "--is-ancestor", since, tip, check=False).returncode != 0:
            raise CIError(f"--since {since[:12]} is not an ancestor of --rev {tip[:12]}")
        shas = self.git("rev-list", "--topo-order", "--reverse", f"{since}..{tip}").split()
        return [since, *shas]

    def parents(self, sha: str) -> list[str]:
        if sha not in self._parents:
            self._parents[sha] = self.git("rev-list", "--parents", "-n", "1", sha).split()[1:]
        return self._parents[sha]

    def load_parents(self, since: str, tip: str) -> None:
        for line in self.git("rev-list", "--parents", f"{since}..{tip}").splitlines():
            shas = line.split()
            if shas:
                self._parents[shas[0]] = shas[1:]

    def first_parent_chain(self, tip: str, exclude: str) -> list[str]:
        """The first-parent line from ``tip`` back to (not including) the ancestors of ``exclude``, oldest first."""
        if (tip, exclude) not in self._chains:
            self._chains[tip, exclude] = self.git("rev-list", "--first-parent", "--reverse", tip, f"^{exclude}").split()
        return self._chains[tip, exclude]

    def describe(self, shas: list[str]) -> dict[str, tuple[str, str]]:
        """sha -> (author date, subject)."""
        out: dict[str, tuple[str, str]] = {}
        for i in range(0, len(shas), 500):
            text = self.git("show", "-s", "--no-walk=unsorted", "--format=%H%x00%as%x00%s", *shas[i : i + 500])
            for line in text.splitlines():
                parts = line.split("\x00")
                if len(parts) == 3:
                    out[parts[0]] = (parts[1], parts[2])
        return out

    def export(self, sha: str, dest: Path, want: Callable[[str], bool] | None = None) -> int:
        """Write the tree of ``sha`` under ``dest`` from the object store; returns the number of files.

        Nothing but the object database is read: no checkout, no index, no attributes or
        filters (a tree identical to the commit). Submodules are left out; a symlink is
        written only if it stays inside the tree.
        """
        listing = self.run("ls-tree", "-r", "-z", "--full-tree", sha).stdout.decode("utf-8", "surrogateescape")
        entries = []
        for record in listing.split("\x00"):
            if not record:
                continue
            meta, _, path = record.partition("\t")
            mode, kind, obj = meta.split()
            parts = PurePosixPath(path).parts
            if kind != "blob" or path.startswith("/") or any(p in ("..", ".git") for p in parts):
                continue
            if want is not None and mode != "120000" and not want(path):
                continue
            entries.append((mode, obj, path))
        if not entries:
            return 0
        data = self.run("cat-file", "--batch", input="".join(f"{obj}\n" for _, obj, _ in entries).encode()).stdout
        at = 0
        written = 0
        for mode, _obj, path in entries:
            end = data.index(b"\n", at)
            header = data[at:end].split()
            size = int(header[2])
            blob = data[end + 1 : end + 1 + size]
            at = end + 1 + size + 1
            target = dest.joinpath(*PurePosixPath(path).parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            if mode == "120000":
                link = blob.decode("utf-8", "surrogateescape")
                resolved = os.path.normpath(os.path.join(os.path.dirname(path), link))
                if os.path.isabs(link) or resolved.startswith("..") or (want is not None and not want(resolved)):
                    continue
                os.symlink(link, target)
            else:
                target.write_bytes(blob)
                if mode == "100755":
                    target.chmod(0o755)
            written += 1
        return written

    def diff(self, old: str, new: str, paths: list[str], stat: bool = False) -> str:
        args = ["diff", "--no-color", "--no-ext-diff", "--no-textconv", "-M", "--src-prefix=a/", "--dst-prefix=b/"]
        if stat:
            args.append("--stat=100")
        return self.git(*args, old, new, "--", *paths)


# ----------------------------------------------------------------------------- one commit
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
        if step == _LAYOUT:
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


def _include_filter(recipe) -> Callable[[str], bool]:
    from .engine import covers

    return lambda rel: covers(recipe, rel)


class Evaluator:
    """Evaluates commits once each (cached) in throw-away temp trees."""

    def __init__(self, recipe, repo: Repo, upstream: str | None, verify: dict | None, verify_timeout: float,
                 jobs: int, infos: dict[str, tuple[str, str]], progress: Callable[[str], None] | None = None) -> None:
        self.recipe, self.repo, self.upstream = recipe, repo, upstream
        self.verify, self.verify_timeout, self.jobs = verify, verify_timeout, jobs
        self.infos, self.progress = infos, progress
        self.cache: dict[str, CommitEval] = {}
        self._want = None if verify is not None else _include_filter(recipe)

    def __call__(self, sha: str) -> CommitEval:
        if sha not in self.cache:
            if self.progress:
                self.progress(f"evaluating {sha[:7]} ({len(self.cache) + 1} so far)")
            self.cache[sha] = self._evaluate(sha)
        return self.cache[sha]

    def _evaluate(self, sha: str) -> CommitEval:
        from .engine import EngineError, run_recipe, write_report

        if sha not in self.infos:
            self.infos.update(self.repo.describe([sha]))
        date, subject = self.infos.get(sha, ("", ""))
        ev = CommitEval(sha, date, subject)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"ddpatch-ci-{sha[:7]}-") as tmp:
            tree = Path(tmp) / "tree"
            tree.mkdir()
            self.repo.export(sha, tree, self._want)
            try:
                report = run_recipe(self.recipe, tree, upstream=self.upstream, jobs=self.jobs)
            except EngineError as exc:
                ev.error = str(exc).replace(str(tree), "<tree>")
                for spec in self.recipe.steps:
                    if spec.applies_to(self.upstream):
                        ev.steps[spec.id] = {"id": spec.id, "codemod": spec.codemod, "status": NO_MATCH, "sites": [],
                                             "anchors": [{"function": None, "status": NO_MATCH, "message": ev.error, "path": None, "line": None}]}
                ev.seconds = time.perf_counter() - start
                return ev
            ev.upstream = report.upstream
            ev.steps = {s.spec.id: s.as_dict() for s in report.steps}
            ev.missing_anchors = list(report.missing_anchors)
            ev.skipped = [{"path": f.path, "error": f.error} for f in report.skipped]
            ev.changed = [f.path for f in report.changed]
            if self.verify is not None:
                ev.verify = self._verify(report, tree, write_report)
        ev.seconds = time.perf_counter() - start
        return ev

    def _verify(self, report, tree: Path, write_report) -> dict:
        from .verify import VerifyError, run_verify

        blocked = [s.spec.id for s in report.no_match]
        if blocked:
            return {"passed": None, "skipped": f"not run: step(s) {', '.join(blocked)} no-match", "checks": []}
        write_report(report, tree)
        try:
            outcome = run_verify(tree, timeout=self.verify_timeout, **self.verify)
        except VerifyError as exc:
            return {"passed": False, "error": str(exc).replace(str(tree), "<tree>"), "checks": [
                {"model": "-", "check": "verify runs", "passed": False, "evidence": str(exc).replace(str(tree), "<tree>")}]}
        res = outcome.result
        checks = [{"model": "-", "check": c["check"], "passed": bool(c["passed"]), "evidence": c.get("evidence", "")} for c in res.get("checks", [])]
        for m in res.get("models", []):
            checks += [{"model": m.get("model", "-"), "check": c["check"], "passed": bool(c["passed"]), "evidence": c.get("evidence", "")}
                       for c in m.get("checks", [])]
        return {"passed": outcome.passed, "seconds": round(outcome.seconds, 2), "checks": checks}


# ----------------------------------------------------------------------------- the range
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
    repo: Repo
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
        from . import __version__

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


def _transitions(n: int, status: Callable[[int], Any], known: Callable[[], set[int]]) -> list[tuple[int, int]]:
    """(last index with the old status, first index with the new one) for each change, oldest first.

    ``status(i)`` evaluates commit i (cached by the caller); ``known()`` is the set of
    indices evaluated so far, used to narrow each search. Between two evaluated commits
    with equal status the status is assumed constant, as ``git bisect`` assumes.

    The search runs back from the tip, so that the change in effect at the tip is the one
    found first, also when the history breaks, is fixed, and breaks again: from the tip it
    gallops back (1, 3, 7, 15, ... commits before it) to the nearest commit with another
    status, then bisects between the two. Older changes are searched the same way below
    it, while the oldest commit or an evaluated one in between shows another status.
    """
    out: list[tuple[int, int]] = []
    hi = n - 1
    while hi > 0:
        now = status(hi)
        other = [i for i in known() if i < hi and status(i) != now]
        if not other and status(0) == now:
            break  # constant back to the oldest commit, as far as the evaluations show
        lo = max(other, default=0 if status(0) != now else None)
        step = 1
        while True:
            # every evaluated commit in (lo, hi] has the status ``now``; ``top`` is the oldest of them
            top = min(i for i in known() | {hi} if (lo is None or i > lo) and i <= hi)
            if lo is not None and top - lo <= 1:
                break
            if lo is None or top - step > lo:
                probe = max(top - step, 0)  # gallop back from the tip
                step *= 2
            else:
                probe = (lo + top) // 2  # bisect
            if status(probe) != now:
                lo = probe
        out.append((lo, top))
        hi = lo
    return out[::-1]


def run_ci(
    recipe,
    repo: Path | str | Repo,
    rev: str = "HEAD",
    since: str | None = None,
    upstream: str | None = None,
    verify: dict | None = None,
    verify_timeout: float = 600.0,
    jobs: int = 1,
    bisect_threshold: int | None = BISECT_THRESHOLD,
    hunk_lines: int = HUNK_LINES,
    progress: Callable[[str], None] | None = None,
) -> CIResult:
    """Evaluate ``recipe`` on ``rev`` (or on ``since`` and every commit after it up to ``rev``).

    ``verify`` (options for ``run_verify``, or None) also runs the verifier on every
    evaluated commit whose steps all match. ``bisect_threshold=None`` evaluates every
    commit whatever the length of the range.
    """
    start = time.perf_counter()
    if upstream is not None and upstream not in recipe.upstreams:
        raise CIError(f"--upstream: unknown upstream {upstream!r} for recipe {recipe.name}; known: {', '.join(recipe.upstreams)}")
    repo = repo if isinstance(repo, Repo) else Repo(repo)
    tip = repo.commit(rev, "--rev")
    base = repo.commit(since, "--since") if since is not None else None
    commits = repo.range(base, tip)
    if base is not None and base != tip:
        repo.load_parents(base, tip)
    infos = repo.describe(commits)
    evaluate = Evaluator(recipe, repo, upstream, verify, verify_timeout, jobs, infos, progress)
    bisected = bisect_threshold is not None and len(commits) > bisect_threshold
    steps = [_LAYOUT, *(s.id for s in recipe.steps)]
    if not bisected:
        for sha in commits:
            evaluate(sha)
        changes = _changes_by_parents(repo, commits, steps, evaluate)
    else:
        chain = [commits[0], *repo.first_parent_chain(tip, commits[0])]
        evaluate(chain[0])
        evaluate(chain[-1])
        while True:  # a commit evaluated for one step can reveal a change of another: repeat until nothing new is evaluated
            seen = len(evaluate.cache)
            changes = {step: _chain_changes(repo, chain, step, evaluate) for step in steps}
            if len(evaluate.cache) == seen:
                break
    index = {sha: i for i, sha in enumerate(commits)}
    findings: list[Finding] = []
    for step in steps:
        pairs = sorted(set(changes[step]), key=lambda pair: index.get(pair[1], -1))
        for k, (a, b) in enumerate(pairs):
            prev, first = evaluate(a), evaluate(b)
            findings.append(Finding(step, prev.status(step), first.status(step), prev, first, first=k == 0))
    for f in findings:
        f.hunk, f.hunk_files = _hunk(repo, f, hunk_lines)
    order = {sid: i for i, sid in enumerate(steps)}
    findings.sort(key=lambda f: (index.get(f.commit.sha, -1), order[f.step]))
    return CIResult(recipe, repo, rev, since, upstream, commits, infos, dict(evaluate.cache), findings, bisected,
                    verify is not None, seconds=time.perf_counter() - start)


def _changes_by_parents(repo: Repo, commits: list[str], steps: list[str], evaluate) -> dict[str, list[tuple[str, str]]]:
    """Every commit whose status differs from that of each of its parents (all commits evaluated).

    Comparing with the real parents, not with the neighbour in the topological order,
    keeps a side branch's older code from looking like a change on the main line.
    """
    out: dict[str, list[tuple[str, str]]] = {step: [] for step in steps}
    for sha in commits[1:]:
        parents = repo.parents(sha)
        if not parents:
            continue
        here = evaluate(sha)
        before = [evaluate(p) for p in parents]  # a parent outside the range (a branch's fork point) is evaluated too
        for step in steps:
            if all(p.status(step) != here.status(step) for p in before):
                out[step].append((parents[0], sha))
    return out


def _chain_changes(repo: Repo, chain: list[str], step: str, evaluate, depth: int = 0) -> list[tuple[str, str]]:
    """Bisect the first-parent ``chain`` for ``step``; a change at a merge is followed into the merged branch."""
    index = {sha: i for i, sha in enumerate(chain)}

    def status(i: int):
        return evaluate(chain[i]).status(step)

    def known() -> set[int]:
        return {index[s] for s in evaluate.cache if s in index}

    out: list[tuple[str, str]] = []
    for a, b in _transitions(len(chain), status, known):
        sha = chain[b]
        parents = repo.parents(sha)
        now = status(b)
        merged = next((p for p in parents[1:] if evaluate(p).status(step) == now), None)
        if merged is not None and depth < 32:
            side = repo.first_parent_chain(merged, parents[0])
            fork = repo.parents(side[0])[:1] if side else []
            if fork:
                inner = _chain_changes(repo, [fork[0], *side], step, evaluate, depth + 1)
                if inner:
                    out.extend(inner)
                    continue
        out.append((chain[a], sha))
    return out


# ----------------------------------------------------------------------------- the hunk behind a change
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


def _hunk(repo: Repo, f: Finding, max_lines: int) -> tuple[str, list[str]]:
    """The upstream diff between the two commits, limited to the step's files and to the hunks near its sites."""
    if f.step == _LAYOUT:
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


# ----------------------------------------------------------------------------- the lock file
def default_lock_path() -> Path:
    return Path(__file__).resolve().parent.parent / "vendored" / "upstream.lock"


def update_lock_text(text: str, table: str, commit: str) -> str:
    """``text`` with ``last_verified`` of ``[table]`` set to ``commit``; every other byte kept."""
    import tomllib

    lines = text.splitlines(keepends=True)
    header = last_key = None
    in_table = False
    new_line = f'last_verified = "{commit}"'
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("["):
            in_table = stripped.split("#", 1)[0].strip() == f"[{table}]"
            if in_table:
                header = i
            continue
        if not in_table or not stripped or stripped.startswith("#"):
            continue
        if re.match(r"last_verified\s*=", stripped):
            indent = line[: len(line) - len(line.lstrip())]
            ending = line[len(line.rstrip("\r\n")):] or "\n"
            lines[i] = indent + new_line + ending
            break
        last_key = i
    else:
        if header is None:
            raise CIError(f"the lock file has no [{table}] table")
        at = (last_key if last_key is not None else header) + 1
        ending = "\n" if lines[at - 1].endswith("\n") else ""
        if not ending:
            lines[at - 1] += "\n"
        lines.insert(at, new_line + "\n")
    new = "".join(lines)
    try:
        before, after = tomllib.loads(text), tomllib.loads(new)
    except tomllib.TOMLDecodeError as exc:
        raise CIError(f"the lock file is not valid TOML: {exc}") from None
    after_table = dict(after.get(table, {}))
    if after_table.pop("last_verified", None) != commit or {**before, table: None} != {**after, table: None} or \
            {k: v for k, v in before.get(table, {}).items() if k != "last_verified"} != after_table:
        raise CIError(f"could not update last_verified of [{table}] without touching anything else")
    return new


def update_lock(path: Path, table: str, commit: str) -> bool:
    """Set ``last_verified``; returns whether the file changed."""
    from .engine import atomic_write

    old = path.read_text(encoding="utf-8")
    new = update_lock_text(old, table, commit)
    if new != old:
        atomic_write(path, new)
    return new != old


def apply_lock(result: CIResult, path: Path) -> dict:
    """Record the tip as verified for its upstream when the run is green."""
    table = result.forced_upstream or result.tip.upstream
    info: dict[str, Any] = {"path": str(path), "upstream": table, "commit": result.tip.sha, "updated": False}
    if result.exit_code != EXIT_OK:
        info["reason"] = "not updated: the run is not green"
    elif table is None:
        info["reason"] = "not updated: the upstream layout was not detected (pass --upstream)"
    else:
        info["updated"] = update_lock(path, table, result.tip.sha)
        if not info["updated"]:
            info["reason"] = "already up to date"
    result.lock = info
    return info


# ----------------------------------------------------------------------------- rendering
_SHORT = {APPLIED: "applied", ALREADY_APPLIED: "already", FIXED_UPSTREAM: "fixed-up", NO_MATCH: "NO-MATCH", None: "-"}


def render_text(result: CIResult) -> str:
    out: list[str] = []
    steps = result.step_ids
    rng = f"{result.since[:12]}..{result.rev}" if result.since else result.rev
    out.append(
        f"ddpatch ci · recipe {result.recipe.label} · {result.repo.path} · {rng}: {len(result.commits)} commit(s), "
        f"{len(result.evals)} evaluated{' (bisected)' if result.bisected else ''}"
    )
    out.append("steps: " + ", ".join(f"{i} {sid}" for i, sid in enumerate(steps, 1)))
    width = max(len(v) for v in _SHORT.values())
    up_width = max([8, *(len(e.upstream or "-") for e in result.evaluated)])
    head = f"{'commit':<8} {'date':<10} {'upstream':<{up_width}} " + " ".join(f"{i:<{width}}" for i in range(1, len(steps) + 1))
    if result.verify:
        head += f" {'verify':<6}"
    out.append(head + "  subject")
    last = -1
    for i, sha in enumerate(result.commits):
        ev = result.evals.get(sha)
        if ev is None:
            continue
        if i - last > 1:
            out.append(f"{'':<8} ... {i - last - 1} commit(s) not evaluated (bisection)")
        last = i
        row = f"{ev.short:<8} {ev.date:<10} {(ev.upstream or '-'):<{up_width}} " + " ".join(
            f"{_SHORT.get(ev.status(s), ev.status(s) or '-'):<{width}}" for s in steps
        )
        if result.verify:
            v = ev.verify or {}
            row += f" {'pass' if v.get('passed') else 'skip' if v.get('passed') is None else 'FAIL':<6}"
        tag = " (baseline)" if result.since and i == 0 else ""
        out.append(f"{row}  {ev.subject[:60]}{tag}")
        if ev.error:
            out.append(f"{'':<8} error: {ev.error}")
    if result.findings:
        out.append("")
        out.append("changes (the first commit at which a step's status changed):")
    for f in result.findings:
        label = "upstream layout" if f.step == _LAYOUT else f.step
        order = "first change" if f.first else "then"
        out.append(f"* {label}: {f.before or '-'} -> {f.after or '-'} at {f.commit.short} {f.commit.date} \"{f.commit.subject}\""
                   f" ({order}; previous {f.previous.short})")
        entry = f.commit.steps.get(f.step)
        for a in (entry or {}).get("anchors", []):
            where = f"{a['path']}:{a['line']} " if a.get("path") else ""
            out.append(f"    {a['status']}: {where}{a.get('function') or ''}: {a['message']}")
        if f.hunk:
            out.extend("    | " + line for line in f.hunk.rstrip("\n").splitlines())
    if result.verify:
        for ev in result.evaluated:
            v = ev.verify or {}
            failed = [c for c in v.get("checks", []) if not c["passed"]]
            if v.get("skipped") or failed:
                out.append("")
                out.append(f"verify {ev.short}: {v.get('skipped') or 'FAIL'}")
                out.extend(f"    FAIL {c['model']}: {c['check']}: {c['evidence']}" for c in failed)
    tip = result.tip
    out.append("")
    if result.exit_code == EXIT_OK:
        out.append(f"OK: every step matches at {tip.short}" + (" and verify passed" if result.verify else ""))
    else:
        why = []
        if tip.no_match:
            why.append("no-match: " + ", ".join(tip.no_match))
        if tip.verify_failed:
            why.append("verify failed")
        if tip.error:
            why.append(tip.error)
        if tip.upstream is None and not tip.error:
            why.append("no upstream layout detected, so no anchor was checked (pass --upstream NAME)")
        out.append(f"FAIL at {tip.short}: " + "; ".join(why))
    if result.lock:
        lock = result.lock
        out.append(f"lock {lock['path']}: " + (f"[{lock['upstream']}] last_verified = {lock['commit'][:12]}" if lock["updated"] else lock.get("reason", "")))
    return "\n".join(out) + "\n"


def render_junit(result: CIResult) -> str:
    """JUnit XML: one testsuite per evaluated commit, one testcase per step and per verify check."""
    import xml.etree.ElementTree as ET

    root = ET.Element("testsuites", name=f"ddpatch ci {result.recipe.label}")
    totals = {"tests": 0, "failures": 0, "skipped": 0}
    for ev in result.evaluated:
        suite = ET.SubElement(root, "testsuite", name=f"{ev.short} {ev.subject}"[:200], id=ev.sha, time=f"{ev.seconds:.3f}")
        props = ET.SubElement(suite, "properties")
        for key, value in (("commit", ev.sha), ("date", ev.date), ("upstream", ev.upstream or ""), ("recipe", result.recipe.label)):
            ET.SubElement(props, "property", name=key, value=value)
        counts = {"tests": 0, "failures": 0, "skipped": 0}
        classname = f"{result.recipe.name}.{ev.short}"
        for sid in result.step_ids:
            case = ET.SubElement(suite, "testcase", classname=classname, name=sid, time="0")
            counts["tests"] += 1
            entry = ev.steps.get(sid)
            if entry is None:
                ET.SubElement(case, "skipped", message=f"step does not apply to upstream {ev.upstream or '(undetected)'}")
                counts["skipped"] += 1
                continue
            lines = [f"{a['status']}: {a.get('path') or '-'}:{a.get('line') or '-'} {a.get('function') or ''}: {a['message']}"
                     for a in entry.get("anchors", [])]
            if entry["status"] not in GREEN:
                bad = [a["message"] for a in entry.get("anchors", []) if a["status"] not in GREEN] or ["nothing matched"]
                fail = ET.SubElement(case, "failure", message=f"{entry['status']}: {'; '.join(bad)}"[:1000], type=entry["status"])
                finding = result.change_in_effect(sid) if ev is result.tip else None
                extra = [f"in effect since: {finding.before} -> {finding.after} at {finding.commit.sha} {finding.commit.subject}"] if finding else []
                fail.text = "\n".join(lines + extra)
                counts["failures"] += 1
            else:
                ET.SubElement(case, "system-out").text = f"{entry['status']}\n" + "\n".join(lines)
        v = ev.verify
        if v is not None:
            if v.get("passed") is None:
                case = ET.SubElement(suite, "testcase", classname=f"{classname}.verify", name="verify", time="0")
                ET.SubElement(case, "skipped", message=v.get("skipped", "not run"))
                counts["tests"] += 1
                counts["skipped"] += 1
            for c in v.get("checks", []):
                case = ET.SubElement(suite, "testcase", classname=f"{classname}.verify", name=f"{c['model']}: {c['check']}", time="0")
                counts["tests"] += 1
                if c["passed"]:
                    ET.SubElement(case, "system-out").text = c.get("evidence", "")
                else:
                    ET.SubElement(case, "failure", message=str(c.get("evidence", ""))[:1000], type="verify").text = str(c.get("evidence", ""))
                    counts["failures"] += 1
        suite.set("tests", str(counts["tests"]))
        suite.set("failures", str(counts["failures"]))
        suite.set("errors", "0")
        suite.set("skipped", str(counts["skipped"]))
        for k in totals:
            totals[k] += counts[k]
    root.set("tests", str(totals["tests"]))
    root.set("failures", str(totals["failures"]))
    root.set("errors", "0")
    root.set("skipped", str(totals["skipped"]))
    root.set("time", f"{result.seconds:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _recipe_location(recipe, step: str | None) -> dict:
    """Where a step is declared in the recipe file (for results that have no upstream location)."""
    uri = recipe.source or f"recipes/{recipe.name}.toml"
    text = None
    try:
        if recipe.source.startswith("recipes/"):
            from importlib import resources

            text = resources.files("recipes").joinpath(recipe.source[len("recipes/"):]).read_text(encoding="utf-8")
        elif recipe.source and Path(recipe.source).is_file():
            text = Path(recipe.source).read_text(encoding="utf-8")
    except OSError:
        text = None
    loc: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": uri}}}
    if text and step:
        for i, line in enumerate(text.splitlines(), 1):
            if re.match(rf'\s*id\s*=\s*"{re.escape(step)}"', line):
                loc["physicalLocation"]["region"] = {"startLine": i}
                break
    return loc


def render_sarif(result: CIResult) -> dict:
    """SARIF 2.1.0: one run; rules are the recipe's steps; results are the no-match anchors at the newest commit."""
    from . import __version__

    recipe, tip = result.recipe, result.tip
    rules = [
        {
            "id": s.id,
            "name": "".join(part.capitalize() for part in re.split(r"[-_]", s.id)),
            "shortDescription": {"text": f"recipe {recipe.name} step {s.id} (codemod {s.codemod}) no longer matches upstream"},
            "fullDescription": {"text": " ".join(s.why.split()) or s.id},
            "defaultConfiguration": {"level": "error"},
            "properties": {"codemod": s.codemod, "anchors": {k: list(v) for k, v in s.anchors.items()}},
        }
        for s in recipe.steps
    ]
    if result.verify:
        rules.append({"id": "verify", "name": "Verify", "shortDescription": {"text": "ddpatch verify failed on the patched upstream tree"},
                      "fullDescription": {"text": "Speculative decoding of the patched tree must equal the target's greedy decoding."},
                      "defaultConfiguration": {"level": "error"}})
    index = {r["id"]: i for i, r in enumerate(rules)}
    results = []
    for sid, entry in tip.steps.items():
        if entry["status"] in GREEN:
            continue
        finding = result.change_in_effect(sid)
        since = (f" ({finding.after} since {finding.commit.short} \"{finding.commit.subject}\")"
                 if finding and finding.after == entry["status"] else "")
        bad = [a for a in entry.get("anchors", []) if a["status"] not in GREEN] or [
            {"function": None, "message": "nothing matched", "path": None, "line": None}]
        for a in bad:
            if a.get("path"):
                loc: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": a["path"]}}}
                if a.get("line"):
                    loc["physicalLocation"]["region"] = {"startLine": int(a["line"])}
            else:
                loc = _recipe_location(recipe, sid)
            results.append({
                "ruleId": sid,
                "ruleIndex": index[sid],
                "level": "error",
                "message": {"text": f"{sid}: {a['message']} at upstream {tip.short}{since}"},
                "locations": [loc],
                "partialFingerprints": {"ddpatchAnchor/v1": f"{sid}:{a.get('function') or '-'}"},
                "properties": {"commit": tip.sha, "function": a.get("function"), "upstream": tip.upstream},
            })
    if result.verify and tip.verify_failed:
        for c in (tip.verify or {}).get("checks", []):
            if not c["passed"]:
                results.append({"ruleId": "verify", "ruleIndex": index["verify"], "level": "error",
                                "message": {"text": f"verify {c['model']}: {c['check']}: {c['evidence']}"},
                                "locations": [_recipe_location(recipe, None)],
                                "properties": {"commit": tip.sha}})
    upstream = recipe.upstreams.get(result.forced_upstream or tip.upstream or "")
    repo_uri = upstream.repository if upstream and upstream.repository else result.repo.path.as_uri()
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "ddpatch", "version": __version__, "semanticVersion": __version__, "rules": rules}},
            "automationDetails": {"id": f"ddpatch-ci/{recipe.name}/{tip.upstream or 'upstream'}/"},
            "versionControlProvenance": [{"repositoryUri": repo_uri, "revisionId": tip.sha}],
            "invocations": [{"executionSuccessful": True, "exitCode": result.exit_code}],
            "results": results,
            "properties": {"recipe": recipe.label, "range": result.commits, "findings": [
                {k: v for k, v in f.as_dict().items() if k != "hunk"} for f in result.findings]},
        }],
    }


def render(result: CIResult, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(result.as_dict(), indent=2) + "\n"
    if fmt == "junit":
        return render_junit(result)
    if fmt == "sarif":
        return json.dumps(render_sarif(result), indent=2) + "\n"
    return render_text(result)


def workflow_template() -> str:
    from importlib import resources

    return resources.files("patcher").joinpath("templates").joinpath(WORKFLOW_TEMPLATE).read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- the command
def _failure(message: str):
    from .cli import Failure

    return Failure(message)


def _ints(value: str | None, flag: str) -> list[int] | None:
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise _failure(f"{flag}: expected comma-separated integers, got {value!r}") from None
    if not out or any(v < 0 or flag == "--tree-budgets" and v < 1 for v in out):
        raise _failure(f"{flag}: expected comma-separated integers >= {1 if flag == '--tree-budgets' else 0}, got {value!r}")
    return out


@click.command("ci", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--recipe", "recipe_name", default=None, help="A built-in recipe name or a path to a recipe .toml.")
@click.option("--repo", type=click.Path(path_type=Path), default=None, help="The upstream git repository (a clone or a bare repository); read only.")
@click.option("--rev", default="HEAD", show_default=True, help="The newest commit to check (any commit-ish).")
@click.option("--since", default=None, help="Also check every commit after this known-good one, up to --rev; it is the baseline.")
@click.option("--upstream", default=None, help="Treat every commit as this upstream layout instead of detecting it.")
@click.option("--all-commits", is_flag=True, help=f"Evaluate every commit of the range (default: bisect ranges of more than {BISECT_THRESHOLD}).")
@click.option("--verify", "do_verify", is_flag=True, help="Also run `ddpatch verify` on each evaluated commit's patched tree.")
@click.option("--preset", "presets", multiple=True, help="With --verify: built-in tiny model (repeatable; default tiny-qwen3_5).")
@click.option("--seeds", default=None, help="With --verify: comma-separated seeds.")
@click.option("--prompts", type=click.IntRange(min=1), default=None, help="With --verify: prompts per seed.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None, help="With --verify: new tokens per prompt.")
@click.option("--block-size", type=click.IntRange(min=2), default=None, help="With --verify: draft block size.")
@click.option("--tree-budgets", default=None, help="With --verify: DDTree node budgets, comma-separated.")
@click.option("--verify-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True, help="With --verify: seconds per commit before the verifier is stopped.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "junit", "sarif"]), default="text", show_default=True, help="Output format (stdout).")
@click.option("--junit-file", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Also write the JUnit XML report here.")
@click.option("--sarif-file", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Also write the SARIF 2.1.0 report here.")
@click.option("--json-file", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Also write the JSON report here.")
@click.option("--hunk-lines", type=int, default=HUNK_LINES, show_default=True, help="Lines of upstream diff shown per change (0: all).")
@click.option("--update-lock", is_flag=True, help="When the run is green, record --rev as last_verified for its upstream in the lock file.")
@click.option("--lock", "lock_path", type=click.Path(path_type=Path, dir_okay=False), default=None, help="The lock file for --update-lock (default: vendored/upstream.lock of this ddpatch).")
@click.option("--jobs", "-j", type=int, default=1, show_default=True, help="Worker processes per commit for the recipe engine.")
@click.option("--print-workflow", is_flag=True, help="Print a GitHub Actions workflow that runs this on a schedule, and exit.")
def ci(recipe_name, repo, rev, since, upstream, all_commits, do_verify, presets, seeds, prompts, max_new_tokens, block_size,
       tree_budgets, verify_timeout, fmt, junit_file, sarif_file, json_file, hunk_lines, update_lock, lock_path, jobs, print_workflow) -> None:
    """Re-verify a recipe against upstream commits: per commit and step, applied / already-applied /
    fixed-upstream / no-match, and the first commit at which each step's status changed.

    Each commit is read from the repository's object store into a temporary tree; the
    repository, its checkout and its index are never written. The exit status is judged on
    --rev: 0 every step matches (and verify passed); 1 a step is no-match or verify failed;
    2 bad input or a repository that cannot be read.

    \b
    ddpatch ci --recipe qwen3_6-gdn --repo ../dflash --rev main
    ddpatch ci --recipe qwen3_6-gdn --repo ../dflash --since 44947fb
    ddpatch ci --recipe qwen3_6-gdn --repo ../ddtree --since dafc3b9 --verify --preset tiny-qwen3_5
    ddpatch ci --recipe qwen3_6-gdn --repo ../ddtree --format junit > results.xml
    ddpatch ci --print-workflow > .github/workflows/ddpatch-upstream-ci.yml
    """
    if print_workflow:
        click.echo(workflow_template(), nl=False)
        return
    if not recipe_name:
        raise _failure("--recipe is required (a built-in recipe name or a .toml path)")
    if repo is None:
        raise _failure("--repo is required (the upstream git repository to check)")
    from .recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(recipe_name)
    except RecipeError as exc:
        raise _failure(str(exc)) from None
    lock = None
    if update_lock:
        lock = (lock_path or default_lock_path()).expanduser()
        if not lock.is_file():
            raise _failure(f"--lock {lock} does not exist")
    verify_options = None
    if do_verify:
        from .presets import PRESETS

        unknown = [p for p in presets if p not in PRESETS]
        if unknown:
            raise _failure(f"--preset: unknown preset(s) {', '.join(unknown)}; known: {', '.join(sorted(PRESETS))}")
        verify_options = {k: v for k, v in dict(
            presets=list(presets) or None, seeds=_ints(seeds, "--seeds"), prompts=prompts, max_new_tokens=max_new_tokens,
            block_size=block_size, tree_budgets=_ints(tree_budgets, "--tree-budgets")).items() if v is not None}
    progress = (lambda line: click.echo(f"ddpatch ci: {line}", err=True)) if sys.stderr.isatty() else None
    try:
        result = run_ci(recipe, repo, rev=rev, since=since, upstream=upstream, verify=verify_options, verify_timeout=verify_timeout,
                        jobs=max(1, jobs), bisect_threshold=None if all_commits else BISECT_THRESHOLD, hunk_lines=hunk_lines,
                        progress=progress)
        if lock is not None:
            apply_lock(result, lock)
    except CIError as exc:
        raise _failure(str(exc)) from None
    for path, kind in ((junit_file, "junit"), (sarif_file, "sarif"), (json_file, "json")):
        if path is not None:
            path.write_text(render(result, kind), encoding="utf-8")
    click.echo(render(result, fmt), nl=False)
    sys.exit(result.exit_code)
