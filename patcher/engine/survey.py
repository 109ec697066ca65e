"""What a tree is, before any step runs: the recipe's decoders (with their files), a serving engine, or neither.

A tree with a decoder is one the recipe is for: the layout's marker functions are defined
(``ddtree_generate``, ``dflash_generate``, ...), or a function hands a drafter the target's
hidden states by keyword (``target_hidden=``) or goes through ddpatch's runtime (a patched
tree). A tree without one is not DDTree or DFlash code, and ``check``, ``diff``, ``apply`` and
``verify`` say so in one line (exit 2) instead of a no-match per step for a stray
``torch.cuda.synchronize()``. A serving engine (a ``vllm`` or ``sglang`` package folder, or code
that imports their internals) is named as such: ddpatch patches research decoders, not engines;
inside a tree that also holds a decoder, the engine's package folders are left out.

After the steps ran, the survey also says which files the decoders import (``reached``): a
refusal that comes from any other file (an analysis or profiling script) suggests the exact
``--exclude``, and an import in a reached file that resolves to nothing stops ``apply``.
"""

from __future__ import annotations

import ast
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import EngineError
from ..results import NO_MATCH, ImportIssue, Report
from .codemods.base import RUNTIME_MODULE
from .codemods.flow_tree import decoder_targets
from .imports import read_imports
from .recipe import Recipe

ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}
#: where the docs say what ddpatch patches and what it does not
ENGINES_DOC = "docs/usage.md#what-ddpatch-patches"
_ENGINE_IMPORT = re.compile(r"^[ \t]*(?:from|import)[ \t]+(" + "|".join(ENGINES) + r")\.\w", re.M)
_DECODER_TEXT = re.compile(r"target_hidden|" + RUNTIME_MODULE)
_RUNTIME_CALL = re.compile(r"\b" + RUNTIME_MODULE + r"\.(?:verify_forward|draft_forward|adopt_forward)\b")


class NotADecoderTree(EngineError):
    """A tree with none of the recipe's decoders (or a serving engine): one line, exit 2."""


@dataclass
class Survey:
    #: tree file -> why it holds a decoder
    decoders: dict[str, str] = field(default_factory=dict)
    #: engine name -> evidence (package folders, or files importing its internals)
    engines: dict[str, list[str]] = field(default_factory=dict)
    #: the engines' package folders inside the tree
    engine_folders: list[str] = field(default_factory=list)


def survey(texts: dict[str, str], recipe: Recipe, upstream: str | None, defined: dict[str, str]) -> Survey:
    """``texts``: tree-relative path -> text of every file the run covers; ``defined``: function -> a file defining it."""
    out = Survey()
    for rel in texts:
        parts = PurePosixPath(rel).parts
        for i, part in enumerate(parts[:-1]):
            if part in ENGINES and parts[i + 1] == "__init__.py" and i + 2 == len(parts):
                folder = "/".join(parts[: i + 1])
                out.engine_folders.append(folder)
                out.engines.setdefault(ENGINES[part], []).append(folder + "/")
    for rel, text in texts.items():
        if "vllm." not in text and "sglang." not in text:
            continue
        for m in _ENGINE_IMPORT.finditer(text):
            if not any(rel.startswith(f + "/") for f in out.engine_folders):
                out.engines.setdefault(ENGINES[m.group(1)], []).append(rel)
                break
    if upstream is not None:
        for marker in recipe.upstreams[upstream].markers:
            if marker in defined:
                out.decoders.setdefault(defined[marker], f"defines `{marker}`")
    for rel, text in texts.items():
        if rel in out.decoders or any(rel.startswith(f + "/") for f in out.engine_folders) or not _DECODER_TEXT.search(text):
            continue
        why = decoder_function(text)
        if why:
            out.decoders[rel] = why
    return out


def leave_out_engines(found: Survey, paths: list[Path], base: Path, excluded: dict[str, str], scanned: dict[str, str]) -> list[Path]:
    """``paths`` without the files of the engines' package folders (recorded in ``excluded``, dropped from ``scanned``)."""
    names = {folder.rstrip("/"): engine for engine, evidence in found.engines.items() for folder in evidence}
    kept = []
    for path in paths:
        rel = path.relative_to(base).as_posix()
        folder = next((f for f in found.engine_folders if rel.startswith(f + "/")), None)
        if folder is None:
            kept.append(path)
            continue
        excluded[rel] = f"a {names.get(folder, 'serving engine')} package: ddpatch does not patch serving engines"
        scanned.pop(rel, None)
    return kept


