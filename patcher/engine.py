"""The recipe engine, read as its pipeline:

    discover files -> cheap prefilter (text, then stdlib ast) -> parse once -> run the recipe's steps -> classify -> render or write

Each stage is a plain function. ``run_recipe`` strings them together and returns a
``Report``: per step and per anchor a status (applied / already-applied /
fixed-upstream / no-match) with the sites that justify it, per file the new text.
Nothing is written here; ``write_report`` does that, atomically.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import os
import re
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable

from . import __version__
from .codemods import CODEMODS
from .codemods.base import (
    ALREADY_APPLIED,
    APPLIED,
    FIXED_UPSTREAM,
    IN_PACKAGE,
    NO_MATCH,
    PATCHED,
    RUNTIME_MODULE,
    Site,
    Step,
    place,
    site_positions,
)
from .recipe import Recipe, StepSpec

RUNTIME_FILE = RUNTIME_MODULE + ".py"
SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", ".mypy_cache", ".pytest_cache", "node_modules"}
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+([A-Za-z_]\w*)", re.M)
_PROVENANCE = re.compile(r"^# ddpatch: recipe (?P<recipe>\S+) v(?P<version>\d+), ddpatch (?P<ddpatch>\S+); steps: (?P<steps>.*)$")
_STATUS_ORDER = {NO_MATCH: 0, APPLIED: 1, ALREADY_APPLIED: 2, FIXED_UPSTREAM: 3}
#: Statuses the CLI gives after the engine has run: ``pending`` is an ``applied`` site that was not
#: written (check, diff, a blocked apply); ``skipped`` is a site or anchor in a file that was skipped.
PENDING, SKIPPED = "pending", "skipped"


class EngineError(Exception):
    """Bad input that stops the run (a missing path, an unknown upstream)."""


# ----------------------------------------------------------------------------- results
@dataclass
class FileResult:
    path: str
    original: str | None  # None for a file ddpatch creates
    patched: str | None = None  # None when unchanged
    sites: list[Site] = field(default_factory=list)
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
    spec: StepSpec
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
class Report:
    recipe: Recipe
    root: Path
    upstream: str | None
    files: list[FileResult]
    steps: list[StepResult]
    missing_anchors: list[str]

    @property
    def changed(self) -> list[FileResult]:
        return [f for f in self.files if f.changed]

    @property
    def skipped(self) -> list[FileResult]:
        return [f for f in self.files if f.error]

    @property
    def no_match(self) -> list[StepResult]:
        return [s for s in self.steps if s.status == NO_MATCH]

    def as_dict(self) -> dict:
        return {
            "recipe": self.recipe.name,
            "recipe_version": self.recipe.version,
            "ddpatch": __version__,
            "root": str(self.root),
            "upstream": self.upstream,
            "layout_detected": self.upstream is not None,
            "missing_anchors": self.missing_anchors,
            "steps": [s.as_dict() for s in self.steps],
            "files": [
                {"path": f.path, "changed": f.changed, "created": f.original is None, "error": f.error}
                for f in self.files
                if f.changed or f.error
            ],
        }


# ----------------------------------------------------------------------------- stage 1: discover
def _matches(rel: str, patterns: Iterable[str]) -> bool:
    """Glob match where ``**/`` also matches zero folders (``**/*.py`` covers ``a.py``)."""
    for pat in patterns:
        if fnmatch.fnmatch(rel, pat):
            return True
        while pat.startswith("**/"):
            pat = pat[3:]
            if fnmatch.fnmatch(rel, pat):
                return True
    return False


def covers(recipe: Recipe, rel: str) -> bool:
    """Whether the recipe's include/exclude globs take the tree-relative path ``rel``."""
    return _matches(rel, recipe.include) and not _matches(rel, recipe.exclude)


def discover(root: Path, recipe: Recipe) -> tuple[list[Path], list[FileResult]]:
    """Python files under ``root`` that the recipe covers, and the entries skipped on the way.

    Symlinks are never followed: one to a file in the tree is left to that file, one out of
    the tree is reported. Build and VCS folders are skipped.
    """
    root = root.resolve()
    if root.is_file():
        return [root], []
    found: list[Path] = []
    skipped: list[FileResult] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(filenames):
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if not covers(recipe, rel):
                continue
            if path.is_symlink():
                if not path.resolve().is_relative_to(root):
                    skipped.append(FileResult(rel, None, error="symlink points outside the tree; not followed"))
                continue  # writing through a link would replace it with a file
            found.append(path)
    return found, skipped


# ----------------------------------------------------------------------------- stage 2: prefilter
_PATTERNS: dict[str, re.Pattern] = {}


def prefilter(text: str, steps: Iterable[tuple[StepSpec, type]]) -> list[tuple[StepSpec, type]]:
    """The steps whose trigger patterns all match ``text``; a file no step wants is never parsed."""
    out = []
    for spec, cls in steps:
        patterns = [_PATTERNS.setdefault(t, re.compile(t)) for t in cls.triggers({**cls.PARAMS, **spec.params})]
        if all(p.search(text) for p in patterns):
            out.append((spec, cls))
    return out


def prefilter_tree(text: str, steps: list[tuple[StepSpec, type]]) -> list[tuple[StepSpec, type]]:
    """Of ``steps``, those whose ``may_match`` holds on the file's stdlib ``ast``.

    The text is parsed by ``ast`` only if one of the steps checks a tree; a file ``ast``
    cannot parse keeps its steps, so that LibCST reports the error.
    """
    if not any(cls.may_match.__func__ is not Step.may_match.__func__ for _, cls in steps):
        return steps
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings of upstream code are not ours to print
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return steps
    return [(spec, cls) for spec, cls in steps if cls.may_match(tree, {**cls.PARAMS, **spec.params})]


def defined_functions(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    line, at = 1, 0
    for m in _DEF.finditer(text):
        if m.group(1) not in out:
            line += text.count("\n", at, m.start())  # counted on from the previous def, not from the top
            at = m.start()
            out[m.group(1)] = line
    return out


# ----------------------------------------------------------------------------- stage 3+4: parse and transform
def read_source(path: Path) -> str:
    return decode_source(path.read_bytes())[0]


def decode_source(data: bytes) -> tuple[str, str]:
    """The text of a Python file and its encoding, as Python reads it (PEP 263).

    The encoding is that of the ``coding:`` cookie, or ``utf-8-sig`` when the file starts
    with a BOM (the BOM is not part of the text, and is written back), else UTF-8.
    """
    import io
    import tokenize

    if b"\x00" in data[:8192]:
        raise ValueError("binary file")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        if "invalid or missing encoding" not in str(exc):  # an unknown codec, or a cookie that contradicts the BOM
            raise ValueError(f"bad coding declaration ({exc})") from None
        encoding = "utf-8"  # no cookie, and the first lines are not UTF-8: said below
    try:
        return data.decode(encoding), encoding
    except UnicodeDecodeError as exc:
        name = "UTF-8" if encoding in ("utf-8", "utf-8-sig") else f"{encoding} as declared"
        raise ValueError(f"not {name} ({exc.reason} at byte {exc.start})") from None


def _composite(steps):
    """All of a file's steps in one traversal of one parse.

    Every step sees the original tree (so metadata is computed once, and site positions
    are those of the file on disk); the leave-edits of the steps are chained on each
    node in recipe order, so an edit inside a function survives a step that rewrites
    the function around it. Steps' ``visit_<Node>``/``leave_<Node>`` methods are looked
    up once per node type: LibCST's generic matcher dispatch costs more than the edits.
    """
    import libcst as cst

    visits: dict[str, list] = {}
    leaves: dict[str, list] = {}

    def table(cache: dict[str, list], prefix: str, name: str) -> list:
        if name not in cache:
            cache[name] = [m for m in (getattr(step, prefix + name, None) for step in steps) if m is not None]
        return cache[name]

    class Composite(cst.CSTTransformer):
        def on_visit(self, node):
            methods = table(visits, "visit_", type(node).__name__)
            descend = not methods
            for method in methods:
                descend = method(node) is not False or descend
            return descend

        def on_visit_attribute(self, node, attribute) -> None:
            return None

        def on_leave_attribute(self, original_node, attribute) -> None:
            return None

        def on_leave(self, original_node, updated_node):
            result = updated_node
            for method in table(leaves, "leave_", type(original_node).__name__):
                if type(result) is not type(original_node):
                    break  # a step replaced the node by another kind; later steps cannot edit it
                result = method(original_node, result)
            return result

    return Composite()


def transform_source(text: str, steps: list[tuple[StepSpec, type]], in_package: bool) -> tuple[str, list[Site], bool]:
    """Parse ``text`` once and run ``steps`` in one pass; returns new text, sites, and whether the runtime is used."""
    import libcst as cst
    from libcst.codemod import CodemodContext
    from libcst.codemod.visitors import AddImportsVisitor
    from libcst.metadata import MetadataWrapper, PositionProvider

    module = cst.parse_module(text)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    context = CodemodContext(wrapper=wrapper)
    context.scratch[IN_PACKAGE] = in_package
    instances = [cls(context, **spec.params) for spec, cls in steps]
    # Positions are computed below, for the sites only; scope analysis only if a step here needs it.
    wanted = {p for step in instances for p in step.get_inherited_dependencies()} - {PositionProvider}
    metadata = wrapper.resolve_many(wanted)
    for step in instances:
        step.metadata = metadata
    new = wrapper.module.visit(_composite(instances))
    new = insert_imports(new, context.scratch.get(AddImportsVisitor.CONTEXT_KEY, []))
    sites: list[Site] = []
    needs_runtime = False
    for (spec, cls), step in zip(steps, instances):
        if cls.USES_RUNTIME and any(s.status in (APPLIED, PATCHED) for s in step.sites):
            needs_runtime = True
        for site in step.sites:
            site.step = spec.id
        sites.extend(step.sites)
    if sites:
        positions = site_positions(module, [s.node for s in sites])  # the original tree: sites point at the file on disk
        for site in sites:
            place(site, positions)
    return new.code, sites, needs_runtime


def insert_imports(module, items):
    """Add the imports steps asked for (LibCST ``ImportItem``s) after the module's import block.

    LibCST's AddImportsVisitor does the same with a second parse-and-metadata pass; this
    scans only the top-level statements.
    """
    import libcst as cst

    from .codemods.base import dotted

    if not items:
        return module
    have: set[tuple[str, str | None]] = set()
    after = 0  # insert after the docstring, __future__ imports and the import block
    for i, stmt in enumerate(module.body):
        if not isinstance(stmt, cst.SimpleStatementLine):
            break
        small = stmt.body[0]
        if isinstance(small, cst.Import):
            have.update((dotted(a.name) or "", None) for a in small.names)
        elif isinstance(small, cst.ImportFrom):
            mod = "." * len(small.relative) + (dotted(small.module) if small.module else "")
            names = [] if isinstance(small.names, cst.ImportStar) else [dotted(a.name) for a in small.names]
            have.update((mod, n) for n in names)
        elif not (i == 0 and isinstance(small, cst.Expr) and isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString))):
            break
        after = i + 1
    new_lines = []
    for item in items:
        key = (item.module, item.obj_name)
        if key in have:
            continue
        have.add(key)
        if item.obj_name is None:
            new_lines.append(cst.parse_statement(f"import {item.module_name}" + (f" as {item.alias}" if item.alias else "")))
        else:
            text = f"from {item.module} import {item.obj_name}" + (f" as {item.alias}" if item.alias else "")
            new_lines.append(cst.parse_statement(text))
    if not new_lines:
        return module
    body = list(module.body)
    if after < len(body) and not body[after].leading_lines:
        body[after] = body[after].with_changes(leading_lines=[cst.EmptyLine()])  # a blank line after the imports
    return module.with_changes(body=body[:after] + new_lines + body[after:])


