"""UseAccessor: replace a reach into a model's internals with the model's public accessor.

``X.model.embed_tokens`` assumes the text model sits at ``X.model``; in
``Qwen3_5ForConditionalGeneration`` it is nested (``X.model.language_model``), and the
attribute access raises AttributeError. ``X.get_input_embeddings()`` is right in every
layout. ``lm_head`` is top-level in both Qwen3.5 layouts, so it is left alone.

Statuses and the evidence each rests on:

* ``applied`` -- ``X.model.embed_tokens`` (X not the model's own ``self``) became
  ``X.get_input_embeddings()``; an attribute chain split over lines is the same chain.
* ``already-applied`` / ``fixed-upstream`` -- ``X.get_input_embeddings()`` is called
  (``already-applied`` with ddpatch's provenance line), or through ``getattr(X, "get_input_embeddings")()``
  (the same method, the same object in every layout), or upstream reaches the
  embeddings as ``X.model.language_model.embed_tokens``; in the anchor or in a function of
  the tree it calls (an ``_embed(target, ids)`` helper: the engine follows the call).
* ``fixed-upstream`` too -- a helper that asks the accessor first and falls back to attributes only when it
  gives nothing: ``get = getattr(X, "get_input_embeddings", None)`` then ``get()`` (the same method), and a
  reach into the model's internals only where that result is None (``if emb is None: emb = X.model.embed_tokens``,
  ``X.get_input_embeddings() or X.model.embed_tokens``): every transformers model answers the accessor, so the
  fallback never runs, and it is left as it is.
* ``no-match`` -- none of these in the anchor or what it calls; the message names the form
  the anchor does reach the embeddings with, if any (``near_miss``).
"""

from __future__ import annotations

import re

import libcst as cst

from .base import APPLIED, FIXED_UPSTREAM, PATCHED, Example, Step, code, cst_nodes, dotted


