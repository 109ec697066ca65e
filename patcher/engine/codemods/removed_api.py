"""RemovedApi: the cache APIs transformers 5.x removed, rewritten where 5.x has an exact equivalent, else named.

Read from transformers 4.57.1 and 5.21.0 - 5.25.0's ``cache_utils.py``: no release of ddpatch's range has

* ``DynamicCache.to_legacy_cache()``, ``DynamicCache.from_legacy_cache(...)`` and ``cache[i]`` (the legacy tuple of
  ``(keys, values)`` per layer, gone in 5.0);
* ``Cache.get_max_cache_shape(layer_idx=0)``, which 5.x spells ``get_max_length(layer_idx)``;
* ``get_usable_length(...)``, ``seen_tokens``, ``key_cache`` / ``value_cache`` (gone before 5.0; code written
  for an older 4.x still calls them).

Code that calls one fails on 5.x (``AttributeError``), the patched tree's warm-up included.

Statuses and the evidence each rests on:

* ``applied`` -- a round trip that copies the cache, ``X.to_legacy_cache()`` -> every tensor cloned ->
  ``DynamicCache.from_legacy_cache(...)`` (inline, or in consecutive statements whose names are read once), became
  ``copy.deepcopy(X)``: the same copy of every key and value, and of a hybrid's linear-attention state too, which
  the tuple had no place for (a verify still waiting for its commit is not copied: the runtime refuses the copy's
  commit in one line). ``X.get_max_cache_shape(i)`` became ``X.get_max_length(i)`` (layer 0 when none is given, as
  4.x read it); on a **draft** cache by data flow (the drafter is pure attention), ``X.to_legacy_cache()``,
  ``DynamicCache.from_legacy_cache(t)`` and ``X[i]`` go through ``_ddpatch_runtime.to_legacy_cache`` /
  ``from_legacy_cache`` / ``legacy_layer``, which do what 4.57 did (and refuse, in one line, a layer that holds
  no keys and values).
* ``already-applied`` / ``fixed-upstream`` -- the call already goes through one of those runtime helpers;
  ``fixed-upstream`` also for a removed form under ``if hasattr(X, "<name>")`` (a branch for the releases that have
  it, which 5.x skips: DDTree's ``compact_dynamic_cache`` reads ``key_cache`` that way).
* ``no-match`` (a site naming the line and the form) -- the legacy format on the target's cache, or on a cache
  whose owner data flow does not say: a tuple of keys and values has no place for a hybrid target's
  linear-attention state, so no rewrite is exact; and every form without a 5.x equivalent.

The step has no anchors: a tree that calls none of these reports nothing for it.
"""

from __future__ import annotations

import ast

import libcst as cst
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider, QualifiedNameProvider

from .base import (APPLIED, CACHE_KEYWORDS, FIXED_UPSTREAM, NO_MATCH, PATCHED, Example, FunctionStack, Step, ast_dotted,
                   ast_nodes, code, cst_nodes, dotted, is_runtime_call, runtime_call)
from .flow import CACHE, DRAFT_CACHE, DRAFTER, TARGET_CACHE, ModuleFlow, is_role

#: method -> what transformers 5.x has instead (None: rewritten, see ``leave_Call``)
METHODS = {
    "to_legacy_cache": None,
    "get_max_cache_shape": None,
    "get_usable_length": "`get_seq_length(layer_idx)` for a cache that grows without a maximum",
}
#: attribute -> what transformers 5.x has instead
ATTRIBUTES = {
    "seen_tokens": "`get_seq_length()`",
    "key_cache": "`cache.layers[i].keys`",
    "value_cache": "`cache.layers[i].values`",
}
HELPERS = ("to_legacy_cache", "from_legacy_cache", "legacy_layer")
_TUPLE = ("a tuple of keys and values has no place for a hybrid target's linear-attention state, so no rewrite is exact: "
          "keep the DynamicCache object")


