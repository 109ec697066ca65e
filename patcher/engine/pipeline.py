"""The recipe engine, read as its pipeline:

    discover files -> cheap prefilter (text, then stdlib ast) -> parse once -> run the recipe's steps -> classify -> render or write

Each stage is a plain function. ``run_recipe`` strings them together and returns a
``Report`` (``patcher.results``): per step and per anchor a status (applied /
already-applied / fixed-upstream / no-match) with the sites that justify it, per file the
new text. Nothing is written here; ``write.write_report`` does that, atomically.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import hashlib
import json
import os
import re
import warnings
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterable

from ..errors import EngineError
from ..results import ALREADY_APPLIED, APPLIED, FIXED_UPSTREAM, UNCLASSIFIED, FileResult, Report, Site
from .classify import classify, mark_skipped
from .codemods import CODEMODS
from .codemods.base import IN_PACKAGE, PATCHED, Step, place, site_positions
from .files import add_runtime_files, decode_source, defined_functions, read_provenance, write_provenance
from .recipe import Recipe, StepSpec
from .survey import leave_out_engines, reached_by_decoders, refuse, suggest_excludes
from .survey import survey as survey_tree

SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", ".mypy_cache", ".pytest_cache", "node_modules"}


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


def exclude_globs(pattern: str) -> list[str]:
    """What ``--exclude PATTERN`` leaves out, as ruff reads it: a pattern without ``/`` is a file or folder name anywhere
    (``analysis``, ``profile_*.py``); one with ``/`` is relative to the tree's root (``scripts/old/``, ``tools/*.py``);
    a folder takes everything under it."""
    pattern = pattern.strip().removeprefix("./").rstrip("/")
    if not pattern:
        return []
    if "/" not in pattern:
        return [f"**/{pattern}", f"**/{pattern}/**"]
    return [pattern, f"{pattern}/**"]


def discover(root: Path, recipe: Recipe, exclude: Iterable[str] = (), excluded: dict[str, str] | None = None
             ) -> tuple[list[Path], list[FileResult]]:
    """Python files under ``root`` that the recipe covers, and the entries skipped on the way.

    Symlinks are never followed: one to a file in the tree is left to that file, one out of
    the tree is reported. Build and VCS folders are skipped. ``exclude`` (``--exclude`` patterns)
    leaves files out too; each is recorded in ``excluded`` with the pattern that left it out.
    """
    globs = {p: exclude_globs(p) for p in exclude}
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
            by = next((p for p, g in globs.items() if _matches(rel, g)), None)
            if by is not None:
                if excluded is not None:
                    excluded[rel] = f"--exclude {by}"
                continue
            if path.is_symlink():
                if not path.resolve().is_relative_to(root):
                    skipped.append(FileResult(rel, None, error="symlink points outside the tree; not followed"))
                continue  # writing through a link would replace it with a file
            kind = _not_regular(path)
            if kind:  # reading a FIFO would wait forever for a writer
                skipped.append(FileResult(rel, None, error=f"not a regular file ({kind}); not read"))
                continue
            found.append(path)
    return found, skipped


def _not_regular(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file (a FIFO, a socket, a device), else None."""
    import stat

    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None  # gone, or unreadable: reading it reports why
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return None
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")


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


# ----------------------------------------------------------------------------- stage 3+4: parse and transform
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


#: Results of ``transform_source`` by (text, steps with their parameters, in_package), newest last.
_MEMO: "OrderedDict[tuple, tuple[str | None, tuple[Site, ...], bool]]" = OrderedDict()
_MEMO_SIZE = 256


def _memo_key(text: str, steps: list[tuple[StepSpec, type]], in_package: bool) -> tuple:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20).digest()
    return (digest, len(text), in_package,
            tuple((spec.id, cls, json.dumps(spec.params, sort_keys=True, default=repr)) for spec, cls in steps))


def transform_source(text: str, steps: list[tuple[StepSpec, type]], in_package: bool) -> tuple[str, list[Site], bool]:
    """Parse ``text`` once and run ``steps`` in one pass; returns new text, sites, and whether the runtime is used.

    A step's edit is a function of the text, its parameters and ``in_package`` alone, so a
    result is kept for the rest of the process (``_MEMO``): ``ddpatch ci`` meets the same
    file in commit after commit, and a check followed by an apply in one process (the API,
    the tests) parses each file once. Callers get their own copies of the sites.
    """
    key = _memo_key(text, steps, in_package)
    hit = _MEMO.get(key)
    if hit is None:
        new, sites, needs_runtime = _transform(text, steps, in_package)
        # an unchanged file (most of them) is kept as None, not as a second copy of its text
        _MEMO[key] = (None if new == text else new, tuple(dataclasses.replace(s) for s in sites), needs_runtime)
        if len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
        return new, sites, needs_runtime
    _MEMO.move_to_end(key)
    new, sites, needs_runtime = hit
    return text if new is None else new, [dataclasses.replace(s) for s in sites], needs_runtime