class UseAccessor(Step):
    ID = "use-accessor"
    DESCRIPTION = "Replace `X.<path>` (e.g. X.model.embed_tokens) with `X.<accessor>()` (e.g. X.get_input_embeddings())."
    TRIGGERS = ()
    PARAMS = {
        "path": "model.embed_tokens",
        "accessor": "get_input_embeddings",
        # Other spellings showing that upstream already reaches the object another way.
        "fixed_forms": ["language_model.embed_tokens"],
        # A model's own methods reach into itself legitimately (and `get_input_embeddings`
        # is usually implemented as `return self.model.embed_tokens`).
        "skip_receivers": ["self", "cls"],
    }
    EXAMPLES = (
        Example(
            "noise = target.model.embed_tokens(block_ids)\n",
            "noise = target.get_input_embeddings()(block_ids)\n",
            "works for the nested ForConditionalGeneration layout too",
        ),
        Example("logits = target.lm_head(hidden)\n", "logits = target.lm_head(hidden)\n", "lm_head is top-level everywhere"),
        Example(
            "self.model.embed_tokens = nn.Embedding(4, 4)\n",
            "self.model.embed_tokens = nn.Embedding(4, 4)\n",
            "an assignment to the attribute is a definition, not a use",
        ),
    )

    @classmethod
    def looks_for(cls, params) -> str:
        return f"a read of a model's `{params['path']}`"

    @classmethod
    def triggers(cls, params) -> tuple[str, ...]:
        # `self.model.embed_tokens` is in every transformers model: a skipped receiver right
        # before the dot does not trigger (`x.self.model...` and `(self).model...` still do)
        skip = "".join(rf"(?<![^\w.]{re.escape(r)})" for r in params["skip_receivers"])
        # an attribute chain may be split over lines inside parentheses: `(target\n    .model\n    .embed_tokens)`
        def chain(dotted_path: str) -> str:
            return r"\s*\.\s*".join(re.escape(part) for part in dotted_path.split("."))

        forms = [chain(params["path"]) + r"\b", re.escape(params["accessor"]) + r"\s*\(\s*\)"]
        forms += [chain(f) + r"\b" for f in params["fixed_forms"]]
        words = dict.fromkeys(f.rsplit(".", 1)[-1] for f in [params["path"], params["accessor"], *params["fixed_forms"]])
        via_getattr = r"getattr\([^)]*[\"']" + re.escape(params["accessor"]) + r"[\"']"  # getattr(X, "get_input_embeddings")
        return ("|".join(re.escape(w) for w in words), skip + r"\.\s*(?:" + "|".join(forms) + ")|" + via_getattr)

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self.parts = self.params["path"].split(".")
        self._store_depth = 0
        self._outer: list[set[str]] = []
        self._methods: set[str] = set()  # locals holding the accessor method (`get = getattr(X, "get_input_embeddings", None)`)
        self._fallback: set[int] = set()  # ids of the attributes that run only when the accessor gave nothing

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self._outer.append(self._methods)
        self._methods, bound = set(), set()
        # one walk of the body for every kind the reading needs (a walk per kind cost a third of a scan of transformers)
        found: dict[type, list] = {cst.Assign: [], cst.If: [], cst.BooleanOperation: [], cst.IfExp: []}
        for n in cst_nodes(node.body, *found):
            found[type(n)].append(n)
        assigns = [(dotted(t.target), stmt.value) for stmt in found[cst.Assign] for t in stmt.targets]
        for name, value in assigns:
            if name and self._method(value):
                self._methods.add(name)
        for name, value in assigns:
            if name and self._asks(value, bound):
                bound.add(name)
        for root in self._fallbacks(found, bound):
            self._fallback |= {id(a) for a in cst_nodes(root, cst.Attribute)}
        return super().visit_FunctionDef(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.CSTNode:
        self._methods = self._outer.pop()
        return super().leave_FunctionDef(original_node, updated_node)

    def _method(self, value: cst.BaseExpression) -> bool:
        """``getattr(X, "<accessor>"[, default])`` or ``X.<accessor>``: the method itself, not yet called."""
        if isinstance(value, cst.Attribute):
            return value.attr.value == self.params["accessor"] and dotted(value.value) not in self.params["skip_receivers"]
        return self._getattr_accessor(value, defaults=True) is not None

    def _asks(self, value: cst.BaseExpression, bound: set[str]) -> bool:
        """Whether ``value`` is what the accessor returns (or a choice whose first answer is)."""
        if isinstance(value, cst.Call) and not value.args:
            func = value.func
            if dotted(func) in self._methods or self._getattr_accessor(func) is not None:
                return True
            return isinstance(func, cst.Attribute) and func.attr.value == self.params["accessor"]
        if isinstance(value, cst.IfExp):
            return self._asks(value.body, bound)
        if isinstance(value, cst.BooleanOperation) and isinstance(value.operator, cst.Or):
            return self._asks(value.left, bound)
        return dotted(value) in bound

    def _fallbacks(self, found: dict[type, list], bound: set[str]) -> list[cst.CSTNode]:
        """The parts of a body (``found``: its nodes by kind) that run only when the accessor's answer (a name in
        ``bound``) is None."""
        out: list[cst.CSTNode] = []
        for node in found[cst.If]:
            nothing = _none_test(node.test, bound)
            if nothing is True:
                out.append(node.body)
            elif nothing is False and node.orelse is not None:
                out.append(node.orelse)
        for node in found[cst.BooleanOperation]:
            if isinstance(node.operator, cst.Or) and self._asks(node.left, bound):
                out.append(node.right)
        for node in found[cst.IfExp]:
            nothing = _none_test(node.test, bound)
            checks = self.params["accessor"] in code(node.test) or any(n in self._methods for n in _names(node.test))
            if nothing is True:
                out.append(node.body)
            elif nothing is False or checks and self._asks(node.body, bound):
                out.append(node.orelse)
        return out

    def _receiver(self, node: cst.Attribute) -> cst.BaseExpression | None:
        """``X`` when ``node`` is ``X.<path>`` and X is not the model itself."""
        current: cst.BaseExpression = node
        for part in reversed(self.parts):
            if not isinstance(current, cst.Attribute) or current.attr.value != part:
                return None
            current = current.value
        if dotted(current) in self.params["skip_receivers"]:
            return None
        return current

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._store_depth += 1

    def leave_AssignTarget(self, original_node: cst.AssignTarget, updated_node: cst.AssignTarget) -> cst.AssignTarget:
        self._store_depth -= 1
        return updated_node

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if dotted(func) in self._methods and not node.args:
            self.record(node, FIXED_UPSTREAM, f"upstream calls `{self.params['accessor']}` through `{dotted(func)}`")
        if isinstance(func, cst.Attribute) and func.attr.value == self.params["accessor"] and not node.args:
            if dotted(func.value) in self.params["skip_receivers"]:
                return
            self.record(node, PATCHED, f"`{dotted(node.func) or self.params['accessor']}()` already used")
        receiver = self._getattr_accessor(func) if not node.args else None
        if receiver is not None:
            self.record(node, FIXED_UPSTREAM, f"upstream calls it through `getattr({receiver}, \"{self.params['accessor']}\")()`")

    def _getattr_accessor(self, func: cst.BaseExpression, defaults: bool = True) -> str | None:
        """``X`` when ``func`` is ``getattr(X, "<accessor>")`` (with or without a default)."""
        if not (isinstance(func, cst.Call) and dotted(func.func) == "getattr" and len(func.args) in ((2, 3) if defaults else (2,))):
            return None
        name = func.args[1].value
        if not (isinstance(name, cst.SimpleString) and name.evaluated_value == self.params["accessor"]):
            return None
        receiver = dotted(func.args[0].value)
        return None if receiver is None or receiver in self.params["skip_receivers"] else receiver

    def visit_Attribute(self, node: cst.Attribute) -> None:
        text = dotted(node) or ""
        for form in self.params["fixed_forms"]:
            if text.endswith("." + form) and text[: -len(form) - 1] not in self.params["skip_receivers"]:
                self.record(node, FIXED_UPSTREAM, f"upstream reaches it as `{text}`")

    @classmethod
    def near_miss(cls, text: str, function: str, params: dict) -> str | None:
        """The form an anchor with no site reaches the embeddings with, if any: named in its no-match."""
        import ast

        word = params["path"].rsplit(".", 1)[-1]
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            return None
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == function:
                for node in ast.walk(fn):
                    via_getattr = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and any(
                        isinstance(a, ast.Constant) and a.value == word for a in node.args)
                    if via_getattr or isinstance(node, ast.Attribute) and node.attr == word:
                        seen = ast.unparse(node)
                        return (f"it reaches the embeddings as `{seen}` (line {node.lineno}), a form this step neither rewrites "
                                f"nor trusts in every layout: use `X.{params['accessor']}()`")
        return None

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        if self._store_depth:
            return updated_node
        receiver = self._receiver(updated_node)
        if receiver is None:
            return updated_node
        if id(original_node) in self._fallback:
            self.record(original_node, FIXED_UPSTREAM, f"`{dotted(original_node)}` runs only when `{self.params['accessor']}()` "
                                                       "gave nothing (every transformers model answers it, so the fallback does not run): left as it is")
            return updated_node
        accessor = cst.Call(func=cst.Attribute(value=receiver, attr=cst.Name(self.params["accessor"])))
        self.record(original_node, APPLIED, f"`{dotted(original_node) or self.params['path']}` -> `.{self.params['accessor']}()`")
        return accessor



def _none_test(test: cst.BaseExpression, bound: set[str]) -> bool | None:
    """True for ``v is None`` / ``not v``, False for ``v is not None`` / ``v``, with ``v`` in ``bound``; else None."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not) and dotted(test.expression) in bound:
        return True
    if dotted(test) in bound:
        return False
    if isinstance(test, cst.Comparison) and dotted(test.left) in bound and len(test.comparisons) == 1:
        target = test.comparisons[0]
        if dotted(target.comparator) == "None":
            return True if isinstance(target.operator, cst.Is) else False if isinstance(target.operator, cst.IsNot) else None
    return None


def _names(node: cst.CSTNode) -> list[str]:
    return [n.value for n in cst_nodes(node, cst.Name)]