def process_file(root: Path, path: Path, steps: list[tuple[StepSpec, type]], recipe: Recipe) -> FileResult:
    import libcst as cst

    rel = path.relative_to(root).as_posix() if path != root else path.name
    try:
        text, encoding = decode_source(path.read_bytes())
    except (OSError, ValueError) as exc:
        return FileResult(rel, None, error=f"cannot read: {exc}")
    result = FileResult(rel, text, functions=defined_functions(text), encoding=encoding)
    active = prefilter_tree(text, prefilter(text, steps))
    if not active:
        return result
    in_package = (path.parent / "__init__.py").exists()
    try:
        new, sites, result.needs_runtime = transform_source(text, active, in_package)
    except (cst.ParserSyntaxError, RecursionError) as exc:
        result.error = f"cannot parse: {_one_line(exc)}"
        return result
    except Exception as exc:  # a bug in a step: this file is skipped, the rest of the run goes on
        result.error = f"internal error (please report it): {_one_line(exc)}"
        return result
    recorded = read_provenance(text)
    for site in sites:
        site.path = rel
        if site.status == PATCHED:
            site.status = ALREADY_APPLIED if site.step in recorded else FIXED_UPSTREAM
            if site.status == FIXED_UPSTREAM:
                site.message += " (not written by ddpatch)"
    result.sites = sites
    applied = {s.step for s in sites if s.status == APPLIED}
    if applied:
        result.patched = write_provenance(new, recorded | applied, recipe)
        try:
            result.encoded()
        except UnicodeEncodeError as exc:
            result.patched, result.error = None, f"cannot write: the patched text is not {encoding} ({exc.reason})"
    return result


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# ----------------------------------------------------------------------------- provenance
def read_provenance(text: str) -> set[str]:
    for line in text.splitlines()[:3]:
        m = _PROVENANCE.match(line)
        if m:
            return {s.strip() for s in m.group("steps").split(",") if s.strip()}
    return set()


