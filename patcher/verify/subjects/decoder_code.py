"""A decoder with the tree's helpers it reaches, read statically (``coverage`` reads each function): the decoder
parameters that guard each branch, in the decoder and, through the arguments of the call sites, in its helpers
(``compact(cache, trim=trim_kv)``: the helper's ``if trim:`` is behind ``trim_kv``); which statements can change tokens
or caches, a call into a helper that holds one included; and the decoder's mode parameters: a bool default, a
``Literal[...]`` annotation, a comparison with string constants in the body (each value but the default), and for
``block_size`` the values that turn its comparisons with a constant the other way than this verify's.

Stdlib only; nothing of the tree is imported or run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .coverage import (DATA_ROLES, MODE_ROLES, Arm, Code, root_name, short, aliases, analyse, flow_names, model_params,
                       statement_sites)
from .reach import Tree


_OPS = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
        ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}


def _flips(code: Code, p: str, current: int) -> list[int]:
    """Values of ``p`` that turn one of the body's ``p OP constant`` comparisons the other way than ``current`` does."""
    out = set()
    for node in ast.walk(code.node):
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _OPS):
            continue
        left, right, op = node.left, node.comparators[0], _OPS[type(node.ops[0])]
        if isinstance(left, ast.Name) and left.id == p and isinstance(right, ast.Constant) and type(right.value) is int:
            test = lambda v, c=right.value, op=op: op(v, c)  # noqa: E731
        elif isinstance(right, ast.Name) and right.id == p and isinstance(left, ast.Constant) and type(left.value) is int:
            test = lambda v, c=left.value, op=op: op(c, v)  # noqa: E731
        else:
            continue
        c = right.value if isinstance(right, ast.Constant) else left.value
        out |= {v for v in (c - 1, c, c + 1) if v >= 1 and test(v) != test(current)}
    return sorted(out)


def _literal_values(ann) -> list | None:
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return None
    if not (isinstance(ann, ast.Subscript) and short(ann.value) in ("Literal", "typing.Literal", "t.Literal")):
        return None
    elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    return [e.value for e in elts if isinstance(e, ast.Constant)]