def _transform(text: str, steps: list[tuple[StepSpec, type]], in_package: bool) -> tuple[str, list[Site], bool]:
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
        if step.USES_RUNTIME and any(s.status in (APPLIED, PATCHED) for s in step.sites):  # a step may say per file
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
    result.notes = [site for site in sites if site.status == UNCLASSIFIED]  # said in the report, never a status
    sites = [site for site in sites if site.status != UNCLASSIFIED]
    for site in result.notes:
        site.path = rel
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


# ----------------------------------------------------------------------------- the pipeline
def run_recipe(recipe: Recipe, root: Path, upstream: str | None = None, jobs: int = 1, progress=None,
               exclude: Iterable[str] = (), survey: str | None = None) -> Report:
    """The whole pipeline; ``progress(done, total)`` is called as files are processed.

    ``exclude``: ``--exclude`` patterns. ``survey``: say what the tree is before any step runs
    (``survey.py``): ``"require"`` stops a tree with none of the recipe's decoders (one line, exit 2),
    ``"report"`` only reports; None (``ci``, the corpus) runs the steps on anything.
    """
    root = Path(root)
    if not root.exists():
        raise EngineError(f"path does not exist: {root}")
    root = root.resolve()
    base = root if root.is_dir() else root.parent
    if not root.is_dir() and _not_regular(root):
        raise EngineError(f"not a regular file or folder ({_not_regular(root)}): {root}; pass the checkout's root folder")
    if root.is_file() and not covers(recipe, root.name):
        raise EngineError(f"not a Python file: {root}; pass the checkout's root folder (or a .py file)")
    if root.is_dir() and not any(root.iterdir()):
        raise EngineError(f"empty directory: {root}")
    excluded: dict[str, str] = {}
    exclude = tuple(exclude)
    paths, skipped = discover(root, recipe, exclude, excluded)
    if not paths and not skipped and excluded:
        raise EngineError(f"every Python file under {root} is left out by --exclude {' '.join(exclude)}")
    if not paths and not skipped:
        raise EngineError(f"no Python files matching {', '.join(recipe.include)} under {root}")
    if upstream is not None and upstream not in recipe.upstreams:
        raise EngineError(f"unknown upstream {upstream!r} for recipe {recipe.name}; known: {', '.join(recipe.upstreams)}")
    defined = set()
    scans = [re.compile(cls.TREE_TRIGGER) for cls in CODEMODS.values() if cls.TREE_TRIGGER]
    scanned: dict[str, str] = {}  # texts some step's tree scan wants
    texts: dict[str, str] = {}  # every text, for the survey
    where: dict[str, str] = {}  # function -> a file defining it
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        rel = path.relative_to(base).as_posix() if path != base else path.name
        functions = defined_functions(text)
        defined.update(functions)
        if survey:
            texts[rel] = text
            for name in functions:
                where.setdefault(name, rel)
        if any(p.search(text) for p in scans):
            scanned[rel] = text
    forced = upstream is not None
    if upstream is None:
        upstream = recipe.detect_upstream(defined)
    found = survey_tree(texts, recipe, upstream, where) if survey and recipe.upstreams else None
    if found is not None and not found.decoders:
        if survey == "require" and not forced:
            refuse(found, recipe, root)
    elif found is not None and found.engine_folders:  # a decoder beside an engine's package: the engine is not patched
        paths = leave_out_engines(found, paths, base, excluded, scanned)
    specs = [(tree_scan(spec, CODEMODS[spec.codemod], scanned), CODEMODS[spec.codemod]) for spec in recipe.steps if spec.applies_to(upstream)]
    files = _map_files(base, paths, specs, recipe, jobs, progress)
    files += add_runtime_files(base, files)
    texts = {f.path: f.original for f in files if f.original is not None}
    steps = classify(recipe, upstream, files, texts)
    missing = sorted(a for a in (recipe.upstreams[upstream].anchors if upstream else ()) if a not in defined)
    report = Report(recipe, root, upstream, files + skipped, steps, missing, decoders=found.decoders if found else {},
                    exclude=exclude, excluded=excluded)
    mark_skipped(report)
    if found is not None:
        suggest_excludes(report, reached_by_decoders(report))
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
