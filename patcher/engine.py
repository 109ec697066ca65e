"""The recipe engine, read as its pipeline:

    discover files -> cheap prefilter (text, then stdlib ast) -> parse once -> run the recipe's steps -> classify -> render or write

Each stage is a plain function. ``run_recipe`` strings them together and returns a
``Report``: per step and per anchor a status (applied / already-applied /
fixed-upstream / no-match) with the sites that justify it, per file the new text.
Nothing is written here; ``write_report`` does that, atomically.
"""

from __future__ import annotations

import ast
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

    @property
    def changed(self) -> bool:
        return self.patched is not None and self.patched != self.original


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
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        raise ValueError("binary file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None


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
        text = read_source(path)
    except (OSError, ValueError) as exc:
        return FileResult(rel, None, error=f"cannot read: {exc}")
    result = FileResult(rel, text, functions=defined_functions(text))
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


def write_provenance(text: str, steps: set[str], recipe: Recipe) -> str:
    line = provenance_line(recipe, steps)
    lines = text.splitlines(keepends=True)
    for i, old in enumerate(lines[:3]):
        if _PROVENANCE.match(old.rstrip("\r\n")):
            lines[i] = line + "\n"
            return "".join(lines)
    at = 0
    while at < len(lines) and at < 2 and (lines[at].startswith("#!") or re.match(r"^#.*coding[:=]", lines[at])):
        at += 1
    lines.insert(at, line + "\n")
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
    results = []
    for spec in recipe.steps:
        if not spec.applies_to(upstream):
            continue
        sites = sorted((s for f in files for s in f.sites if s.step == spec.id), key=lambda s: (s.path, s.line))
        anchors = []
        for fn in spec.anchors.get(upstream, ()) if upstream else ():
            in_fn = [s for s in sites if s.function == fn]
            if fn not in defined:
                anchors.append(AnchorResult(fn, NO_MATCH, f"function `{fn}` is not defined anywhere in the tree"))
                continue
            path, line = defined[fn]
            if in_fn:
                best = min(in_fn, key=lambda s: _STATUS_ORDER[s.status])
                anchors.append(AnchorResult(fn, best.status, best.message, best.path, best.line))
                continue
            reason = _evidence(spec, fn, texts.get(path))
            if reason:
                anchors.append(AnchorResult(fn, FIXED_UPSTREAM, reason, path, line))
            else:
                anchors.append(AnchorResult(fn, NO_MATCH, f"`{fn}` has no site for this step", path, line))
        results.append(StepResult(spec, _aggregate(anchors, sites), anchors, sites))
    return results


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
    for path in paths:
        try:
            defined.update(defined_functions(path.read_text(encoding="utf-8", errors="replace")))
        except OSError:
            pass
    if upstream is None:
        upstream = recipe.detect_upstream(defined)
    specs = [(spec, CODEMODS[spec.codemod]) for spec in recipe.steps if spec.applies_to(upstream)]
    files = _map_files(base, paths, specs, recipe, jobs, progress)
    files += add_runtime_files(base, files)
    texts = {f.path: f.original for f in files if f.original is not None}
    steps = classify(recipe, upstream, files, texts)
    missing = sorted(a for a in (recipe.upstreams[upstream].anchors if upstream else ()) if a not in defined)
    return Report(recipe, root, upstream, files + skipped, steps, missing)


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
def atomic_write(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and ``os.replace``: the file is whole-old or whole-new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if path.exists() else None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".ddpatch-tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
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
    wanted = {PurePosixPath(f.path).parent for f in report.changed if f.needs_runtime}
    for f in report.changed:
        if PurePosixPath(f.path).name == RUNTIME_FILE and PurePosixPath(f.path).parent not in wanted:
            f.patched = None


def write_report(report: Report, dest_root: Path) -> list[str]:
    base = report.root if report.root.is_dir() else report.root.parent
    delay = float(os.environ.get("DDPATCH_TEST_WRITE_DELAY") or 0)  # lets a test kill a run between two files
    written = []
    for f in report.changed:
        atomic_write(Path(dest_root if dest_root else base) / f.path, f.patched or "")
        written.append(f.path)
        if delay:
            time.sleep(delay)
    return written