def mode_parameters(code: Code, roles: dict, current: dict) -> dict:
    """Parameter -> {"values": [...], "why": ...}: the values other than its default that a mode run may pass.
    ``roles``: parameter -> the role the binding gives it (a role carries the verifier's fixed inputs, not a mode,
    but for ``MODE_ROLES``); ``current``: the values this verify passes those roles (``{"block_size": 4}``)."""
    out: dict = {}
    for p in code.params:
        if p == "self" or (p in roles and roles[p] not in MODE_ROLES):
            continue
        default = code.defaults.get(p)
        d = default.value if isinstance(default, ast.Constant) else object()
        if roles.get(p) in MODE_ROLES:
            values = _flips(code, p, current.get(roles[p], 0))
            if values:
                out[p] = {"values": values, "why": f"compared with a constant, this verify passes {current.get(roles[p])}",
                          "role": roles[p]}
            continue
        if isinstance(d, bool):
            out[p] = {"values": [not d], "why": "a bool flag"}
            continue
        literal = _literal_values(code.annotations.get(p))
        if literal:
            values = [v for v in literal if v != d]
            if values:
                out[p] = {"values": values, "why": "Literal[" + ", ".join(map(repr, literal)) + "]"}
            continue
        strings = []
        for node in ast.walk(code.node):
            if isinstance(node, ast.Compare) and any(isinstance(s, ast.Name) and s.id == p for s in [node.left, *node.comparators]):
                for c in [node.left, *node.comparators]:
                    consts = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
                    strings += [e.value for e in consts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        values = [s for s in dict.fromkeys(strings) if s != d]
        if values:
            out[p] = {"values": values, "why": "compared with " + ", ".join(repr(s) for s in values)}
    return out


@dataclass
class DecoderCode:
    """A decoder, the tree's helpers it reaches, and what each helper parameter comes from."""

    decoder: Code
    helpers: dict  # key -> Code, in the order they were reached
    origins: dict  # key -> parameter -> the decoder parameters its value comes from
    sites: dict  # key -> statement -> what can change tokens or caches (helper calls included)
    risky: dict  # key -> the first such site of the function or anything it calls, or ""
    modes: dict  # decoder parameter -> {"values", "why"}
    data: frozenset = frozenset()  # decoder parameters that carry data, not a choice: the models, the prompt, the mask id
    calls: dict = field(default_factory=dict)  # key -> [(line of the call, callee key)] within these functions

    def functions(self) -> dict:
        return {self.decoder.key: self.decoder, **self.helpers}

    def guards(self, code: Code, arm: Arm) -> list[str]:
        """The decoder parameters an arm's test reads (through locals, and into a helper through its call sites)."""
        params = code.from_params(arm.names)
        origin = self.origins.get(code.key, {})
        return sorted({d for p in params for d in origin.get(p, ())} - self.data)


def _bound(call: ast.Call, callee: Code, method_call: bool) -> list[tuple[str, ast.AST]]:
    """(callee parameter, argument expression) for one call site."""
    params = callee.params[1:] if method_call and callee.params[:1] == ["self"] else callee.params
    out = [(p, a) for p, a in zip(params, call.args) if not isinstance(a, ast.Starred)]
    out += [(k.arg, k.value) for k in call.keywords if k.arg in callee.params]
    return out


def decoder_code(tree: Tree, key, roles: dict, current: dict, drafters: tuple = (), extra=()) -> DecoderCode | None:
    """The decoder ``key`` with its helpers; ``roles`` as the binding reads its parameters; ``drafters``: the
    drafter class names (``self`` of their methods is a model); ``extra``: more functions of the tree that its runs
    entered (a drafter's layers, reached through ``nn.Module.__call__``), with the helpers they reach."""
    decoder = analyse(tree, key)
    if decoder is None:
        return None
    reached = tree.helpers(key)
    for k in sorted(set(extra) - set(reached) - {key}):
        reached.setdefault(k, [])
        for callee, sites in tree.helpers(k).items():
            reached.setdefault(callee, []).extend(sites)
    helpers = {k: c for k in reached if (c := analyse(tree, k)) is not None}
    funcs = {key: decoder, **helpers}
    origins = {key: {p: {p} for p in decoder.params}}
    models = {key: model_params(decoder) | {p for p, r in roles.items() if r in ("draft", "target")}}
    for k, c in funcs.items():
        if "." in k[1] and k[1].split(".")[0] in drafters:
            models.setdefault(k, set()).add("self")
        if k != key:
            models.setdefault(k, set()).update(model_params(c))
    for _ in range(4):  # call sites reached before their caller was: settle in a few rounds
        for k, sites in reached.items():
            if k not in helpers:
                continue
            for caller, call in sites:
                if caller not in funcs:
                    continue
                caller_models = aliases(funcs[caller], models.get(caller, set()))
                for p, arg in _bound(call, helpers[k], "." in k[1]):
                    came = {d for q in funcs[caller].from_params(flow_names(arg)) for d in origins.get(caller, {}).get(q, ())}
                    origins.setdefault(k, {}).setdefault(p, set()).update(came)
                    if isinstance(arg, (ast.Name, ast.Attribute)) and root_name(arg) in caller_models:
                        models.setdefault(k, set()).add(p)
    sites: dict = {}
    for k, c in funcs.items():
        m, caches = aliases(c, models.get(k, set())), aliases(c, set(), of_caches=True)
        stmts = {n.lineno: n for n in ast.walk(c.node) if isinstance(n, (ast.stmt, ast.ExceptHandler)) and n.lineno in c.statements}
        sites[k] = {line: s for line, n in stmts.items() if (s := statement_sites(n, m, caches))}
    calls = {k: [(call, callee) for call, callee in tree.calls(k) if callee in funcs] for k in funcs}
    risky = {k: next((s[0] for s in sites[k].values()), "") for k in funcs}
    for _ in range(len(funcs)):  # a helper that calls a risky helper is risky
        changed = False
        for k in funcs:
            if not risky[k]:
                hit = next((callee for _, callee in calls[k] if risky[callee]), None)
                if hit is not None:
                    risky[k], changed = f"calls {hit[1]} ({risky[hit]})", True
        if not changed:
            break
    for k in funcs:  # each statement's calls into risky helpers are its sites too
        stmts = sorted(funcs[k].statements)
        for call, callee in calls[k]:
            if risky[callee]:
                at = max((s for s in stmts if s <= call.lineno), default=None)
                if at is not None:
                    sites[k].setdefault(at, []).append(f"calls {callee[1]} ({risky[callee]})")
    data = frozenset(p for p, r in roles.items() if r in DATA_ROLES) | model_params(decoder)
    return DecoderCode(decoder, helpers, origins, sites, risky, mode_parameters(decoder, roles, current), data,
                       {k: [(call.lineno, callee) for call, callee in calls[k]] for k in funcs})
