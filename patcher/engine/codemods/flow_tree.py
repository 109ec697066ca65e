"""Data flow past one module: which parameters callers elsewhere in the tree hand the target, and
which names hold a model (``flow.ModuleFlow`` reads one module; these are what it cannot see there).

A decoder's target is known inside the decoder (the model its drafter's function calls with a
cache). A helper that builds its own bare cache for a model and has no drafter in sight -- a
fork's ``target_generate(target, ...)`` warm-up, a profiling script's function -- names no
target. But the benchmark that calls both hands them the same object: what it gives the
decoder's target parameter, it gives the helper too. ``target_seeds`` reads that, with the
stdlib ``ast`` and only on the files that need it, so that the helper's parameter is the target
(``ModuleFlow(seeds=...)``) when its module is run.
"""

from __future__ import annotations

import ast
import re
from typing import Protocol

import libcst as cst

from .base import CACHE_KEYWORDS, RUNTIME_MODULE, ast_dotted, ast_nodes, dotted
from .flow_prefilter import _ast_fed

# ``fn`` below is a ``flow.Fn`` (flow imports this module, so the type is named, not imported)

_LOADERS = ("from_pretrained", "from_config")
_DECODER_TEXT = re.compile(r"target_hidden|" + RUNTIME_MODULE)
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)", re.M)
_BARE_CACHE = re.compile(r"DynamicCache\(\s*\)")
_CAUSAL_LM = re.compile(r"(ForCausalLM|ForConditionalGeneration|^AutoModelForImageTextToText)$")



class Fn(Protocol):
    """What these helpers read of a function's flow (``flow.Fn``, which imports this module: no import back)."""

    params: list[str]
    kwonly: list[str]
    assigns: dict[str, list[cst.BaseExpression]]

# ----------------------------------------------------------------------------- names that hold a model
def _loaded(fn: "Fn", name: str) -> list[str]:
    """The classes ``name`` is loaded from in ``fn`` (``X.from_pretrained(...)`` / ``X.from_config(...)``)."""
    out = []
    for value in fn.assigns.get(name, []):
        while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in ("eval", "to", "cuda"):
            value = value.func.value  # `X.from_pretrained(...).eval().to(device)`
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in _LOADERS:
            out.append((dotted(value.func.value) or "").split(".")[-1])
    return out


def holds_model(fn: "Fn", name: str) -> bool:
    """Whether ``name`` can hold a model handed to ``fn``: one of its parameters."""
    return name in fn.params or name in fn.kwonly


def loaded_causal_lm(fn: "Fn", name: str) -> bool:
    """``name`` is loaded in ``fn`` as a causal LM (``AutoModelForCausalLM``, ``*ForCausalLM``, ``*ForConditionalGeneration``)."""
    return any(_CAUSAL_LM.search(c) for c in _loaded(fn, name))


def seeded_params(fn: "Fn", seeds: dict[str, list]) -> list[str]:
    """The parameters of ``fn`` (a module-level function) that ``seeds`` (``{function: [index or keyword]}``) name."""
    if fn.owner is not None or fn.name not in seeds:
        return []
    out = []
    for entry in seeds[fn.name]:
        if isinstance(entry, int) and entry < len(fn.params):
            out.append(fn.params[entry])
        elif isinstance(entry, str) and entry in fn.params + fn.kwonly:
            out.append(entry)
    return out