def provenance_line(recipe: Recipe, steps: Iterable[str]) -> str:
    return f"# ddpatch: recipe {recipe.name} v{recipe.version}, ddpatch {__version__}; steps: {', '.join(sorted(steps))}"


def newline_of(text: str) -> str:
    """The file's own line ending (that of its first line), so that lines ddpatch adds match it."""
    end = text.find("\n")
    if end > 0 and text[end - 1] == "\r":
        return "\r\n"
    if end < 0 and "\r" in text:
        return "\r"
    return "\n"


def write_provenance(text: str, steps: set[str], recipe: Recipe) -> str:
    line = provenance_line(recipe, steps) + newline_of(text)
    lines = text.splitlines(keepends=True)
    for i, old in enumerate(lines[:3]):
        if _PROVENANCE.match(old.rstrip("\r\n")):
            lines[i] = line
            return "".join(lines)
    at = 0
    while at < len(lines) and at < 2 and (lines[at].startswith("#!") or re.match(r"^#.*coding[:=]", lines[at])):
        at += 1
    lines.insert(at, line)
    return "".join(lines)


# ----------------------------------------------------------------------------- stage 5: classify
def _runtime_source() -> str:
    body = Path(__file__).with_name("runtime.py").read_text(encoding="utf-8")
    head = (
        f"# ddpatch: runtime helper copied by ddpatch {__version__}; do not edit, re-run `ddpatch apply` to update.\n"
        "# Source: patcher/runtime.py in ddpatch (MIT).\n"
    )
    return head + body


