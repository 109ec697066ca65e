"""The recipe engine, read as its pipeline:

    discover files -> cheap prefilter (text, then stdlib ast) -> parse once -> run the recipe's steps -> classify -> render or write

Discovery leaves out folders that look like copies of third-party packages (``vendored``);
each file is read once; the text prefilter (``prefilter``) runs in this process, and only the
files it lets through go on (to ``--jobs`` worker processes when there are enough of them).

Each stage is a plain function. ``run_recipe`` strings them together and returns a
``Report`` (``patcher.results``): per step and per anchor a status (applied /
already-applied / fixed-upstream / no-match) with the sites that justify it, per file the
new text. Nothing is written here; ``write.write_report`` does that, atomically.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import re
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterable

from ..errors import EngineError
from ..results import ALREADY_APPLIED, APPLIED, FIXED_UPSTREAM, UNCLASSIFIED, FileResult, Report, Site, VendoredFolder
from .absent import place_unplaced, settle_absent_anchors, settle_unanchored
from .classify import classify, mark_skipped
from .codemods import CODEMODS
from .codemods.base import IN_PACKAGE, PATCHED, place, site_positions
from .files import add_runtime_files, defined_functions, not_regular, read_file, read_provenance, write_provenance
from .insert import insert_imports
from .packages import package_modes
from .prefilter import prefilter, prefilter_tree  # noqa: F401  (stage 2; tests import them from here)
from .recipe import Recipe, StepSpec
from .survey import leave_out, leaves_out, reached_by_decoders, refuse, shown_decoders, suggest_excludes, unsearched
from .survey import survey as survey_tree
from .vendored import CACHE_COPY, DecoderSignals, copy_of_cache_code, settle, vendored_reason

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


def discover(root: Path, recipe: Recipe, include_vendored: bool = False, exclude: Iterable[str] = (),
             excluded: dict[str, str] | None = None) -> tuple[list[Path], list[FileResult], list[VendoredFolder]]:
    """Python files under ``root`` that the recipe covers, the entries skipped on the way, and the folders
    that look vendored (``patcher.engine.vendored``).

    Symlinks are never followed: one to a file in the tree is left to that file, one out of
    the tree is reported. Build and VCS folders are skipped. Unless ``include_vendored``, the
    files of a folder that looks like a copy of a third-party package are left out, unless one
    of them shows a decoder signal of the recipe (the folder is then listed as checked).
    ``exclude`` (``--exclude`` patterns) leaves files out too; each is recorded in ``excluded``
    with the pattern that left it out.
    """
    globs = {p: exclude_globs(p) for p in exclude}
    root = root.resolve()
    if root.is_file():
        return [root], [], []
    walked: list[Path] = []  # every file taken, in os.walk's order
    found: list[Path] = []
    skipped: list[FileResult] = []
    owner: dict[str, str | None] = {}  # folder (relative) -> the vendored-looking folder it lies in
    candidates: dict[str, tuple[str, list[Path], list[FileResult]]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        here = Path(dirpath).relative_to(root).as_posix()
        within = owner.get(here.rpartition("/")[0] if "/" in here else ".") if here != "." else None
        if within is None and here != "." and not include_vendored:
            reason = vendored_reason(Path(dirpath).name, dirnames, filenames)
            if reason:
                within = here
                candidates[here] = (reason, [], [])
        owner[here] = within
        files, skips = (candidates[within][1], candidates[within][2]) if within else (found, skipped)
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
                    skips.append(FileResult(rel, None, error="symlink points outside the tree; not followed"))
                continue  # writing through a link would replace it with a file
            kind = not_regular(path)
            if kind:  # reading a FIFO would wait forever for a writer
                skips.append(FileResult(rel, None, error=f"not a regular file ({kind}); not read"))
                continue
            files.append(path)
            walked.append(path)
    if not candidates:
        return found, skipped, []
    kept, vendored = settle(root, {rel: (reason, paths) for rel, (reason, paths, _) in candidates.items()},
                            DecoderSignals(recipe, CODEMODS))
    if kept:
        taken = set(found + kept)
        found = [p for p in walked if p in taken]
        skipped += [f for v in vendored if not v.left_out for f in candidates[v.path][2]]
    return found, skipped, vendored


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
    new = insert_imports(new, context.scratch.get(AddImportsVisitor.CONTEXT_KEY, []), in_package)
    sites: list[Site] = []
    needs_runtime = False
    for (spec, _cls), step in zip(steps, instances):
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


def process_file(root: Path, path: Path, steps: list[tuple[StepSpec, type]], recipe: Recipe, in_package=None) -> FileResult:
    """One file through stages 2 to 4: read, prefilter, parse and run ``steps``."""
    result, _ = read_file(root, path)
    active = prefilter(result.original, steps) if result.error is None else []
    if active:
        package = (path.parent / "__init__.py").exists() if in_package is None else in_package
        merge(result, parse_file(result.original, active, package, recipe))
    return result


def parse_file(text: str, steps: list[tuple[StepSpec, type]], in_package: bool, recipe: Recipe) -> tuple:
    """Stages 3b and 4 for a file the text prefilter let through: ``analyse``, then ``conclude``."""
    return conclude(text, analyse(text, steps, in_package), recipe)


def analyse(text: str, steps: list[tuple[StepSpec, type]], in_package: bool) -> tuple:
    """The ``ast`` prefilter, then one LibCST parse and pass (``transform_source``); what worker processes run.

    Returns (the indices in ``steps`` of the steps the ``ast`` prefilter kept, the new text or
    None when unchanged, the sites, whether the runtime is used, an error or None).
    """
    import libcst as cst

    active = prefilter_tree(text, steps)
    kept = [i for i, (spec, _cls) in enumerate(steps) if any(spec is a for a, _ in active)]
    if not active:
        return kept, None, [], False, None
    try:
        new, sites, needs_runtime = transform_source(text, active, in_package)
    except (cst.ParserSyntaxError, RecursionError) as exc:
        return kept, None, [], False, f"cannot parse: {_one_line(exc)}"
    except Exception as exc:  # a bug in a step: this file is skipped, the rest of the run goes on
        return kept, None, [], False, f"internal error (please report it): {_one_line(exc)}"
    return kept, None if new == text else new, sites, needs_runtime, None


def conclude(text: str, analysed: tuple, recipe: Recipe) -> tuple:
    """From ``analyse``'s result: (patched text with its provenance line, or None; the sites, ``patched``
    relabelled already-applied or fixed-upstream by the provenance; whether the runtime is used; error)."""
    _kept, new, sites, needs_runtime, error = analysed
    if error:
        return None, [], False, error
    recorded = read_provenance(text)
    for site in sites:
        if site.status == PATCHED:
            site.status = ALREADY_APPLIED if site.step in recorded else FIXED_UPSTREAM
            if site.status == FIXED_UPSTREAM:
                site.message += " (not written by ddpatch)"
    applied = {s.step for s in sites if s.status == APPLIED}
    patched = write_provenance(text if new is None else new, recorded | applied, recipe) if applied else None
    return patched, sites, needs_runtime, None


def merge(result: FileResult, parsed: tuple) -> FileResult:
    """``result`` with what ``parse_file`` found in its text."""
    result.patched, sites, result.needs_runtime, error = parsed
    if error:
        result.error = error
        return result
    for site in sites:
        site.path = result.path
    result.notes = [site for site in sites if site.status == UNCLASSIFIED]  # said in the report, never a status
    result.sites = [site for site in sites if site.status != UNCLASSIFIED]
    if result.patched is not None:
        try:
            result.encoded()
        except UnicodeEncodeError as exc:
            result.patched, result.error = None, f"cannot write: the patched text is not {result.encoding} ({exc.reason})"
    return result


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# ----------------------------------------------------------------------------- the pipeline
def run_recipe(recipe: Recipe, root: Path, upstream: str | None = None, jobs: int = 1, progress=None, exclude: Iterable[str] = (),
               survey: str | None = None, include_vendored: bool = False, list_decoders=None) -> Report:
    """The whole pipeline; ``progress(done, total)`` is called as files are processed.

    ``exclude``: ``--exclude`` patterns. ``survey``: say what the tree is before any step runs
    (``survey.py``): ``"require"`` stops a tree with none of the recipe's decoders (one line, exit 2),
    ``"report"`` only reports; None (``ci``, the corpus) runs the steps on anything.
    ``include_vendored``: also check the folders that look like copies of third-party packages
    (``patcher.engine.vendored``); by default they are listed in the report and not parsed.
    ``list_decoders(root, exclude)``: file -> why, the decoders the report names (``survey.shown_decoders``): the API
    hands it verify's own search, so that check names what verify runs; else the survey's decoder files are named.
    """
    root = Path(root)
    if not root.exists():
        raise EngineError(f"path does not exist: {root}")
    root = root.resolve()
    base = root if root.is_dir() else root.parent
    if not root.is_dir() and not_regular(root):
        raise EngineError(f"not a regular file or folder ({not_regular(root)}): {root}; pass the checkout's root folder")
    if root.is_file() and not covers(recipe, root.name):
        raise EngineError(f"not a Python file: {root}; pass the checkout's root folder (or a .py file)")
    if root.is_dir() and not any(root.iterdir()):
        raise EngineError(f"empty directory: {root}")
    excluded: dict[str, str] = {}
    exclude = tuple(exclude)
    paths, skipped, vendored = discover(root, recipe, include_vendored, exclude, excluded)
    if not paths and not skipped and not vendored and excluded:
        raise EngineError(f"every Python file under {root} is left out by --exclude {' '.join(exclude)}")
    if not paths and not skipped and not vendored:
        raise EngineError(f"no Python files matching {', '.join(recipe.include)} under {root}")
    if upstream is not None and upstream not in recipe.upstreams:
        raise EngineError(f"unknown upstream {upstream!r} for recipe {recipe.name}; known: {', '.join(recipe.upstreams)}")
    read = [read_file(base, path) for path in paths]  # each file is read once
    if root.is_dir() and not include_vendored:  # a file that copies transformers' cache code is vendored code
        signals = DecoderSignals(recipe, CODEMODS)
        copies = {result.path for result, text in read if copy_of_cache_code(text) and signals.find(text) is None}
        excluded.update(dict.fromkeys(sorted(copies), CACHE_COPY))
        paths = [path for path, (result, _) in zip(paths, read) if result.path not in copies]
        read = [(result, text) for result, text in read if result.path not in copies]
    defined = set()
    scans = [re.compile(cls.TREE_TRIGGER) for cls in CODEMODS.values() if cls.TREE_TRIGGER]
    scanned: dict[str, str] = {}  # texts some step's tree scan wants
    texts: dict[str, str] = {}  # every text, for the survey
    for result, text in read:
        defined.update(result.functions if result.error is None else defined_functions(text))
        if survey:
            texts[result.path] = text
        if any(p.search(text) for p in scans):
            scanned[result.path] = text
    forced = upstream is not None
    if upstream is None:
        upstream = recipe.detect_upstream(defined)
    found = survey_tree(texts, recipe, upstream) if survey and recipe.upstreams else None
    if found is not None and not found.decoders and survey == "require" and not forced:
        refuse(found, recipe, root)
    if leaves_out(found):  # code that is not torch; an engine's package beside a decoder: neither is patched
        kept = set(leave_out(found, paths, base, excluded, scanned))
        read = [(result, text) for (result, text), path in zip(read, paths) if path in kept]
        paths = [path for path in paths if path in kept]
    specs = [(tree_scan(spec, CODEMODS[spec.codemod], scanned), CODEMODS[spec.codemod]) for spec in recipe.steps if spec.applies_to(upstream)]
    modes = package_modes(base, {result.path: text for result, text in read})
    files = _map_files(paths, [result for result, _ in read], specs, recipe, jobs, progress, modes)
    files += add_runtime_files(base, files, {"exclude": list(exclude)} if exclude else None)
    texts = {f.path: f.original for f in files if f.original is not None}
    steps = classify(recipe, upstream, files, texts)
    missing = sorted(a for a in (recipe.upstreams[upstream].anchors if upstream else ()) if a not in defined)
    left = unsearched(exclude, excluded, skipped, vendored, SKIP_DIRS)
    listed = list_decoders(root, left) if found is not None and list_decoders is not None and root.is_dir() else {}
    report = Report(recipe, root, upstream, files + skipped, steps, missing, vendored, decoders=shown_decoders(found, listed, files),
                    exclude=exclude, excluded=excluded)
    mark_skipped(report)
    settle_absent_anchors(report, specs, texts)
    settle_unanchored(report, specs, texts)
    if found is not None:
        suggest_excludes(report, reached_by_decoders(report, set(found.decoders)))
        place_unplaced(report)
    return report


def tree_scan(spec: StepSpec, cls: type, scanned: dict[str, str]) -> StepSpec:
    """``spec`` with the parameters its step derives from the whole tree (``Step.scan_tree``)."""
    if not cls.TREE_TRIGGER:
        return spec
    pattern = re.compile(cls.TREE_TRIGGER)
    extra = cls.scan_tree({p: t for p, t in scanned.items() if pattern.search(t)}, {**cls.PARAMS, **spec.params})
    return dataclasses.replace(spec, params={**spec.params, **extra}) if extra else spec


#: ``analyse``'s results by (text, the steps the text prefilter let through, in_package), newest last:
#: a file met again in this process (``ddpatch ci``'s commits, a check then an apply through the API,
#: the tests) is neither parsed again nor sent to a worker.
_ANALYSED: "OrderedDict[tuple, tuple]" = OrderedDict()
#: Below this many files left for LibCST, they are analysed in this process. A pool for a fork's five
#: decoder files (bench_large_tree.py's tree, jobs 2, 2 cores at load 10) cost 13 % more CPU and
#: 22 % more wall time than none (medians of 8 runs each); a pool pays on a larger set of files.
POOL_MIN_FILES = 8


def _map_files(paths: list[Path], results: list[FileResult], specs, recipe: Recipe, jobs: int, progress=None,
               modes: dict | None = None) -> list[FileResult]:
    """Stages 3 and 4 over the tree: the text prefilter here, then ``analyse`` for the few files it lets
    through that this process has not analysed yet, in ``jobs`` worker processes when there are
    at least ``POOL_MIN_FILES`` of them (only those files' texts go to the workers)."""
    n = len(results)
    todo = []
    for result, path in zip(results, paths):
        active = prefilter(result.original, specs) if result.error is None else []
        if active:
            in_package = modes.get(result.path, False) if modes is not None else (path.parent / "__init__.py").exists()
            todo.append((result, _memo_key(result.original, active, in_package), (result.original, active, in_package)))
    done = n - len(todo)
    if progress is not None:
        for i in range(1, done + 1):
            progress(i, n)
    got = {key: _ANALYSED[key] for _result, key, _args in todo if key in _ANALYSED}  # known before this run
    for key in got:
        _ANALYSED.move_to_end(key)
    new = list({key: args for _result, key, args in todo if key not in got}.values())
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(new))) if jobs > 1 and len(new) >= POOL_MIN_FILES else None
    try:
        # in the order of ``new``: the first file of each new key takes the next result
        fresh = pool.map(analyse, *zip(*new), chunksize=max(1, min(8, len(new) // (4 * jobs)))) if pool else None
        for result, key, args in todo:
            out = got.get(key)
            if out is None:
                out = got[key] = next(fresh) if fresh is not None else analyse(*args)
                _ANALYSED[key] = out[:2] + (tuple(dataclasses.replace(s) for s in out[2]),) + out[3:]
                if len(_ANALYSED) > _MEMO_SIZE:
                    _ANALYSED.popitem(last=False)
            kept, new_text, sites, needs_runtime, error = out
            merge(result, conclude(result.original, (kept, new_text, [dataclasses.replace(s) for s in sites], needs_runtime, error), recipe))
            done += 1
            if progress is not None:
                progress(done, n)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return results
