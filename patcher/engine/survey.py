"""What a tree is, before any step runs: the recipe's decoders (with their files), a serving engine, or neither.

A tree with a decoder is one the recipe is for: the layout's decoder function is defined
(``ddtree_generate``, ``dflash_generate``, ...), or a function hands a drafter the target's
hidden states by keyword (``target_hidden=``) in a decode loop or beside a cache, or goes
through ddpatch's runtime (a patched tree). A tree without one is not DDTree or DFlash code,
and ``check``, ``diff``, ``apply`` and ``verify`` say so in one line (exit 2) instead of a
no-match per step for a stray ``torch.cuda.synchronize()``. A serving engine (a ``vllm`` or
``sglang`` package folder, or code that imports their internals) is named as such: ddpatch
patches research decoders, not engines; inside a tree that also holds a decoder, the engine's
package folders are left out. So is an engine's proposer or worker anywhere (one drafter
call, no loop and no cache: it is handed the target's features by the engine): no decoder.

Code that is not torch (a file that imports MLX or JAX, or numpy for a decoder, and neither
torch nor transformers: ``array_framework``) is never a decoder and never patched: the
recipe's steps write torch runtime calls. Beside a torch decoder such files are left out, and
the report says which and why.

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
from .codemods.base import RUNTIME_MODULE, ast_dotted, ast_inside
from .codemods.flow_tree import decoder_targets
from .imports import read_imports
from .recipe import Recipe

ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}
#: where the docs say what ddpatch patches and what it does not
ENGINES_DOC = "docs/usage.md#what-ddpatch-patches"
_ENGINE_IMPORT = re.compile(r"^[ \t]*(?:from|import)[ \t]+(" + "|".join(ENGINES) + r")\.\w", re.M)
_DECODER_TEXT = re.compile(r"target_hidden|" + RUNTIME_MODULE)
_RUNTIME_CALL = re.compile(r"\b" + RUNTIME_MODULE + r"\.(?:verify_forward|draft_forward|adopt_forward)\b")


#: array frameworks other than torch, by the top-level module a file imports
FRAMEWORKS = {"mlx": "MLX", "mlx_lm": "MLX", "jax": "JAX", "jaxlib": "JAX", "flax": "JAX", "numpy": "numpy"}
#: what torch code imports: a file that imports one of these is torch code, whatever else it imports
TORCH = ("torch", "transformers", "accelerate")
_IMPORTS = re.compile(r"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import\b|import[ \t]+([^\n#;]+))", re.M)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_CACHE_KEYWORDS = ("past_key_values", "cache", "past_key_value")
#: methods that run a module's layers, never a decoder
_NOT_DECODERS = ("forward", "_forward", "__call__")


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
    #: tree file -> (framework, module) of code that is not torch (``array_framework``): never patched
    not_torch: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: tree file -> why a function that hands a drafter ``target_hidden=`` is no decoder (an engine's proposer)
    proposers: dict[str, str] = field(default_factory=dict)


def survey(texts: dict[str, str], recipe: Recipe, upstream: str | None) -> Survey:
    """``texts``: tree-relative path -> text of every file the run covers; ``upstream``: the layout detected (or forced)."""
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
    numpy = {}
    for rel, text in texts.items():
        found = array_framework(text)
        if found is not None and found[0] == "numpy":
            numpy[rel] = found  # not torch only where it holds a decoder's shape: a numpy helper of a torch decoder is kept
        elif found is not None:
            out.not_torch[rel] = found
    # the layout's decoder function (its first marker; the others, `cuda_time` or `propose`, tell layouts apart)
    firsts = recipe.upstreams[upstream].markers[:1] if upstream is not None else []
    defs = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(" + "|".join(map(re.escape, firsts)) + r")\b", re.M) if firsts else None
    for rel, text in texts.items():
        if rel in out.not_torch or any(rel.startswith(f + "/") for f in out.engine_folders):
            continue
        marker = defs.search(text) if defs is not None and any(m in text for m in firsts) else None
        why, proposer = None, None
        if marker:
            why = f"defines `{marker.group(1)}`"
        elif _DECODER_TEXT.search(text):
            why, proposer = decoder_function(text, why_not=True)
        if (why or proposer) and rel in numpy:
            out.not_torch[rel] = numpy[rel]
        elif why:
            out.decoders[rel] = why
        elif proposer:
            out.proposers[rel] = proposer
    return out


def array_framework(text: str) -> tuple[str, str] | None:
    """(framework, module) where ``text`` imports, anywhere in it, an array framework other than torch (MLX, JAX, numpy)
    and neither torch, transformers nor accelerate; else None. Read with a regular expression (stdlib only): verify's
    decoder search can apply the same rule (``patcher.verify.subjects.decoders``)."""
    if not any(name in text for name in ("mlx", "jax", "flax", "numpy")):  # most files: no regular expression run
        return None
    other = None
    for m in _IMPORTS.finditer(text):
        modules = [m.group(1)] if m.group(1) else [part.split(" as ")[0].strip() for part in m.group(2).split(",")]
        for module in modules:
            top = module.split(".")[0]
            if top in TORCH:
                return None
            if top in FRAMEWORKS and (other is None or other[0] == "numpy"):
                other = (FRAMEWORKS[top], module)
    return other


def leaves_out(found: Survey | None) -> bool:
    """Whether ``leave_out`` has files to leave out: code that is not torch, or an engine's package beside a decoder."""
    return found is not None and bool(found.not_torch or found.engine_folders and found.decoders)