def add_runtime_files(root: Path, files: list[FileResult]) -> list[FileResult]:
    """One runtime module next to every patched file that calls it."""
    wanted = sorted({PurePosixPath(f.path).parent for f in files if f.needs_runtime})
    if not wanted:
        return []
    source = _runtime_source()
    out = []
    for folder in wanted:
        rel = (folder / RUNTIME_FILE).as_posix()
        path = root / rel
        old = path.read_text(encoding="utf-8") if path.exists() else None
        out.append(FileResult(rel, old, patched=source if old != source else None))
    return out


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
                anchors.append(AnchorResult(fn, NO_MATCH, f"`{fn}` has no site for this step", path, line))
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
        self._trees: dict[str, ast.Module | None] = {}
        self._calls: dict[str, set[str]] = {}

    def _tree(self, path: str):
        if path not in self._trees:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._trees[path] = ast.parse(self.texts.get(path) or "")
            except (SyntaxError, ValueError, RecursionError):
                self._trees[path] = None
        return self._trees[path]

    def calls(self, name: str) -> set[str]:
        if name in self._calls:
            return self._calls[name]
        out: set[str] = set()
        for path in self.where.get(name, ()):
            tree = self._tree(path)
            if tree is None:
                continue
            modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            modules |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    for call in ast.walk(node):
                        if not isinstance(call, ast.Call):
                            continue
                        func = call.func
                        if isinstance(func, ast.Name):
                            out.add(func.id)
                        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                            if func.value.id in ("self", "cls") or func.value.id in modules:
                                out.add(func.attr)
                    for inner in ast.walk(node):  # nested functions belong to it
                        if inner is not node and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            out.add(inner.name)
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