def decoder_function(text: str) -> str | None:
    """Why ``text`` holds a decoder: a function (not a drafter's own method) that hands a model ``target_hidden=``, or
    that goes through the runtime's ``verify_forward`` / ``draft_forward`` / ``adopt_forward``; else None."""
    if _RUNTIME_CALL.search(text):
        return "calls the ddpatch runtime (a patched decoder)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None
    drafters = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        forward = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
        if forward is not None and any(a.arg == "target_hidden" for a in forward.args.args + forward.args.kwonlyargs):
            drafters |= {id(f) for f in ast.walk(cls) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        drafters |= {id(f) for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"}  # a module's layers
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(n) not in drafters):
        for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call)):
            if any(k.arg == "target_hidden" for k in call.keywords):
                return f"`{fn.name}` hands a drafter `target_hidden=`"
        if decoder_targets(fn):
            return f"`{fn.name}` hands a drafter the target's features and calls the target with a cache"
    return None


def looked_for(recipe: Recipe) -> str:
    markers = sorted({m for up in recipe.upstreams.values() for m in up.markers[:1]})
    return f"the functions {', '.join(markers)}, and a function that hands a drafter `target_hidden`"


def refuse(found: Survey, recipe: Recipe, root: Path) -> None:
    """Raise ``NotADecoderTree`` for a tree with no decoder: a serving engine named as such."""
    family = recipe.decoders or recipe.name
    if found.engines:
        name, evidence = next(iter(found.engines.items()))
        shown = ", ".join(evidence[:3]) + (f" and {len(evidence) - 3} more" if len(evidence) > 3 else "")
        raise NotADecoderTree(f"{root} is a {name} serving engine tree ({shown}), and no {family} decoder was found in it: "
                              f"ddpatch patches {family} research decoders, not serving engines (what it does and does not "
                              f"patch: {ENGINES_DOC})")
    raise NotADecoderTree(f"no {family} decoder found in {root} (looked for {looked_for(recipe)})")


# ----------------------------------------------------------------------------- after the steps
def reached_by_decoders(report: Report) -> set[str]:
    """The decoder files and every tree file they import, transitively; sets ``report.import_issues``.

    Read from the files as they are on disk (the lines a user opens), keeping only the imports that
    still resolve to nothing once patched (lazy-datasets moves a module-level import into its function).
    """
    root = report.root if report.root.is_dir() else report.root.parent
    imports = read_imports(root, {f.path: f.original for f in report.files if f.original is not None})
    reached = imports.reach(set(report.decoders))
    patched = {f.path: f.patched for f in report.files if f.changed and f.patched and f.path in imports.broken}
    still = read_imports(root, patched).broken if patched else {}
    # a sibling the tree itself says is gone stops apply where the decoders import it; a module that is merely not
    # installed here (an optional package, one of another environment) is listed, never a refusal
    report.import_issues = [
        ImportIssue(rel, imp.line, imp.module, _import_message(imp, rel in reached), imp.in_tree and rel in reached)
        for rel, found in sorted(imports.broken.items()) for imp in found
        if rel not in patched or any(i.module == imp.module for i in still.get(rel, ()))
    ]
    return reached


def _import_message(imp, reached: bool) -> str:
    top = imp.module.lstrip(".").split(".")[0]
    if imp.in_tree:
        what = f"`{imp.module}` names no file of the tree (a sibling module deleted or renamed?)"
    else:
        what = f"no `{top}.py` or `{top}/` in the tree, and no module `{top}` installed here (a sibling module deleted, or a package this environment lacks?)"
    if reached and imp.in_tree:
        return what + "; the decoders import this file, so neither they nor `ddpatch verify` can load: restore the module"
    if reached:
        return what + "; the decoders import this file, so `ddpatch verify` cannot load them here unless it is installed"
    return what


def suggest_excludes(report: Report, reached: set[str]) -> None:
    """A no-match site in a file no decoder imports (an analysis or profiling script): say so, with the exact --exclude."""
    if not report.decoders:
        return
    anchored = {a.path for s in report.steps for a in s.anchors if a.path}
    keep = reached | anchored
    shown = ", ".join(sorted(report.decoders)[:3])
    for step in report.steps:
        for site in step.sites:
            if site.status != NO_MATCH or site.path in keep or "--exclude" in site.message:
                continue
            site.message += (f" ({site.path} is imported by no decoder ({shown}): if the patched tree does not need it, "
                             f"leave it out with --exclude {exclude_glob(site.path, keep)})")


def exclude_glob(path: str, keep: set[str]) -> str:
    """The widest folder holding ``path`` and none of ``keep`` (``analysis/``), else the file itself."""
    parts = PurePosixPath(path).parts
    for depth in range(1, len(parts)):
        folder = "/".join(parts[:depth])
        if not any(k.startswith(folder + "/") for k in keep):
            return folder + "/"
    return path