class RemovedApi(FunctionStack, Step):
    ID = "removed-api"
    DESCRIPTION = ("Rewrite cache APIs transformers 5.x removed (`to_legacy_cache`, `from_legacy_cache`, `cache[i]`, "
                   "`get_max_cache_shape`) where 5.x has an exact equivalent; name the others.")
    #: an index is looked for on a name that reads as a cache (``past_key_values[0]``, ``draft_cache[i]``): the text prefilter
    TRIGGERS = (r"legacy_cache|legacy_layer|get_max_cache_shape|get_usable_length|seen_tokens|key_cache|value_cache"
                r"|(?:cache|past_key_values)\w*\s*\[",)
    PARAMS: dict = {}
    USES_RUNTIME = False  # per file: True once a site goes through the runtime's legacy helpers
    NEEDS_SCOPE = True
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)
    EXAMPLES = (
        Example(
            """
            def budget(cache):
                return cache.get_max_cache_shape()
            """,
            """
            def budget(cache):
                return cache.get_max_length(0)
            """,
            "5.x spells it get_max_length; 4.x read layer 0",
        ),
        Example(
            """
            def snapshot(target, draft, ids, hidden):
                target_cache, draft_cache = DynamicCache(), DynamicCache()
                target(ids, past_key_values=target_cache)
                draft(target_hidden=hidden, past_key_values=draft_cache)
                return draft_cache.to_legacy_cache()
            """,
            """
            import _ddpatch_runtime

            def snapshot(target, draft, ids, hidden):
                target_cache, draft_cache = DynamicCache(), DynamicCache()
                target(ids, past_key_values=target_cache)
                draft(target_hidden=hidden, past_key_values=draft_cache)
                return _ddpatch_runtime.to_legacy_cache(draft_cache)
            """,
            "the draft's cache (pure attention): the runtime does what 4.57 did",
        ),
        Example(
            """
            def snapshot(cache):
                legacy = cache.to_legacy_cache()
                copied = tuple((k.clone(), v.clone()) for k, v in legacy)
                return DynamicCache.from_legacy_cache(copied)
            """,
            """
            import copy

            def snapshot(cache):
                return copy.deepcopy(cache)
            """,
            "a round trip that clones every tensor is a copy of the cache: copy.deepcopy copies a hybrid's state too",
        ),
        Example(
            """
            def clone(cache):
                return DynamicCache.from_legacy_cache(cache.to_legacy_cache())
            """,
            """
            def clone(cache):
                return DynamicCache.from_legacy_cache(cache.to_legacy_cache())
            """,
            "whose cache it is, data flow does not say: no-match, naming the line (on a hybrid target no rewrite is exact)",
        ),
    )

    @classmethod
    def may_match(cls, tree: ast.Module, params) -> bool:
        names = {*METHODS, *ATTRIBUTES, *HELPERS}
        if any(n.attr in names and ast_dotted(n.value) not in ("self", "cls") for n in ast_nodes(tree, ast.Attribute)):
            return True
        # an index into a name a model is given as its cache, or one named as a cache (past_key_values*, *cache*; not an
        # attribute of self: a tokenizer's own `self.cache[...]`)
        given = {ast_dotted(k.value) for c in ast_nodes(tree, ast.Call) for k in c.keywords if k.arg in CACHE_KEYWORDS}
        for n in ast_nodes(tree, ast.Subscript):
            name = ast_dotted(n.value) or ""
            named = "cache" in name.split(".")[-1] or name.split(".")[-1].startswith("past_key_values")
            if not isinstance(n.slice, ast.Slice) and (name in given or named and name.split(".")[0] not in ("self", "cls")):
                return True
        return False

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self.flow: ModuleFlow | None = None
        self._fns: list = [None]
        self.rewrite: dict[cst.CSTNode, str] = {}
        self._guards: list[dict] = []  # the enclosing ifs: the hasattr(...) forms their body may use
        self._copies: dict[int, cst.BaseExpression] = {}  # id of a round trip's from_legacy_cache call -> the cache it copies
        self._in_copy: set[int] = set()  # ids of the to_legacy_cache calls those round trips read
        self._drop: set[int] = set()  # ids of the statements that held their intermediate values

    def visit_Module(self, node: cst.Module) -> bool:
        self.flow = ModuleFlow(node)
        return True

    # -- a round trip through the legacy format that only copies the cache -------------------
    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        fn = self._fns[-1]
        if fn is None:
            return
        stmts = list(node.body)
        for i, stmt in enumerate(stmts):
            simple = isinstance(stmt, cst.SimpleStatementLine) and "from_legacy_cache" in code(stmt)
            for call in cst_nodes(stmt, cst.Call) if simple else ():
                if self._from_legacy(call) and len(call.args) == 1 and not call.args[0].keyword:
                    self._round_trip(fn, stmts[:i], call)

    def _round_trip(self, fn, before: list, call: cst.Call) -> None:
        """``from_legacy_cache(<every tensor of X.to_legacy_cache() cloned>)``, the values in the statements right before."""
        drop: list[cst.CSTNode] = []

        def value(expr: cst.BaseExpression) -> cst.BaseExpression | None:
            """``expr``, or what a name read once was assigned in the statement right before the chain so far."""
            name = expr.value if isinstance(expr, cst.Name) else None
            if name is None:
                return expr
            at = len(before) - len(drop) - 1
            stmt = before[at] if at >= 0 else None
            if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)):
                return None
            assign = stmt.body[0]
            if [dotted(t.target) for t in assign.targets] != [name] or _reads(fn.node, name) != 1:
                return None
            drop.append(stmt)
            return assign.value

        copied = value(call.args[0].value)
        if isinstance(copied, cst.Call) and dotted(copied.func) in ("tuple", "list") and len(copied.args) == 1:
            copied = copied.args[0].value
        if not (isinstance(copied, (cst.GeneratorExp, cst.ListComp)) and _clones(copied)):
            return
        legacy = value(copied.for_in.iter)
        if not (isinstance(legacy, cst.Call) and isinstance(legacy.func, cst.Attribute) and legacy.func.attr.value == "to_legacy_cache"
                and not legacy.args and dotted(legacy.func.value)):
            return
        self._copies[id(call)] = legacy.func.value
        self._in_copy.add(id(legacy))
        self._drop.update(id(s) for s in drop)

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine):
        return cst.RemoveFromParent() if id(original_node) in self._drop else updated_node

    # -- a branch only for the releases that have the form: `if hasattr(cache, "key_cache"):` ---------------------
    def visit_If(self, node: cst.If) -> None:
        self._leave_body(node)  # an `elif` is the orelse of the `if` before it
        guards = set()
        for call in cst_nodes(node.test, cst.Call):
            if dotted(call.func) == "hasattr" and len(call.args) == 2 and isinstance(call.args[1].value, cst.SimpleString):
                guards.add((dotted(call.args[0].value), call.args[1].value.evaluated_value))
        self._guards.append({"guards": guards, "orelse": id(node.orelse) if node.orelse is not None else None})

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
        self._guards.pop()
        return updated_node

    def visit_Else(self, node: cst.Else) -> None:
        self._leave_body(node)

    def _leave_body(self, node) -> None:
        for frame in self._guards:
            if frame["orelse"] == id(node):
                frame["guards"] = set()  # the else branch runs where the form is absent: no guard there

    def _guarded(self, node: cst.CSTNode, receiver: cst.BaseExpression, name: str) -> bool:
        """``node`` (``receiver.name``) sits in the body of an ``if hasattr(receiver, "name")``: said fixed-upstream."""
        key = (dotted(receiver), name)
        if not any(key in frame["guards"] for frame in self._guards):
            return False
        self.record(node, FIXED_UPSTREAM, f"`{code(node)}` runs only under `hasattr({key[0]}, \"{name}\")`: a branch for the "
                                          "releases that have it, which transformers 5.x skips")
        return True

    # -- whose cache --------------------------------------------------------------------
    def _roles(self, expr: cst.BaseExpression) -> set[str]:
        fn, name = self._fns[-1], dotted(expr)
        return fn.role(name) if fn is not None and name else set()

    def _draft(self, expr: cst.BaseExpression) -> bool:
        return is_role(self._roles(expr), DRAFT_CACHE)

    def _owner(self, expr: cst.BaseExpression) -> str:
        roles = self._roles(expr)
        if is_role(roles, TARGET_CACHE):
            return "the target's cache"
        return "a cache whose owner data flow does not say (the target's, on a hybrid model?)"

    def _from_legacy(self, node: cst.Call) -> bool:
        func = node.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "from_legacy_cache"):
            return False
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, func.value, set())}
        return any(n.split(".")[-1].endswith("Cache") for n in names) or (dotted(func.value) or "").endswith("Cache")

    def _from_legacy_target(self, node: cst.Call) -> set[str]:
        """The roles of what ``DynamicCache.from_legacy_cache(...)``'s result is assigned to, in this function."""
        fn = self._fns[-1]
        if fn is None:
            return set()
        out: set[str] = set()
        for var, values in fn.assigns.items():
            if any(v is node for v in values):
                out |= fn.role(var)
        for mc in fn.model_calls:
            if mc.cache is node:
                out |= {DRAFT_CACHE} if is_role(fn.role(mc.callee), DRAFTER) else {TARGET_CACHE} if fn.role(mc.callee) else set()
        return out

    # -- sites --------------------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        if any(is_runtime_call(node, h) for h in HELPERS):
            self.USES_RUNTIME = True
            self.record(node, PATCHED, f"`{dotted(node.func)}(...)` already goes through the runtime helper")
            return
        func = node.func
        if id(node) in self._in_copy:
            return  # the round trip's own read: the copy below replaces it
        if id(node) in self._copies:
            self.rewrite[node] = "deepcopy"
            return
        if self._from_legacy(node):
            if is_role(self._from_legacy_target(node), DRAFT_CACHE):
                self.rewrite[node] = "from_legacy_cache"
            else:
                self.record(node, NO_MATCH, f"`{code(func)}(...)`: transformers 5.x removed the legacy cache format, and the "
                                            f"cache it builds goes to {self._owner_of_result(node)}; {_TUPLE}")
            return
        if not isinstance(func, cst.Attribute) or func.attr.value not in METHODS or dotted(func.value) in ("self", "cls"):
            return
        method, receiver = func.attr.value, func.value
        if self._guarded(node, receiver, method):
            return
        if method == "get_max_cache_shape":
            self.rewrite[node] = method
        elif method == "to_legacy_cache" and self._draft(receiver):
            self.rewrite[node] = method
        elif method == "to_legacy_cache":
            self.record(node, NO_MATCH, f"`{code(receiver)}.to_legacy_cache()` on {self._owner(receiver)}: transformers 5.x "
                                        f"removed the legacy cache format; {_TUPLE}")
        else:
            self.record(node, NO_MATCH, f"`{code(receiver)}.{method}(...)`: transformers 5.x has no `{method}`; it has {METHODS[method]}")

    def _owner_of_result(self, node: cst.Call) -> str:
        roles = self._from_legacy_target(node)
        return "the target" if is_role(roles, TARGET_CACHE) else "a model data flow does not name"

    def visit_Attribute(self, node: cst.Attribute) -> None:
        attr = node.attr.value
        if attr in ATTRIBUTES and self._roles(node.value) & {CACHE, TARGET_CACHE, DRAFT_CACHE} and not self._guarded(node, node.value, attr):
            self.record(node, NO_MATCH, f"`{code(node)}`: transformers 5.x caches have no `{attr}`; they have {ATTRIBUTES[attr]}")

    def visit_Subscript(self, node: cst.Subscript) -> None:
        # a cache a model is given by data flow, or one named as transformers names it: a module's own `cache=` structure
        # (a dict of its layers, say) indexed by layer is not the legacy format
        roles, name = self._roles(node.value), dotted(node.value) or ""
        if not (roles & {TARGET_CACHE, DRAFT_CACHE} or CACHE in roles and name.split(".")[-1].startswith("past_key_values")):
            return
        if len(node.slice) != 1:
            return
        if not isinstance(node.slice[0].slice, cst.Index):
            return
        if self._draft(node.value):
            self.rewrite[node] = "legacy_layer"
        else:
            self.record(node, NO_MATCH, f"`{code(node)}` on {self._owner(node.value)}: transformers 5.x caches are not "
                                        f"indexable (4.x gave layer i's keys and values); {_TUPLE}")

    # -- rewrites -----------------------------------------------------------------------
    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        what = self.rewrite.get(original_node)
        if what == "deepcopy":
            cache = self._copies[id(original_node)]
            AddImportsVisitor.add_needed_import(self.context, "copy")
            self.record(original_node, APPLIED, f"`{code(cache)}.to_legacy_cache()`, every tensor cloned, then `from_legacy_cache(...)`: "
                                                f"a copy of the cache -> `copy.deepcopy({code(cache)})` (a hybrid's linear-attention "
                                                "state is copied too)")
            return cst.parse_expression(f"copy.deepcopy({code(cache)})").with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)
        if what in ("to_legacy_cache", "from_legacy_cache"):
            self.USES_RUNTIME = True
        if what == "get_max_cache_shape":
            args = list(updated_node.args) or [cst.Arg(cst.Integer("0"))]
            self.record(original_node, APPLIED, f"`{code(original_node)}` -> `get_max_length(...)`: the same on 5.x (4.x read layer 0)")
            return updated_node.with_changes(func=updated_node.func.with_changes(attr=cst.Name("get_max_length")), args=args)
        if what == "to_legacy_cache":
            receiver = updated_node.func.value
            self.record(original_node, APPLIED, f"`{code(original_node)}` on the draft's cache -> `to_legacy_cache({code(receiver)})`")
            return runtime_call(self, "to_legacy_cache", [cst.Arg(receiver)])
        if what == "from_legacy_cache":
            self.record(original_node, APPLIED, f"`{code(original_node.func)}(...)` for the draft's cache -> `from_legacy_cache(...)`")
            return runtime_call(self, "from_legacy_cache", list(updated_node.args))
        return updated_node

    def leave_Subscript(self, original_node: cst.Subscript, updated_node: cst.Subscript) -> cst.BaseExpression:
        if self.rewrite.get(original_node) != "legacy_layer":
            return updated_node
        self.USES_RUNTIME = True
        self.record(original_node, APPLIED, f"`{code(original_node)}` on the draft's cache -> `legacy_layer(...)`")
        index = updated_node.slice[0].slice.value
        return runtime_call(self, "legacy_layer", [cst.Arg(updated_node.value), cst.Arg(index)])


