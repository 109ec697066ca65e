"""CacheSurgery: edits of a cache's layers by hand, made exact where a cache operation does the same, else named.

Forks cut or rearrange a cache without its ``crop``: ``for layer in cache.layers: layer.keys =
layer.keys[:, :, :n]`` (and ``.values``), ``layer.keys[..., a:b, :] = ...`` (a compaction of their
own), ``cache.layers[i].keys.copy_(...)``, ``cache.batch_select_indices(rows)``, 4.x's
``cache.key_cache[i] = ...``. On a hybrid target (Qwen3.5/3.6) the linear-attention (Gated DeltaNet)
layers have no ``keys``: the edit raises ``AttributeError``, or, where it skips layers without keys
(``if hasattr(layer, "keys")``), it keeps a recurrent state that still holds the dropped tokens,
which decodes on, lossy. Whose cache it is decides (data flow, ``flow.py``): the drafter's cache
holds attention layers only, where such an edit is what ``crop`` does.

Statuses and the evidence each rests on:

* ``applied`` -- a loop over a cache's layers whose whole body keeps the first ``n`` tokens of each
  layer's keys and values (the same loop-invariant ``n``, on the sequence dimension: ``[:, :, :n]``,
  ``[..., :n, :]``; a negative ``n`` drops ``-n``), on the target's cache or one whose owner data
  flow does not say, became ``_ddpatch_runtime.crop_cache(cache, n)``: the 4.x crop it spells by
  hand, which cuts every layer (a sliding one by its own rule) and commits the recurrent state a
  verify recorded by ``verify-forward`` left. A guard that skips layers without keys goes with it.
  On the draft's cache built from a config (sliding-window layers, which keep only the last window),
  the same loop is rewritten too.
* ``already-applied`` -- that rewrite, recognised by its trailing ``# ddpatch cache-surgery`` comment.
* ``fixed-upstream`` -- any such edit on the draft's cache built bare (``DynamicCache()``: full
  attention, no recurrent state), where editing keys and values by hand is exact.
* ``no-match`` (a site naming the line and the way forward) -- any other edit of a layer's keys or
  values, ``batch_select_indices`` / ``batch_repeat_interleave`` (a linear-attention layer has
  neither), and ``key_cache`` / ``value_cache`` edits (gone in 5.x), on the target's cache or one
  whose owner data flow does not say. Where the site runs only under an ``if`` that reads a
  parameter of its function (``trim_kv``), the message names the parameter and its default: a
  run with the defaults never reaches the line.
* ``no-match`` -- a hand edit of the linear-attention state (``conv_states`` / ``recurrent_states``: a tensor
  method on the store, an in-place write or an assignment into it), outside a module's ``forward``
  (``cache_surgery_state``: why it breaks on 5.x, and the runtime's operations that replace the save and restore).

Left to other steps: a function another step commits (``committed``, DDTree's
``compact_dynamic_cache``, which ``tree-commit`` decorates, or one already decorated with
``tree_commit``); ``key_cache`` / ``value_cache`` on a name data flow calls a cache
(``removed-cache-api`` names those). Reading a layer's keys is not an edit and is not reported. The
step has no anchors: a tree without such an edit reports nothing for it.
"""

from __future__ import annotations

import ast

import libcst as cst

from .base import (APPLIED, FIXED_UPSTREAM, NO_MATCH, PATCHED, Example, FunctionStack, Step, ast_dotted, ast_nodes, code, cst_nodes, dotted,
                   is_runtime_call, runtime_call)
from .cache_surgery_shapes import contains, in_place, loop_head, mutates, peel, prefix_stop, same
from .cache_surgery_state import STATE, StateEdits
from .flow import CACHE, DRAFT_CACHE, TARGET_CACHE, ModuleFlow, is_role, names_in

KV = ("keys", "values")
LEGACY = ("key_cache", "value_cache")
BATCH = ("batch_select_indices", "batch_repeat_interleave")
MARK = "# ddpatch cache-surgery"
_MARK_TEXT = MARK + ": was a hand trim of each layer's keys and values"
_TEST_NAMES = {"hasattr", "getattr", "isinstance", "len", "None", "torch", "torch.Tensor"}
_WAY = ("cut the cache with `_ddpatch_runtime.crop_cache(cache, n)` (keep n tokens) or `_ddpatch_runtime.compact_cache(cache, "
        "past_length, keep)` (keep tree nodes) instead")
