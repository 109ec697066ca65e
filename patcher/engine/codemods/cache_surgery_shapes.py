"""The shapes ``cache_surgery`` reads, as plain functions of LibCST nodes: a chain a tensor is read from, an in-place
torch method, a slice that keeps a prefix of a [batch, heads, tokens, dim] tensor's tokens, a helper that writes into
its parameter."""

from __future__ import annotations

import libcst as cst

from .base import code, dotted


def peel(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """``expr`` and what it is read from: ``a.keys.narrow(...)[0]`` -> itself, ``a.keys.narrow(...)``, ``a.keys.narrow``,
    ``a.keys``, ``a``."""
    out = [expr]
    while isinstance(expr, (cst.Attribute, cst.Call, cst.Subscript)):
        expr = expr.value if isinstance(expr, (cst.Attribute, cst.Subscript)) else expr.func
        out.append(expr)
    return out


def in_place(call: cst.Call) -> bool:
    """A torch in-place method (``copy_``, ``index_copy_``, ``zero_``)."""
    func = call.func
    return isinstance(func, cst.Attribute) and func.attr.value.endswith("_") and not func.attr.value.startswith("_")


def prefix_stop(sub: cst.BaseExpression) -> cst.BaseExpression | None:
    """``n`` of ``x[:, :, :n]``, ``x[:, :, :n, :]`` or ``x[..., :n, :]`` (keep the first ``n`` of a [batch, heads, tokens, dim]
    tensor's tokens), else None."""
    if not isinstance(sub, cst.Subscript):
        return None
    elems = [e.slice for e in sub.slice]
    full = [isinstance(s, cst.Slice) and s.lower is None and s.upper is None and s.step is None for s in elems]
    dots = [isinstance(s, cst.Index) and isinstance(s.value, cst.Ellipsis) for s in elems]
    stops = [i for i, s in enumerate(elems) if isinstance(s, cst.Slice) and s.lower is None and s.step is None and s.upper is not None]
    if len(stops) != 1 or not all(f or d or i == stops[0] for i, (f, d) in enumerate(zip(full, dots))):
        return None
    k = stops[0]
    before, after = dots[:k], elems[k + 1:]
    if any(before):
        ok = before == [True] and len(after) == 1 and full[k + 1]
    else:
        ok = k == 2 and not any(dots[k + 1:][1:])
    return elems[k].upper if ok else None


def mutates(fn: cst.FunctionDef, param: str) -> bool:
    """Whether ``fn`` writes into its parameter ``param`` (``param[...] = ...``, ``param.narrow(...).copy_(...)``)."""
    found = []

    class _V(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            for t in node.targets:
                if isinstance(t.target, cst.Subscript) and dotted(peel(t.target)[-1]) == param:
                    found.append(t)

        def visit_Call(self, node: cst.Call) -> None:
            if in_place(node) and dotted(peel(node.func.value)[-1]) == param:
                found.append(node)

    fn.body.visit(_V())
    return bool(found)


def same(expr: cst.BaseExpression, spelled: str) -> bool:
    return code(expr).replace(" ", "") == spelled.replace(" ", "")


def loop_head(node: cst.For) -> str:
    return f"for {code(node.target)} in {code(node.iter)}"


def contains(outer: cst.CSTNode, node: cst.CSTNode) -> bool:
    found = []

    class _V(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            if n is node:
                found.append(n)
            return not found

    outer.visit(_V())
    return bool(found)