# ----------------------------------------------------------------------------- the tree scan
def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """The module's functions that are not methods (a caller reaches them as ``f(...)`` or ``module.f(...)``)."""
    methods = {id(f) for c in ast_nodes(tree, ast.ClassDef) for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return [f for f in ast_nodes(tree, ast.FunctionDef, ast.AsyncFunctionDef) if id(f) not in methods]


def _head(name: str | None) -> str:
    return (name or "").split(".")[0]


def _assigned(fn: ast.AST) -> dict[str, list]:
    out: dict[str, list] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                name = ast_dotted(target)
                if name:
                    out.setdefault(name, []).append(node.value)
    return out


def _has_cache(call: ast.Call) -> bool:
    return any(k.arg in CACHE_KEYWORDS and not isinstance(k.value, ast.Constant) for k in call.keywords)


def decoder_targets(fn: ast.FunctionDef) -> set[str]:
    """The parameters of ``fn`` that are its target: the model it calls with a cache, where it also calls a drafter
    (``target_hidden=``, the runtime's ``draft_forward``, or positionally with the target's features); or the model
    it routes through ``verify_forward`` / ``adopt_forward``."""
    params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
    calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
    drafters: set[str] = set()
    targets: set[str] = set()
    for c in calls:
        name = ast_dotted(c.func) or ""
        first = ast_dotted(c.args[0]) if c.args else None
        if name in (f"{RUNTIME_MODULE}.verify_forward", f"{RUNTIME_MODULE}.adopt_forward"):
            targets.add(_head(first))
        elif name == f"{RUNTIME_MODULE}.draft_forward":
            drafters.add(_head(first))
        elif any(k.arg == "target_hidden" for k in c.keywords):
            drafters.add(_head(name))
    models = {ast_dotted(c.func) for c in calls if _has_cache(c)} - {None}
    if not drafters and models:  # a drafter given the features positionally
        assigned = _assigned(fn)
        for c in calls:
            name = ast_dotted(c.func)
            if name and _head(name) in params and not _has_cache(c):
                others = {m for m in models if _head(m) != _head(name)} | {name}
                if any(_ast_fed(a, name, others, assigned, 6, set()) for a in c.args):
                    drafters.add(_head(name))
    if drafters:
        targets |= {_head(m) for m in models if _head(m) not in drafters}
    return (targets - drafters) & params


def _bind(call: ast.Call, params: list[str]) -> list[tuple[str, ast.expr]]:
    out = []
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            break
        if i < len(params):
            out.append((params[i], arg))
    out += [(k.arg, k.value) for k in call.keywords if k.arg]
    return out


def target_seeds(sources: dict[str, str]) -> dict[str, list]:
    """``{function: [positional index or keyword, ...]}``: where callers in the tree hand a tree function the target.

    A caller that hands a decoder its target (the benchmark's ``dflash_generate(draft, target, ...)``)
    holds the target in that name (and in a name it loads a causal LM into); every function of the tree
    that builds a bare ``DynamicCache()`` (the only ones a seed can change) and that the caller hands the
    name to (``target_generate(target, ...)``) gets it as the target. Decoders are read only in files
    that mention ``target_hidden`` or the runtime; callers only in files that call a decoder by name.
    """
    decoders: dict[str, tuple[list[str], set[str]]] = {}
    for text in sources.values():
        if not _DECODER_TEXT.search(text):
            continue
        tree = _parse(text)
        for fn in _functions(tree) if tree is not None else ():
            targets = decoder_targets(fn)
            if targets:
                decoders[fn.name] = ([a.arg for a in fn.args.posonlyargs + fn.args.args], targets)
    if not decoders:
        return {}
    # only a function that builds a bare cache can use a seed
    bare = {name for text in sources.values() if _BARE_CACHE.search(text) for name in _DEF.findall(text)}
    calls_decoder = re.compile(r"\b(?:" + "|".join(map(re.escape, decoders)) + r")\s*\(")
    seeds: dict[str, set] = {}
    for text in sources.values():
        if not calls_decoder.search(text):
            continue
        tree = _parse(text)
        for scope in [tree, *_functions(tree)] if tree is not None else ():
            calls = [c for c in ast.walk(scope) if isinstance(c, ast.Call)]
            held = {n for n, values in _assigned(scope).items() if any(_loads_causal_lm(v) for v in values)}
            for c in calls:
                name = (ast_dotted(c.func) or "").split(".")[-1]
                if name in decoders:
                    params, targets = decoders[name]
                    held |= {a.id for p, a in _bind(c, params) if p in targets and isinstance(a, ast.Name)}
            for c in calls if held else ():
                name = (ast_dotted(c.func) or "").split(".")[-1]
                if name not in bare or name in decoders:
                    continue
                entries = {i for i, a in enumerate(c.args) if isinstance(a, ast.Name) and a.id in held}
                entries |= {k.arg for k in c.keywords if k.arg and isinstance(k.value, ast.Name) and k.value.id in held}
                if entries:
                    seeds.setdefault(name, set()).update(entries)
    return {name: sorted(entries, key=lambda e: (isinstance(e, str), str(e))) for name, entries in seeds.items()}


def _loads_causal_lm(value: ast.expr) -> bool:
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ("eval", "to", "cuda"):
        value = value.func.value
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _LOADERS):
        return False
    return bool(_CAUSAL_LM.search((ast_dotted(value.func.value) or "").split(".")[-1]))


def _parse(text: str) -> ast.Module | None:
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None


# ----------------------------------------------------------------------------- the prefilter
def may_have_targets(tree: ast.Module, seeds: dict[str, list]) -> bool:
    """Whether a module could hold a target that no drafter names (the prefilter of ``target-cache-config``'s
    seeded and loaded targets, and of its notes): a function ``seeds`` names, a causal LM loaded with
    ``from_pretrained``/``from_config``, or a bare ``DynamicCache()``, each beside a call that passes a cache."""
    calls = ast_nodes(tree, ast.Call)
    if not any(_has_cache(c) for c in calls):
        return False
    if seeds and any(f.name in seeds for f in ast_nodes(tree, ast.FunctionDef, ast.AsyncFunctionDef)):
        return True
    for c in calls:
        name = ast_dotted(c.func) or ""
        if name.endswith("DynamicCache") and not c.args and not c.keywords:
            return True
        if isinstance(c.func, ast.Attribute) and c.func.attr in _LOADERS and _CAUSAL_LM.search(name.rsplit(".", 2)[-2] if "." in name else ""):
            return True
    return False