# ----------------------------------------------------------------------------- the pipeline
def run_recipe(recipe: Recipe, root: Path, upstream: str | None = None, jobs: int = 1, progress=None) -> Report:
    """The whole pipeline; ``progress(done, total)`` is called as files are processed."""
    root = Path(root)
    if not root.exists():
        raise EngineError(f"path does not exist: {root}")
    root = root.resolve()
    base = root if root.is_dir() else root.parent
    if root.is_dir() and not any(root.iterdir()):
        raise EngineError(f"empty directory: {root}")
    paths, skipped = discover(root, recipe)
    if not paths and not skipped:
        raise EngineError(f"no Python files matching {', '.join(recipe.include)} under {root}")
    if upstream is not None and upstream not in recipe.upstreams:
        raise EngineError(f"unknown upstream {upstream!r} for recipe {recipe.name}; known: {', '.join(recipe.upstreams)}")
    defined = set()
    scans = [re.compile(cls.TREE_TRIGGER) for cls in CODEMODS.values() if cls.TREE_TRIGGER]
    scanned: dict[str, str] = {}  # texts some step's tree scan wants
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        defined.update(defined_functions(text))
        if any(p.search(text) for p in scans):
            scanned[path.relative_to(base).as_posix() if path != base else path.name] = text
    if upstream is None:
        upstream = recipe.detect_upstream(defined)
    specs = [(tree_scan(spec, CODEMODS[spec.codemod], scanned), CODEMODS[spec.codemod]) for spec in recipe.steps if spec.applies_to(upstream)]
    files = _map_files(base, paths, specs, recipe, jobs, progress)
    files += add_runtime_files(base, files)
    texts = {f.path: f.original for f in files if f.original is not None}
    steps = classify(recipe, upstream, files, texts)
    missing = sorted(a for a in (recipe.upstreams[upstream].anchors if upstream else ()) if a not in defined)
    report = Report(recipe, root, upstream, files + skipped, steps, missing)
    mark_skipped(report)
    return report


def tree_scan(spec: StepSpec, cls: type, scanned: dict[str, str]) -> StepSpec:
    """``spec`` with the parameters its step derives from the whole tree (``Step.scan_tree``)."""
    if not cls.TREE_TRIGGER:
        return spec
    pattern = re.compile(cls.TREE_TRIGGER)
    extra = cls.scan_tree({p: t for p, t in scanned.items() if pattern.search(t)}, {**cls.PARAMS, **spec.params})
    return dataclasses.replace(spec, params={**spec.params, **extra}) if extra else spec


def _map_files(root: Path, paths: list[Path], specs, recipe: Recipe, jobs: int, progress=None) -> list[FileResult]:
    n = len(paths)
    done: list[FileResult] = []

    def collect(results: Iterable[FileResult]) -> list[FileResult]:
        for result in results:
            done.append(result)
            if progress is not None:
                progress(len(done), n)
        return done

    if jobs <= 1 or n < 8:
        return collect(process_file(root, p, specs, recipe) for p in paths)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return collect(pool.map(process_file, [root] * n, paths, [specs] * n, [recipe] * n, chunksize=8))


# ----------------------------------------------------------------------------- writing
def new_file_mode() -> int:
    """The mode ``open()`` gives a new file under the current umask (``mkstemp`` would give 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: Path, data: str | bytes, mode: int | None = None) -> None:
    """Write via a temp file in the same folder and ``os.replace``: the file is whole-old or whole-new.

    ``data`` is bytes, or text written as UTF-8 with its newlines as they are. The file keeps
    its mode; a new file gets ``mode``, or the mode the umask gives a new file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    if path.exists():
        mode = path.stat().st_mode & 0o7777
    elif mode is None:
        mode = new_file_mode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".ddpatch-tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def unwritable(path: Path) -> str | None:
    """Why ``path`` must not be patched in place, if it must not."""
    if path.exists() and (not path.stat().st_mode & 0o222 or not os.access(path, os.W_OK)):  # root passes os.access
        return "read-only file; not patched (make it writable to patch it)"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return "read-only folder; not patched"
    return None


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
        if PurePosixPath(f.path).name == RUNTIME_FILE and PurePosixPath(f.path).parent not in wanted:
            f.patched = None
    mark_skipped(report)


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
                a.status, a.message, a.path = SKIPPED, f"not checked: {path} skipped: {bad[path]}", path
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


def write_report(report: Report, dest_root: Path) -> list[str]:
    base = report.root if report.root.is_dir() else report.root.parent
    delay = float(os.environ.get("DDPATCH_TEST_WRITE_DELAY") or 0)  # lets a test kill a run between two files
    written = []
    for f in report.changed:
        atomic_write(Path(dest_root if dest_root else base) / f.path, f.encoded())
        written.append(f.path)
        if delay:
            time.sleep(delay)
    return written
