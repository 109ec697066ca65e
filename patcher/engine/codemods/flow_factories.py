"""Cache factories in other files of the tree: functions that build ``DynamicCache(config=...)`` from a parameter.

Forks move the cache out of the decoder: ``past_key_values_target = create_generation_cache(target.config)``,
with ``create_generation_cache`` in ``generation_cache.py``. ``flow.ModuleFlow`` reads one module, so the
decoder's file alone cannot say what that call builds. ``config_factories`` reads it from the whole tree (the
stdlib ``ast``, once, in ``target-cache-config``'s tree scan): a function of the tree is a *config factory* when
everything it returns is ``DynamicCache(config=E)`` (directly, or a local it assigned once, whatever methods it
calls on it before) and ``E`` reads one parameter and nothing else, as the model's config or its text config
(``p``, ``p.config``, ``p.text_config``, ``p.get_text_config(...)``, ``getattr(p, "text_config", p)``, through
locals assigned once). Then the cache a call of it builds is laid out from whatever that parameter is given
at the call, as if the call read ``DynamicCache(config=<that argument>)``.

A name defined twice in the tree, once otherwise, is no factory: the call could reach either.
"""

from __future__ import annotations

import ast
import re

from .base import ast_dotted

#: What a factory may read from its parameter on the way to the config.
_CONFIG_ATTRS = ("config", "text_config", "get_text_config")


def _cache_classes(tree: ast.Module) -> set[str]:
    """The names this module calls transformers' ``DynamicCache`` by."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "transformers":
            out |= {a.asname or a.name for a in node.names if a.name == "DynamicCache"}
        elif isinstance(node, ast.Import):
            out |= {f"{a.asname or a.name}.DynamicCache" for a in node.names if a.name == "transformers"}
    return out


def _single(fn: ast.FunctionDef) -> dict[str, ast.expr]:
    """Locals of ``fn`` assigned exactly once (by a plain ``name = value``)."""
    seen: dict[str, list] = {}
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for name in ast.walk(t):
                if isinstance(name, ast.Name):
                    seen.setdefault(name.id, []).append(node.value if isinstance(node, ast.Assign) and t is name else None)
    return {k: v[0] for k, v in seen.items() if len(v) == 1 and v[0] is not None}


def _reads_only(expr: ast.expr, param: str, local: dict[str, ast.expr], depth: int = 4) -> bool:
    """Whether ``expr`` is ``param``'s config (or text config) and reads nothing else."""
    if isinstance(expr, ast.Name):
        if expr.id == param:
            return True
        return depth > 0 and expr.id in local and expr.id != param and _reads_only(local[expr.id], param, local, depth - 1)
    if isinstance(expr, ast.Attribute):
        return expr.attr in _CONFIG_ATTRS and _reads_only(expr.value, param, local, depth)
    if isinstance(expr, ast.Call):
        if isinstance(expr.func, ast.Attribute) and expr.func.attr == "get_text_config":
            return _reads_only(expr.func.value, param, local, depth) and all(isinstance(k.value, ast.Constant) for k in expr.keywords) \
                and not expr.args
        if isinstance(expr.func, ast.Name) and expr.func.id == "getattr" and len(expr.args) in (2, 3) and not expr.keywords:
            name = expr.args[1]
            return isinstance(name, ast.Constant) and name.value in _CONFIG_ATTRS and _reads_only(expr.args[0], param, local, depth) \
                and (len(expr.args) == 2 or _reads_only(expr.args[2], param, local, depth))
    return False


def _factory(fn: ast.FunctionDef, classes: set[str]) -> tuple[int, str] | None:
    """(index, name) of the parameter ``fn`` builds every cache it returns from, or None."""
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    local = _single(fn)
    returns = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return)]
    if not returns or any(r is None for r in returns):
        return None
    found: set[str] = set()
    for value in returns:
        if isinstance(value, ast.Name) and value.id in local:
            value = local[value.id]
        if not (isinstance(value, ast.Call) and ast_dotted(value.func) in classes and not value.args
                and [k.arg for k in value.keywords] == ["config"]):
            return None
        config = value.keywords[0].value
        owners = [p for p in params if _reads_only(config, p, local)]
        if len(owners) != 1:
            return None
        found.add(owners[0])
    if len(found) != 1:
        return None
    (param,) = found
    return params.index(param), param


def config_factories(sources: dict[str, str]) -> dict[str, list]:
    """``{name: [parameter index, parameter name, "path:line"]}`` for the tree's config factories (module docstring).

    Only files that name ``DynamicCache`` are parsed; every other file is only searched for a ``def`` of the same
    name (which spoils it)."""
    out: dict[str, list] = {}
    spoiled: set[str] = set()
    others: list[str] = []
    for path, text in sorted(sources.items()):
        if "DynamicCache" not in text:
            others.append(text)
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        classes = _cache_classes(tree)
        methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or id(fn) in methods:
                continue
            made = _factory(fn, classes) if classes else None
            if made is None or (fn.name in out and out[fn.name][:2] != list(made)):
                spoiled.add(fn.name)
            elif fn.name not in out:
                out[fn.name] = [*made, f"{path}:{fn.lineno}"]
    if out and others:
        defined = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(" + "|".join(map(re.escape, out)) + r")\b", re.M)
        spoiled |= {name for text in others for name in defined.findall(text)}
    return {name: entry for name, entry in out.items() if name not in spoiled}


def unread_cache_source(text: str, function: str) -> str | None:
    """Where ``function`` (an anchor with no site for ``target-cache-config``) gets the cache it gives a model: the call
    it assigns it from, said in the anchor's no-match with the edit to make; None when it has no such call."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name != function:
            continue
        given = {k.value.id for c in ast.walk(fn) if isinstance(c, ast.Call) for k in c.keywords
                 if k.arg in ("past_key_values", "cache") and isinstance(k.value, ast.Name)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and any(
                    isinstance(t, ast.Name) and t.id in given for t in node.targets):
                made = ast.unparse(node.value.func)
                return (f"its cache comes from `{made}(...)` (line {node.lineno}), which ddpatch cannot read as one "
                        f"`DynamicCache(config=...)` built from the target's config (defined twice in the tree, or not in it); "
                        "build the target's cache with `DynamicCache(config=<target>.config)` where the decoder can be read")
    return None
