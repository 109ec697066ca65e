"""The parameters a decoder cannot run without although they default to ``None``.

A fork adds ``joint_checkpoint=None`` to its decoder and, left ``None``, raises before it decodes anything
(``if checkpoint is None: raise ValueError(...)``, in the decoder or in a helper it hands the parameter to). The
verifier has no value for such a parameter (a checkpoint file, a dataset): the decoder is "not verified: needs NAME",
named with how to give it, never run to a failure that the report would blame on the code.

Read statically from the decoder's source (``ast``) along the path its defaults take: a statement under ``if X is
None:`` is taken where ``X`` is another parameter left at ``None``; any other condition is not followed (no guess).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

#: how deep the search follows the parameter into the helpers it is handed to
DEPTH = 3


def _source(fn) -> ast.FunctionDef | None:
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _none_test(test, names: set[str]) -> tuple[str, bool] | None:
    """(name, True) for ``name is None`` / ``not name``, (name, False) for ``name is not None`` / ``name``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Name):
        return (test.operand.id, True) if test.operand.id in names else None
    if isinstance(test, ast.Name):
        return (test.id, False) if test.id in names else None
    if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id in names and len(test.ops) == 1
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
        if isinstance(test.ops[0], ast.Is):
            return test.left.id, True
        if isinstance(test.ops[0], ast.IsNot):
            return test.left.id, False
    return None


def _taken(body: list, nones: set[str]):
    """The statements the defaults reach, in order: into ``if X is None`` (``X`` left None), ``with`` and ``try``."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            known = _none_test(stmt.test, nones)
            if known is not None:
                yield from _taken(stmt.body if known[1] else stmt.orelse, nones)
        elif isinstance(stmt, (ast.With, ast.AsyncWith, ast.Try)):
            yield from _taken(stmt.body, nones)
        if isinstance(stmt, (ast.Return, ast.Raise)):
            return


def _raise_text(node: ast.Raise) -> str:
    exc = node.exc
    if isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name):
        arg = exc.args[0] if exc.args else None
        text = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""
        return f"{exc.func.id}({text!r})" if text else exc.func.id
    return "an error"


def _raises_on_none(node, param: str, fn, depth: int) -> str | None:
    """Why ``node`` (``fn``'s definition) raises when ``param`` is None, or None."""
    a = node.args
    defaults = dict(zip([p.arg for p in (*a.posonlyargs, *a.args)][::-1], a.defaults[::-1]))
    defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    nones = {p for p, d in defaults.items() if isinstance(d, ast.Constant) and d.value is None} | {param}
    for stmt in _taken(node.body, nones):
        if isinstance(stmt, ast.If) and _none_test(stmt.test, {param}) == (param, True):
            hit = next((s for s in stmt.body if isinstance(s, ast.Raise)), None)
            if hit is not None:
                return f"left None, {node.name} raises {_raise_text(hit)}"
        if isinstance(stmt, ast.Assert) and _none_test(stmt.test, {param}) == (param, False):
            return f"left None, {node.name} fails its assert on it"
        if depth <= 0 or isinstance(stmt, (ast.If, ast.With, ast.AsyncWith, ast.Try, ast.For, ast.While)):
            continue
        for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
            helper = getattr(fn, "__globals__", {}).get(call.func.id)
            into = _handed(call, param, helper)
            if into is None:
                continue
            inner = _source(helper)
            why = _raises_on_none(inner, into, helper, depth - 1) if inner is not None else None
            if why:
                return why
    return None


def _handed(call: ast.Call, param: str, helper) -> str | None:
    """The parameter of ``helper`` that ``call`` hands ``param`` to, or None."""
    if not inspect.isfunction(helper):
        return None
    try:
        names = list(inspect.signature(helper).parameters)
    except (TypeError, ValueError):
        return None
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Name) and arg.id == param and i < len(names):
            return names[i]
    for kw in call.keywords:
        if isinstance(kw.value, ast.Name) and kw.value.id == param and kw.arg in names:
            return kw.arg
    return None


def needed(fn, bound: set[str]) -> list[tuple[str, str]]:
    """(parameter, why) for each parameter of ``fn`` that defaults to None, that the verifier does not pass (``bound``:
    the parameters it binds a role to), and that ``fn`` raises on when it is left None."""
    node = _source(fn)
    if node is None:
        return []
    try:
        params = inspect.signature(inspect.unwrap(fn)).parameters.values()
    except (TypeError, ValueError):
        return []
    out = []
    for p in params:
        if p.name in bound or p.default is not None:
            continue
        why = _raises_on_none(node, p.name, inspect.unwrap(fn), DEPTH)
        if why:
            out.append((p.name, why))
    return out