def leave_out(found: Survey, paths: list[Path], base: Path, excluded: dict[str, str], scanned: dict[str, str]) -> list[Path]:
    """``paths`` without code that is not torch and, beside a decoder, the files of the engines' package folders
    (each recorded in ``excluded`` with why, dropped from ``scanned``)."""
    names = {folder.rstrip("/"): engine for engine, evidence in found.engines.items() for folder in evidence}
    kept = []
    for path in paths:
        rel = path.relative_to(base).as_posix()
        folder = next((f for f in found.engine_folders if rel.startswith(f + "/")), None) if found.decoders else None
        if rel in found.not_torch:
            excluded[rel] = f"{found.not_torch[rel][0]} code, not torch: the recipe writes torch runtime calls"
        elif folder is not None:
            excluded[rel] = f"a {names.get(folder, 'serving engine')} package: ddpatch does not patch serving engines"
        else:
            kept.append(path)
            continue
        scanned.pop(rel, None)
    return kept


def decoder_function(text: str, why_not: bool = False):
    """Why ``text`` holds a decoder: a function (not a drafter's own method) that hands a model ``target_hidden=`` in a
    loop or beside a cache, or that goes through the runtime's ``verify_forward`` / ``draft_forward`` / ``adopt_forward``;
    else None. ``why_not``: (why, None), or (None, why a function that hands ``target_hidden=`` is no decoder)."""
    why, proposer = _decoder_function(text)
    return (why, proposer) if why_not else why


def _decoder_function(text: str) -> tuple[str | None, str | None]:
    if _RUNTIME_CALL.search(text):
        return "calls the ddpatch runtime (a patched decoder)", None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None, None
    drafters = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        forward = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
        if forward is not None and any(a.arg == "target_hidden" for a in forward.args.args + forward.args.kwonlyargs):
            # a drafter's own methods run its layers, except one that drives the drafter itself (``self(...)``) round
            # after round beside a cache: its own decoder (``spec_generate``), which verify runs too
            drafters |= {id(f) for f in ast.walk(cls) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and not _drives_itself(f)}
        drafters |= {id(f) for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in _NOT_DECODERS}  # a module's layers
    owners = {id(f): f"{cls.name}.{f.name}" for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for f in cls.body
              if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    proposer = None
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(n) not in drafters):
        for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call)):
            if any(k.arg == "target_hidden" for k in call.keywords):
                if _in_loop(fn, call) or _has_cache(fn):
                    return f"`{fn.name}` hands a drafter `target_hidden=`", None
                proposer = proposer or (f"`{owners.get(id(fn), fn.name)}` hands a drafter `target_hidden=` once, with no decode loop "
                                        f"and no cache (a serving engine's proposer or worker?)")
        if decoder_targets(fn):
            return f"`{fn.name}` hands a drafter the target's features and calls the target with a cache", None
    return None, proposer


def _drives_itself(fn: ast.AST) -> bool:
    """A drafter's method that hands ``self(...)`` (the drafter itself) ``target_hidden=`` in a loop and calls a model with a
    cache: a decode loop of the drafter's own (``spec_generate``), not one of the layers' calls inside its ``forward``."""
    if getattr(fn, "name", "") in _NOT_DECODERS:
        return False
    selfish = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "self"
                  and any(k.arg == "target_hidden" for k in c.keywords) and _in_loop(fn, c) for c in ast.walk(fn))
    return selfish and _has_cache(fn)


def _in_loop(fn: ast.AST, node: ast.AST) -> bool:
    return any(ast_inside(node, loop) for loop in ast.walk(fn) if isinstance(loop, _LOOPS))


def _has_cache(fn: ast.AST) -> bool:
    """A call in ``fn`` hands a model a cache (``past_key_values=``, ``cache=``), or builds one (``DynamicCache()``, ``_make_cache``)."""
    for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call)):
        if any(k.arg in _CACHE_KEYWORDS and not (isinstance(k.value, ast.Constant) and k.value.value in (None, True, False))
               for k in call.keywords):
            return True
        name = ast_dotted(call.func) or ""
        if name.split(".")[-1].lower().endswith("cache"):
            return True
    return False


def looked_for(recipe: Recipe) -> str:
    markers = sorted({m for up in recipe.upstreams.values() for m in up.markers[:1]})
    return f"the functions {', '.join(markers)}, and a function that hands a drafter `target_hidden` in a decode loop or beside a cache"


