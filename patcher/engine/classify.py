"""Stage 5 of the pipeline: per step and anchor, one status from the sites the steps reported.

An anchor function counts the sites in it and in the tree's own helpers it calls; with no
site, a step's ``evidence`` may show upstream fixed the problem in another form; else it is
``no-match``. ``mark_skipped`` and ``mark_pending`` relabel a report after the fact.
"""

from __future__ import annotations

import ast
import warnings

from ..results import (
    ALREADY_APPLIED,
    APPLIED,
    FIXED_UPSTREAM,
    NO_MATCH,
    PENDING,
    SKIPPED,
    AnchorResult,
    FileResult,
    Report,
    Site,
    StepResult,
)
from .codemods import CODEMODS
from .files import defined_functions
from .recipe import Recipe, StepSpec

_STATUS_ORDER = {NO_MATCH: 0, APPLIED: 1, ALREADY_APPLIED: 2, FIXED_UPSTREAM: 3}


def classify(recipe: Recipe, upstream: str | None, files: list[FileResult], texts: dict[str, str]) -> list[StepResult]:
    defined: dict[str, tuple[str, int]] = {}
    for f in files:
        for name, line in f.functions.items():
            defined.setdefault(name, (f.path, line))
    where: dict[str, list[str]] = {}
    for f in files:
        for name in f.functions:
            where.setdefault(name, []).append(f.path)
    calls = _CallGraph(where, texts)
    results = []
    for spec in recipe.steps:
        if not spec.applies_to(upstream):
            continue
        sites = sorted((s for f in files for s in f.sites if s.step == spec.id), key=lambda s: (s.path, s.line))
        anchors = []
        step_anchors = spec.anchors.get(upstream, ()) if upstream else ()
        if not spec.anchors and not sites:
            continue  # a step anchored nowhere (removed-cache-api) speaks only where it found a site
        for fn in step_anchors:
            if fn not in defined:
                anchors.append(AnchorResult(fn, NO_MATCH, f"function `{fn}` is not defined anywhere in the tree"))
                continue
            # the anchor and the tree's own helpers it calls (other anchors of the step answer for themselves)
            helpers = calls.reach(fn, stop=set(step_anchors))
            in_fn = [s for s in sites if s.function == fn or s.function in helpers]
            path, line = defined[fn]
            if in_fn:
                best = min(in_fn, key=lambda s: (_STATUS_ORDER[s.status], s.function != fn))
                via = f" (in `{best.function}`, which `{fn}` calls)" if best.function != fn else ""
                anchors.append(AnchorResult(fn, best.status, best.message + via, best.path, best.line))
                continue
            reason = None
            for name in [fn, *helpers]:
                reason = reason or _evidence(spec, name, texts.get(defined[name][0]))
            if reason:
                anchors.append(AnchorResult(fn, FIXED_UPSTREAM, reason, path, line))
            else:
                cls = CODEMODS[spec.codemod]
                near = next(filter(None, (cls.near_miss(texts.get(defined[n][0]) or "", n, {**cls.PARAMS, **spec.params})
                                          for n in [fn, *helpers])), None)
                anchors.append(AnchorResult(fn, NO_MATCH, f"`{fn}` has no site for this step" + (f": {near}" if near else ""), path, line))
        results.append(StepResult(spec, _aggregate(anchors, sites), anchors, sites))
    return results


