"""RemovedApi: the cache APIs transformers 5.x removed, rewritten where 5.x has an exact equivalent, else named.

Read from transformers 4.57.1 and 5.21.0 - 5.25.0's ``cache_utils.py``: no release of ddpatch's range has

* ``DynamicCache.to_legacy_cache()``, ``DynamicCache.from_legacy_cache(...)`` and ``cache[i]`` (the legacy tuple of
  ``(keys, values)`` per layer, gone in 5.0);
* ``Cache.get_max_cache_shape(layer_idx=0)``, which 5.x spells ``get_max_length(layer_idx)``;
* ``get_usable_length(...)``, ``seen_tokens``, ``key_cache`` / ``value_cache`` (gone before 5.0; code written
  for an older 4.x still calls them).

Code that calls one fails on 5.x (``AttributeError``), the patched tree's warm-up included.

Statuses and the evidence each rests on:

* ``applied`` -- ``X.get_max_cache_shape(i)`` became ``X.get_max_length(i)`` (layer 0 when none is given, as
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
from libcst.metadata import PositionProvider, QualifiedNameProvider

from .base import (APPLIED, CACHE_KEYWORDS, FIXED_UPSTREAM, NO_MATCH, PATCHED, Example, FunctionStack, Step, ast_dotted,
                   ast_nodes, code, dotted, is_runtime_call, runtime_call)
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
    USES_RUNTIME = True
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

    def visit_Module(self, node: cst.Module) -> bool:
        self.flow = ModuleFlow(node)
        return True

    # -- a branch only for the releases that have the form: `if hasattr(cache, "key_cache"):` ---------------------
    def visit_If(self, node: cst.If) -> None:
        self._leave_body(node)  # an `elif` is the orelse of the `if` before it
        guards = set()
        for call in _calls(node.test):
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
            self.record(node, PATCHED, f"`{dotted(node.func)}(...)` already goes through the runtime helper")
            return
        func = node.func
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
        self.record(original_node, APPLIED, f"`{code(original_node)}` on the draft's cache -> `legacy_layer(...)`")
        index = updated_node.slice[0].slice.value
        return runtime_call(self, "legacy_layer", [cst.Arg(updated_node.value), cst.Arg(index)])


def _calls(node: cst.CSTNode) -> list[cst.Call]:
    found: list[cst.Call] = []

    class _V(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(call)

    node.visit(_V())
    return found