def refuse(found: Survey, recipe: Recipe, root: Path) -> None:
    """Raise ``NotADecoderTree`` for a tree with no decoder: a serving engine named as such."""
    family = recipe.decoders or recipe.name
    if found.engines:
        name, evidence = next(iter(found.engines.items()))
        shown = ", ".join(evidence[:3]) + (f" and {len(evidence) - 3} more" if len(evidence) > 3 else "")
        raise NotADecoderTree(f"{root} is a {name} serving engine tree ({shown}), and no {family} decoder was found in it: "
                              f"ddpatch patches {family} research decoders, not serving engines (what it does and does not "
                              f"patch: {ENGINES_DOC})")
    seen = [f"{rel} is {name} code (imports {module}), not torch" for rel, (name, module) in found.not_torch.items()]
    seen += [f"{rel}: {why}" for rel, why in found.proposers.items()]
    more = f" and {len(seen) - 2} more" if len(seen) > 2 else ""
    found_instead = f"; found instead: {'; '.join(seen[:2])}{more} (what ddpatch patches: {ENGINES_DOC})" if seen else ""
    raise NotADecoderTree(f"no {family} decoder found in {root} (looked for {looked_for(recipe)}){found_instead}")


# ----------------------------------------------------------------------------- after the steps
def unsearched(exclude, excluded: dict[str, str], skipped: list, vendored: list, skip_dirs) -> tuple[str, ...]:
    """``--exclude`` patterns for verify's decoder search (``shown_decoders``'s listing) that keep it to what the run read:
    a file that was not read (a FIFO would block the search), the folders discovery skips (a venv would cost it minutes)
    or left out as vendored, and the files left out in folders (one at the root would read as a name anywhere: the
    listing drops it after)."""
    return (*exclude, *(d for d in skip_dirs if not d.startswith(".")), "*.egg-info", *(f.path for f in skipped),
            *(p for p in excluded if "/" in p), *(f"{v.path}/" for v in vendored if v.left_out))


def shown_decoders(found: Survey | None, listed: dict[str, str], files: list) -> dict[str, str]:
    """The decoders a report names: those ``listed`` (verify's own search, through the API) in the files the run
    covered (not left out, not an engine's, not code that is not torch); else, or without a listing, the survey's."""
    if found is None:
        return {}
    covered = {f.path for f in files}
    shown = {rel: why for rel, why in listed.items() if rel in covered and rel not in found.not_torch}
    return shown or dict(found.decoders)


def reached_by_decoders(report: Report, also: set[str] = frozenset()) -> set[str]:
    """The decoder files (the report's, and ``also``: the survey's) and every tree file they import, transitively;
    sets ``report.import_issues``.

    Read from the files as they are on disk (the lines a user opens), keeping only the imports that
    still resolve to nothing once patched (lazy-datasets moves a module-level import into its function).
    """
    root = report.root if report.root.is_dir() else report.root.parent
    imports = read_imports(root, {f.path: f.original for f in report.files if f.original is not None})
    reached = imports.reach(set(report.decoders) | set(also))
    patched = {f.path: f.patched for f in report.files if f.changed and f.patched and f.path in imports.broken}
    still = read_imports(root, patched).broken if patched else {}
    # a sibling the tree itself says is gone stops apply where the decoders import it; a module that is merely not
    # installed here (an optional package, one of another environment) is listed, never a refusal
    decoders = set(report.decoders) | set(also)
    report.import_issues = [
        ImportIssue(rel, imp.line, imp.module, _import_message(imp, rel in reached, _spare(rel, decoders, imports) if rel in reached else None),
                    imp.in_tree and rel in reached, rel in reached)
        for rel, found in sorted(imports.broken.items()) for imp in found
        if rel not in patched or any(i.module == imp.module for i in still.get(rel, ()))
    ]
    return reached


def _spare(rel: str, decoders: set[str], imports) -> str | None:
    """The ``--exclude`` that leaves ``rel`` out and keeps every other decoder whole (an archived copy of the project under
    ``docs/``, an old version beside the new one): the widest folder holding ``rel`` and none of the files the other
    decoders import, else ``rel`` itself where no other decoder imports it; None where no decoder would be left."""
    parts = PurePosixPath(rel).parts
    for where in [*("/".join(parts[:depth]) + "/" for depth in range(1, len(parts))), rel]:
        others = {d for d in decoders if not (d.startswith(where) if where.endswith("/") else d == where)}
        if others and not any(k.startswith(where) if where.endswith("/") else k == where for k in imports.reach(others)):
            return where
    return None


def _import_message(imp, reached: bool, spare: str | None = None) -> str:
    top = imp.module.lstrip(".").split(".")[0]
    if imp.in_tree:
        what = f"`{imp.module}` names no file of the tree (a sibling module deleted or renamed?)"
    else:
        what = f"no `{top}.py` or `{top}/` in the tree, and no module `{top}` installed here (a sibling module deleted, or a package this environment lacks?)"
    if reached and imp.in_tree and spare:
        return what + (f"; a decoder imports this file, so neither it nor `ddpatch verify` can load: restore the module, or, if the "
                       f"patched tree does not need it (an archived or partial copy: "
                       f"{'no other decoder imports anything under ' + spare if spare.endswith('/') else 'no other decoder imports it'}), "
                       f"leave it out with --exclude {spare}")
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