class _CallGraph:
    """Which of the tree's own functions a function calls, by name, read with the stdlib ``ast`` on demand.

    A call counts when it is a plain name (``_decode(...)``), a method of the same object
    (``self._decode(...)``), or a function of a module the file imports (``utils._crop(...)``),
    and a function of that name is defined in the tree.
    """

    def __init__(self, where: dict[str, list[str]], texts: dict[str, str]) -> None:
        self.where = where
        self.texts = texts
        self._files: dict[str, dict[str, set[str]]] = {}
        self._calls: dict[str, set[str]] = {}

    def _index(self, path: str) -> dict[str, set[str]]:
        """Per function name defined in ``path`` (methods and nested functions too), the names it calls.

        Each file is parsed and walked once, on the first call that needs it: a name such as
        ``update`` or ``__init__`` is defined in hundreds of files of a large tree.
        """
        if path in self._files:
            return self._files[path]
        index: dict[str, set[str]] = {}
        self._files[path] = index
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(self.texts.get(path) or "")
        except (SyntaxError, ValueError, RecursionError):
            return index
        functions, modules = [], set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append(node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules.update(a.asname or a.name for a in node.names)
        for fn in functions:
            out = index.setdefault(fn.name, set())
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    func = node.func
                    if isinstance(func, ast.Name):
                        out.add(func.id)
                    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                        if func.value.id in ("self", "cls") or func.value.id in modules:
                            out.add(func.attr)
                elif node is not fn and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(node.name)  # nested functions belong to it
        return index

    def calls(self, name: str) -> set[str]:
        if name in self._calls:
            return self._calls[name]
        out: set[str] = set()
        for path in self.where.get(name, ()):
            out |= self._index(path).get(name, set())
        self._calls[name] = {c for c in out if c in self.where and c != name}
        return self._calls[name]

    def reach(self, name: str, stop: set[str]) -> list[str]:
        """Functions of the tree reached from ``name`` through calls, not passing through ``stop``."""
        seen, order, queue = {name}, [], [name]
        while queue:
            for called in sorted(self.calls(queue.pop(0))):
                if called not in seen and called not in stop:
                    seen.add(called)
                    order.append(called)
                    queue.append(called)
        return order


def _aggregate(anchors: list[AnchorResult], sites: list[Site]) -> str:
    statuses = [a.status for a in anchors] + [s.status for s in sites]
    if not statuses or NO_MATCH in statuses:
        return NO_MATCH
    for status in (APPLIED, ALREADY_APPLIED, FIXED_UPSTREAM):
        if status in statuses:
            return status
    return NO_MATCH


def _evidence(spec: StepSpec, fn: str, text: str | None) -> str | None:
    if text is None:
        return None
    import libcst as cst
    from libcst.codemod import CodemodContext

    try:
        module = cst.parse_module(text)
    except Exception:
        return None
    step = CODEMODS[spec.codemod](CodemodContext(), **spec.params)
    for node in _functions_named(module, fn):
        reason = step.evidence(node)
        if reason:
            return reason
    return None


def _functions_named(module, name: str):
    import libcst as cst

    found = []

    class _Find(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            if node.name.value == name:
                found.append(node)

    module.visit(_Find())
    return found


# ----------------------------------------------------------------------------- relabelling
def mark_skipped(report: Report) -> None:
    """Put the cause first: a site or anchor in a skipped file is ``skipped``, with the file's reason.

    Without this, a file that cannot be read or parsed would show up as a ``no-match`` of
    every step anchored in it, and a read-only file's sites as ``applied``. A step with a
    skipped site or anchor is ``skipped``, unless it is also ``no-match`` elsewhere.
    """
    bad = {f.path: f.error for f in report.files if f.error}
    if not bad:
        return
    base = report.root if report.root.is_dir() else report.root.parent
    defined_in: dict[str, str] = {}  # function -> skipped file that defines it (read leniently)
    for rel in bad:
        path = base / rel
        if path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        for name in defined_functions(text):
            defined_in.setdefault(name, rel)
    for step in report.steps:
        for site in step.sites:
            if site.path in bad and site.status in (APPLIED, PENDING):
                site.status, site.message = SKIPPED, f"{site.path} skipped: {bad[site.path]}"
        for a in step.anchors:
            path = a.path if a.path in bad else defined_in.get(a.function) if a.path is None else None
            if path is not None and a.status in (NO_MATCH, APPLIED, PENDING):
                # a read-only file was read and checked; it is only not written
                verb = "checked, not written" if bad[path].startswith("read-only") else "not checked"
                a.status, a.message, a.path = SKIPPED, f"{verb}: {path} skipped: {bad[path]}", path
        statuses = {a.status for a in step.anchors} | {s.status for s in step.sites}
        if SKIPPED in statuses and NO_MATCH not in statuses:
            step.status = SKIPPED


def mark_pending(report: Report) -> None:
    """Relabel ``applied`` as ``pending``: for a report whose changes were not written."""
    for step in report.steps:
        if step.status == APPLIED:
            step.status = PENDING
        for a in step.anchors:
            if a.status == APPLIED:
                a.status = PENDING
        for site in step.sites:
            if site.status == APPLIED:
                site.status = PENDING
