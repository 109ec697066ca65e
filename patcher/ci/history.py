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

With ``--verify`` over more than one commit, every commit's verify is forked from one warm
verifier (``patcher/verify/child/warm.py``): torch and transformers are imported once per run,
not once per commit, and each tree is still judged in a process of its own.

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

The engine (and with it libcst) is imported only when a commit is evaluated, so that
``ddpatch --help`` stays fast.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from ..errors import EngineError
from ..results import LAYOUT, NO_MATCH, CIResult, CommitEval, Finding
from ..verify.process.runner import VerifyError, run_verify, warm_verifier
from . import BISECT_THRESHOLD, HUNK_LINES
from .git import CIError, Repo
from .hunks import hunk

__all__ = ["BISECT_THRESHOLD", "HUNK_LINES", "CIError", "Evaluator", "run_ci"]


def _include_filter(recipe) -> Callable[[str], bool]:
    from ..engine.pipeline import covers  # the engine (and libcst) only when a commit is evaluated

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
        from ..engine.pipeline import run_recipe
        from ..engine.write import write_report

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
                ev.error = str(exc).replace(str(tree), f"{self.repo.path}@{sha[:7]}")
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
                ev.verify = self._verify(report, tree, write_report, sha)
        ev.seconds = time.perf_counter() - start
        return ev

    def _verify(self, report, tree: Path, write_report, sha: str = "") -> dict:
        blocked = [s.spec.id for s in report.no_match]
        if blocked:
            return {"passed": None, "skipped": f"not run: step(s) {', '.join(blocked)} no-match", "checks": []}
        write_report(report, tree)
        try:
            outcome = run_verify(tree, timeout=self.verify_timeout, **self.verify)
        except VerifyError as exc:
            where = f"{self.repo.path}@{sha[:7]}"  # the commit's tree, named as the user knows it
            return {"passed": False, "error": str(exc).replace(str(tree), where), "checks": [
                {"model": "-", "check": "verify runs", "passed": False, "evidence": str(exc).replace(str(tree), where)}]}
        res = outcome.result
        checks = [{"model": "-", "check": c["check"], "passed": bool(c["passed"]), "evidence": c.get("evidence", "")} for c in res.get("checks", [])]
        for m in res.get("models", []):
            checks += [{"model": m.get("model", "-"), "check": c["check"], "passed": bool(c["passed"]), "evidence": c.get("evidence", "")}
                       for c in m.get("checks", [])]
        return {"passed": outcome.passed, "seconds": round(outcome.seconds, 2), "checks": checks}


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
    steps = [LAYOUT, *(s.id for s in recipe.steps)]
    with warm_verifier() if verify is not None and len(commits) > 1 else nullcontext():  # torch is imported once, not per commit
        changes = _evaluate_range(repo, commits, tip, steps, bisected, evaluate)
    index = {sha: i for i, sha in enumerate(commits)}
    findings: list[Finding] = []
    for step in steps:
        pairs = sorted(set(changes[step]), key=lambda pair: index.get(pair[1], -1))
        for k, (a, b) in enumerate(pairs):
            prev, first = evaluate(a), evaluate(b)
            findings.append(Finding(step, prev.status(step), first.status(step), prev, first, first=k == 0))
    for f in findings:
        f.hunk, f.hunk_files = hunk(repo, f, hunk_lines)
    order = {sid: i for i, sid in enumerate(steps)}
    findings.sort(key=lambda f: (index.get(f.commit.sha, -1), order[f.step]))
    return CIResult(recipe, repo, rev, since, upstream, commits, infos, dict(evaluate.cache), findings, bisected,
                    verify is not None, seconds=time.perf_counter() - start)


def _evaluate_range(repo: Repo, commits: list[str], tip: str, steps: list[str], bisected: bool, evaluate):
    """The commits where a step's status changes, per step: every commit evaluated, or a bisection."""
    if not bisected:
        for sha in commits:
            evaluate(sha)
        return _changes_by_parents(repo, commits, steps, evaluate)
    chain = [commits[0], *repo.first_parent_chain(tip, commits[0])]
    evaluate(chain[0])
    evaluate(chain[-1])
    while True:  # a commit evaluated for one step can reveal a change of another: repeat until nothing new is evaluated
        seen = len(evaluate.cache)
        changes = {step: _chain_changes(repo, chain, step, evaluate) for step in steps}
        if len(evaluate.cache) == seen:
            return changes


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