_HYBRID = "a hybrid's linear-attention layers have no `.keys` (AttributeError), and skipping them keeps stale recurrent state"


class CacheSurgery(StateEdits, FunctionStack, Step):
    ID = "cache-surgery"
    DESCRIPTION = ("Rewrite a hand trim of every cache layer's keys and values to `_ddpatch_runtime.crop_cache(cache, n)`; name "
                   "the other hand edits of a cache's layers that a hybrid's linear-attention layers break.")
    TRIGGERS = (r"layers|key_cache|value_cache|batch_\w+_in\w+|ddpatch cache-surgery|conv_states|recurrent_states",)
    #: committed: functions another step commits exactly (``tree-commit`` decorates DDTree's compaction); helper: the crop
    PARAMS = {"committed": [], "helper": "crop_cache"}
    USES_RUNTIME = True
    EXAMPLES = (
        Example(
            """
            def rewind(target, ids, cache, keep):
                target(ids, past_key_values=cache)
                for layer in cache.layers:
                    layer.keys = layer.keys[:, :, :keep]
                    layer.values = layer.values[:, :, :keep]
            """,
            """
            import _ddpatch_runtime

            def rewind(target, ids, cache, keep):
                target(ids, past_key_values=cache)
                _ddpatch_runtime.crop_cache(cache, keep)  # ddpatch cache-surgery: was a hand trim of each layer's keys and values
            """,
            "the 4.x crop spelled by hand: crop_cache cuts every layer, linear attention included",
        ),
        Example(
            """
            def draft_round(draft, hidden, start):
                draft_cache = DynamicCache()
                draft(target_hidden=hidden, past_key_values=draft_cache)
                for layer in draft_cache.layers:
                    layer.keys = layer.keys[..., :start, :]
                    layer.values = layer.values[..., :start, :]
            """,
            """
            def draft_round(draft, hidden, start):
                draft_cache = DynamicCache()
                draft(target_hidden=hidden, past_key_values=draft_cache)
                for layer in draft_cache.layers:
                    layer.keys = layer.keys[..., :start, :]
                    layer.values = layer.values[..., :start, :]
            """,
            "the draft's bare cache holds attention layers only: fixed-upstream, left alone",
        ),
        Example(
            """
            def keep_rows(cache, rows):
                cache.batch_select_indices(rows)
            """,
            """
            def keep_rows(cache, rows):
                cache.batch_select_indices(rows)
            """,
            "no-match: a linear-attention layer has no batch_select_indices",
        ),
    )

    @classmethod
    def may_match(cls, tree: ast.Module, params) -> bool:
        attrs = ast_nodes(tree, ast.Attribute)
        if any(a.attr in LEGACY + BATCH + STATE and ast_dotted(a.value) not in ("self", "cls") for a in attrs):
            return True
        if any(ast_dotted(c.func) == f"_ddpatch_runtime.{params['helper']}" for c in ast_nodes(tree, ast.Call)):
            return True  # a rewrite of this step, said already-applied
        if not any(a.attr == "layers" for a in attrs):
            return False
        calls = ast_nodes(tree, ast.Call)
        if any(ast_dotted(c.func) == "getattr" and any(isinstance(a, ast.Constant) and a.value in KV for a in c.args[1:2])
               for c in calls):
            return True
        # a layer's keys are a tensor, never called: `x.keys()` / `x.values()` (a dict's, in every modeling file)
        # is no site, and letting it through sent most of transformers to LibCST and a data-flow pass
        called = {id(c.func) for c in calls}
        return any(a.attr in KV and id(a) not in called for a in attrs)

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self.flow: ModuleFlow | None = None
        self._fns: list = [None]
        self._layers: list[dict[str, cst.BaseExpression]] = [{}]  # per function: a name holding a layer -> its cache
        self._aliases: list[dict[str, cst.BaseExpression]] = [{}]  # per function: a name holding a layer's keys -> its cache
        self._loops: list[list] = []  # the loops over a cache's layers: [node, cache, first edit]
        self._ifs: list[cst.If] = []
        self._skip = 0  # inside a function another step commits, or a loop being rewritten
        self.rewrite: dict[cst.For, tuple[cst.BaseExpression, cst.BaseExpression]] = {}
        self._said: set[int] = set()

    def visit_Module(self, node: cst.Module) -> bool:
        self.flow = ModuleFlow(node)
        return True

    # -- scopes ---------------------------------------------------------------------------
    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self._layers.append({})
        self._aliases.append({})
        if node.name.value in self.params["committed"] or any(
                (dotted(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator) or "").endswith("tree_commit")
                for d in node.decorators):
            self._skip += 1
        return super().visit_FunctionDef(node)

    def leave_FunctionDef(self, original_node, updated_node):
        self._layers.pop()
        self._aliases.pop()
        if original_node.name.value in self.params["committed"] or any(
                (dotted(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator) or "").endswith("tree_commit")
                for d in original_node.decorators):
            self._skip -= 1
        return super().leave_FunctionDef(original_node, updated_node)

    def visit_If(self, node: cst.If) -> None:
        self._ifs.append(node)

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
        self._ifs.pop()
        return updated_node

    # -- what an expression is ---------------------------------------------------------------
    def _roles(self, expr: cst.BaseExpression) -> set[str]:
        fn, name = self._fns[-1], dotted(expr)
        return fn.role(name) if fn is not None and name else set()

    def _cache_like(self, expr: cst.BaseExpression) -> bool:
        """A cache by data flow, or named as one (``cache``, ``*_cache``, ``past_key_values*``, ``kv``); never ``self`` itself."""
        name = dotted(expr)
        if name is None or name in ("self", "cls"):
            return False
        if self._roles(expr) & {CACHE, TARGET_CACHE, DRAFT_CACHE}:
            return True
        last = name.split(".")[-1].lower()
        return "cache" in last or last.startswith("past_key_values") or last in ("kv", "pkv", "kvs", "past")

    def _layer_of(self, expr: cst.BaseExpression) -> cst.BaseExpression | None:
        """The cache ``expr`` is a layer of: a name bound to one, or ``<cache>.layers[i]``."""
        if isinstance(expr, cst.Name):
            return self._layers[-1].get(expr.value)
        if isinstance(expr, cst.Subscript) and isinstance(expr.value, cst.Attribute) and expr.value.attr.value == "layers":
            return expr.value.value if self._cache_like(expr.value.value) else None
        return None

    def _keys_of(self, expr: cst.BaseExpression) -> cst.BaseExpression | None:
        """The cache whose layer's keys or values ``expr`` is (``layer.keys``, ``getattr(layer, "keys")``, a name holding one)."""
        if isinstance(expr, cst.Attribute) and expr.attr.value in KV:
            return self._layer_of(expr.value)
        if isinstance(expr, cst.Call) and dotted(expr.func) == "getattr" and len(expr.args) >= 2:
            attr = expr.args[1].value
            if isinstance(attr, cst.SimpleString) and attr.evaluated_value in KV:
                return self._layer_of(expr.args[0].value)
        if isinstance(expr, cst.Name):
            return self._aliases[-1].get(expr.value)
        return None

    def _legacy_of(self, expr: cst.BaseExpression) -> cst.BaseExpression | None:
        """The cache of ``<cache>.key_cache``, where data flow does not call it a cache (else removed-cache-api names it)."""
        if isinstance(expr, cst.Attribute) and expr.attr.value in LEGACY and self._cache_like(expr.value):
            if not self._roles(expr.value) & {CACHE, TARGET_CACHE, DRAFT_CACHE} and not self._hasattr_guard(expr):
                return expr.value
        return None

    def _hasattr_guard(self, expr: cst.Attribute) -> bool:
        want = (dotted(expr.value), expr.attr.value)
        for node in self._ifs:
            for call in (c for c in cst_nodes(node.test, cst.Call) if dotted(c.func) == "hasattr" and len(c.args) == 2):
                arg = call.args[1].value
                if isinstance(arg, cst.SimpleString) and (dotted(call.args[0].value), arg.evaluated_value) == want:
                    return True
        return False

    def _edited(self, expr: cst.BaseExpression) -> tuple[cst.BaseExpression, str] | None:
        """(cache, what) where writing into ``expr`` edits a cache layer's tensors."""
        for part in peel(expr):
            cache = self._keys_of(part)
            if cache is not None:
                return cache, "kv"
            cache = self._legacy_of(part)
            if cache is not None:
                return cache, "legacy"
        return None

    # -- loops over a cache's layers ------------------------------------------------------------
    def _layer_loop(self, node: cst.For) -> tuple[cst.BaseExpression, str | None, str | None] | None:
        """(cache, layer name, index name) of ``for L in C.layers``, ``for i, L in enumerate(C.layers)``, ``for i in range(len(C.layers))``."""
        it, target = node.iter, node.target
        if isinstance(it, cst.Subscript):  # C.layers[:k]
            it = it.value
        if isinstance(it, cst.Attribute) and it.attr.value == "layers" and isinstance(target, cst.Name):
            return (it.value, target.value, None) if self._cache_like(it.value) else None
        if isinstance(it, cst.Call) and it.args:
            inner, fname = it.args[0].value, dotted(it.func)
            if fname == "enumerate" and isinstance(inner, cst.Attribute) and inner.attr.value == "layers":
                if isinstance(target, cst.Tuple) and len(target.elements) == 2 and all(isinstance(e.value, cst.Name) for e in target.elements):
                    if self._cache_like(inner.value):
                        return inner.value, target.elements[1].value.value, target.elements[0].value.value
            if fname == "range" and len(it.args) == 1 and isinstance(inner, cst.Call) and dotted(inner.func) == "len" and inner.args:
                seq = inner.args[0].value
                # range(len(C.key_cache)): 4.x's layers, a loop to report once (never rewritten: _exact_trim reads .layers)
                if isinstance(seq, cst.Attribute) and seq.attr.value in ("layers", *LEGACY) and isinstance(target, cst.Name) \
                        and self._cache_like(seq.value):
                    return seq.value, None, target.value
        return None

    def _exact_trim(self, node: cst.For, cache: cst.BaseExpression, layer: str | None, index: str | None):
        """``n`` where the loop's whole body keeps the first ``n`` tokens of every layer's keys and values, else None."""
        if node.orelse is not None or node.asynchronous is not None or not isinstance(node.body, cst.IndentedBlock):
            return None
        if layer is None and not (isinstance(node.iter, cst.Call) and "layers" in code(node.iter)):
            return None
        spelled = layer if layer is not None else f"{code(cache)}.layers[{index}]"
        body = list(node.body.body)
        if body and self._guard(body[0], spelled, continues=True):
            body = body[1:]
        if len(body) == 1 and isinstance(body[0], cst.If) and self._guard(body[0], spelled, continues=False):
            body = list(body[0].body.body)
        seen: dict[str, str] = {}
        stop = None
        for stmt in body:
            if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)):
                return None
            assign = stmt.body[0]
            if len(assign.targets) != 1:
                return None
            t, value = assign.targets[0].target, assign.value
            if not (isinstance(t, cst.Attribute) and t.attr.value in KV and same(t.value, spelled)) or t.attr.value in seen:
                return None
            n = prefix_stop(value)
            if n is None or not (isinstance(value.value, cst.Attribute) and same(value.value, f"{spelled}.{t.attr.value}")):
                return None
            seen[t.attr.value] = code(n)
            stop = n
        loop_names = {layer, index} - {None}
        if set(seen) != set(KV) or len(set(seen.values())) != 1 or loop_names & set(names_in(stop)):
            return None
        return stop

    def _guard(self, stmt, spelled: str, continues: bool) -> bool:
        """``if not hasattr(layer, "keys"): continue`` (``continues``) or ``if hasattr(layer, "keys"):`` around the edits: a test
        that reads only the layer."""
        if not isinstance(stmt, cst.If) or stmt.orelse is not None:
            return False
        names = set(names_in(stmt.test))
        related = {n for n in names if n == spelled or n.startswith(spelled + ".") or spelled.startswith((n + ".", n + "["))}
        if not any(n == spelled or n.startswith(spelled + ".") for n in related) or names - related - _TEST_NAMES:
            return False
        if continues:
            body = stmt.body.body if isinstance(stmt.body, cst.IndentedBlock) else stmt.body.body
            return len(body) == 1 and isinstance(body[0], cst.SimpleStatementLine) and isinstance(body[0].body[0], cst.Continue)
        return isinstance(stmt.body, cst.IndentedBlock)

    def visit_For(self, node: cst.For) -> None:
        if self._skip:
            return
        tuple_alias = isinstance(node.target, cst.Name) and isinstance(node.iter, (cst.Tuple, cst.List))
        if tuple_alias:  # for store in (layer.keys, layer.values)
            caches = [self._keys_of(e.value) for e in node.iter.elements]
            if caches and all(c is not None for c in caches):
                self._aliases[-1][node.target.value] = caches[0]
        found = self._layer_loop(node)
        if found is None:
            return
        cache, layer, index = found
        if layer is not None:
            self._layers[-1][layer] = cache
        stop = self._exact_trim(node, cache, layer, index)
        if stop is not None and not (self._draft(cache) and self._bare(cache)):  # the draft's bare cache: fixed-upstream, below
            self.rewrite[node] = (cache, stop)
            self._skip += 1
            return
        self._loops.append([node, cache, None])

    def leave_For(self, original_node: cst.For, updated_node: cst.For) -> cst.BaseStatement:
        if original_node in self.rewrite:
            self._skip -= 1
            return self._rewrite(original_node, updated_node)
        if self._loops and self._loops[-1][0] is original_node:
            node, cache, first = self._loops.pop()
            if first is not None:
                self._report(node, cache, first, loop_head(node))
        return updated_node

    def _rewrite(self, original: cst.For, updated: cst.For) -> cst.BaseStatement:
        cache, stop = self.rewrite[original]
        flag = self._flag(original)
        if self._draft(cache):
            owner = "the draft's cache, built from a config"
            why = "a sliding-window layer keeps only its window, so a slice by position cuts the wrong tokens"
        else:
            owner, why = self._owner(cache), _HYBRID
        self.record(original, APPLIED, f"`{loop_head(original)}` cuts each layer's keys and values to `[..., :{code(stop)}, :]` by hand, "
                                       f"on {owner} -> `crop_cache({code(cache)}, {code(stop)})`: {why}; crop_cache cuts every layer by "
                                       f"its own rule and commits the recurrent state a recorded verify left{flag}")
        call = runtime_call(self, self.params["helper"], [cst.Arg(cache), cst.Arg(stop)])
        return cst.SimpleStatementLine(
            body=[cst.Expr(call)], leading_lines=updated.leading_lines,
            trailing_whitespace=cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(_MARK_TEXT)))

    # -- edits ------------------------------------------------------------------------------
    def visit_Assign(self, node: cst.Assign) -> None:
        if self._skip:
            return
        if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
            name = node.targets[0].target.value
            cache = self._keys_of(node.value)
            if cache is not None:
                self._aliases[-1][name] = cache
            layer = self._layer_of(node.value)
            if layer is not None:
                self._layers[-1][name] = layer
        for t in node.targets:
            self._target(t.target, node)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if not self._skip:
            self._target(node.target, node)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if not self._skip and node.value is not None:
            self._target(node.target, node)

    def _target(self, target: cst.BaseExpression, stmt: cst.CSTNode) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            for e in target.elements:
                self._target(e.value, stmt)
            return
        if self.state_target(target, stmt):
            return
        if isinstance(target, cst.Attribute) and target.attr.value in KV and self._layer_of(target.value) is not None:
            self._edit(stmt, self._layer_of(target.value), "kv", f"{code(target)} = ...")
        elif isinstance(target, cst.Subscript):
            hit = self._edited(target.value)
            if hit is not None:
                self._edit(stmt, hit[0], hit[1], f"{code(target)} = ...")

    def visit_Call(self, node: cst.Call) -> None:
        if self._skip:
            return
        func = node.func
        if is_runtime_call(node, self.params["helper"]):
            return
        if self.state_call(node):
            return
        if isinstance(func, cst.Attribute) and func.attr.value in BATCH:
            if self.function == func.attr.value:
                return  # a cache class handing the operation on to the caches it holds (transformers' EncoderDecoderCache)
            cache = func.value if self._cache_like(func.value) else self._layer_of(func.value)
            if cache is not None:
                self._edit(node, cache, "batch", code(node))
            return
        if in_place(node):
            hit = self._edited(func.value)
            if hit is not None:
                self._edit(node, hit[0], hit[1], code(node))
            return
        fn = self._fns[-1]
        callee = self.flow.resolve(fn, dotted(func)) if self.flow is not None and fn is not None else None
        if callee is not None:
            for param, arg in ModuleFlow.bind(callee, node, isinstance(func, cst.Attribute)):
                hit = self._edited(arg)
                if hit is not None and mutates(callee.node, param):
                    self._edit(node, hit[0], hit[1], code(node), f" (`{callee.name}` writes into its `{param}`)")
                    return

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        comment = node.trailing_whitespace.comment
        if comment is not None and comment.value.startswith(MARK) and len(node.body) == 1 and isinstance(node.body[0], cst.Expr):
            if is_runtime_call(node.body[0].value, self.params["helper"]):
                self.record(node.body[0].value, PATCHED, "the hand trim already goes through `crop_cache`")

    def _edit(self, node: cst.CSTNode, cache: cst.BaseExpression, kind: str, what: str, note: str = "") -> None:
        if self._loops and kind != "batch":
            if self._loops[-1][2] is None:
                self._loops[-1][2] = (kind, what, node, note)
            return
        self._report(node, cache, (kind, what, node, note), None)

    def _report(self, node: cst.CSTNode, cache: cst.BaseExpression, first: tuple, head: str | None) -> None:
        if id(node) in self._said:
            return
        self._said.add(id(node))
        kind, what, at, note = first
        flag = self._flag(at)
        where = f"`{head}`: " if head else ""
        said = f"`{what if len(what) <= 90 else what[:87] + '...'}`{note}"
        if self._draft(cache) and (self._bare(cache) or kind == "batch"):
            self.record(node, FIXED_UPSTREAM, f"{where}{said} edits the draft's cache by hand; built bare, it holds attention "
                                              f"layers only (no recurrent state), where that is exact{flag}")
            return
        if kind == "batch":
            method = what.split("(")[0].rsplit(".", 1)[-1]
            message = (f"{said} on {self._owner(cache)}: a hybrid's linear-attention layers have no `{method}` (AttributeError), "
                       f"and a layer that is both selects its attention rows only{flag}; run one sequence per call, or select each "
                       f"layer's `conv_states` and `recurrent_states` rows too")
        elif kind == "legacy":
            message = (f"{where}{said}: transformers 5.x caches have no `key_cache`/`value_cache`, and {_HYBRID}{flag}; {_WAY}")
        elif self._draft(cache):
            message = (f"{where}{said} edits the draft's cache by hand, and that cache is built from a config: a sliding-window "
                       f"layer keeps only its window, so a position is not an index{flag}; {_WAY}")
        else:
            message = f"{where}{said} edits {self._owner(cache)} by hand: {_HYBRID}{flag}; {_WAY}"
        self.record(node, NO_MATCH, message)

    # -- whose cache, and under which flag ----------------------------------------------------------
    def _draft(self, cache: cst.BaseExpression) -> bool:
        return is_role(self._roles(cache), DRAFT_CACHE)

    def _bare(self, cache: cst.BaseExpression) -> bool:
        """Built in this function by ``*Cache()`` with no arguments, every time it is assigned."""
        fn, name = self._fns[-1], dotted(cache)
        values = fn.assigns.get(name, []) if fn is not None and name else []
        return bool(values) and all(isinstance(v, cst.Call) and (dotted(v.func) or "").endswith("Cache") and not v.args for v in values)

    def _owner(self, cache: cst.BaseExpression) -> str:
        if is_role(self._roles(cache), TARGET_CACHE):
            return f"the target's cache `{code(cache)}`"
        return f"`{code(cache)}`, a cache whose owner data flow does not say (the target's, on a hybrid?)"

    def _flag(self, node: cst.CSTNode) -> str:
        """`` (only under `if trim_kv:` ...)`` where ``node`` runs only under an ``if`` of its function."""
        fn = self._fns[-1]
        for branch in reversed(self._ifs):
            inside = contains(branch.body, node)
            if not inside and not (branch.orelse is not None and contains(branch.orelse, node)):
                continue
            test = code(branch.test)
            said = f"`if {test}:`" if inside else f"the `else` of `if {test}:`"
            if fn is None:
                return f" (only under {said})"
            read = set(names_in(branch.test))
            names = {n for n in read if "." not in n} - {n.split(".")[0] for n in read if "." in n} - {"self", "cls"}
            for p in fn.node.params.params + fn.node.params.kwonly_params + fn.node.params.posonly_params:
                if p.name.value in names:
                    default = f", default `{code(p.default)}`" if p.default is not None else ""
                    return (f" (only under {said}: `{p.name.value}` is a parameter of `{fn.name}`{default}, so a run with its "
                            f"defaults never reaches this line)")
            return f" (only under {said})"
        return ""