def _reads(fn: cst.FunctionDef, name: str) -> int:
    """How often ``fn`` reads ``name`` (a ``Name`` node that is not an assignment's target)."""
    targets = {id(t.target) for a in cst_nodes(fn, cst.Assign) for t in a.targets}
    return sum(1 for n in cst_nodes(fn, cst.Name) if n.value == name and id(n) not in targets)


def _clones(comp: cst.GeneratorExp | cst.ListComp) -> bool:
    """``(a.clone(), b.clone()) for a, b in ...`` (``.detach()`` / ``.contiguous()`` beside the clone), one clause, no
    condition, every loop variable once and in order; or ``tuple(t.clone() for t in layer) for layer in ...``."""
    clause = comp.for_in
    if clause.inner_for_in is not None or clause.ifs or clause.asynchronous is not None:
        return False
    loop = [dotted(e.value) for e in clause.target.elements] if isinstance(clause.target, cst.Tuple) else [dotted(clause.target)]
    element = comp.elt
    if isinstance(element, cst.Tuple):
        return [_cloned(e.value) for e in element.elements] == loop and None not in loop
    if isinstance(element, cst.Call) and dotted(element.func) == "tuple" and len(element.args) == 1 and len(loop) == 1:
        inner = element.args[0].value
        return isinstance(inner, cst.GeneratorExp) and dotted(inner.for_in.iter) == loop[0] and inner.for_in.inner_for_in is None \
            and not inner.for_in.ifs and _cloned(inner.elt) == dotted(inner.for_in.target) is not None
    return False


def _cloned(expr: cst.BaseExpression) -> str | None:
    """``x`` for ``x.clone()`` (with ``.detach()`` / ``.contiguous()`` before or after the clone), else None."""
    methods = []
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and not expr.args:
        methods.append(expr.func.attr.value)
        expr = expr.func.value
    if "clone" not in methods or not set(methods) <= {"clone", "detach", "contiguous"}:
        return None
    return dotted(expr) if isinstance(expr, cst.Name) else None


