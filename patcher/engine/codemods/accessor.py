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
* ``no-match`` -- none of these in the anchor or what it calls; the message names the form
  the anchor does reach the embeddings with, if any (``near_miss``).
"""

from __future__ import annotations

import re

import libcst as cst

from .base import APPLIED, FIXED_UPSTREAM, PATCHED, Example, Step, dotted


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
        if isinstance(func, cst.Attribute) and func.attr.value == self.params["accessor"] and not node.args:
            if dotted(func.value) in self.params["skip_receivers"]:
                return
            self.record(node, PATCHED, f"`{dotted(node.func) or self.params['accessor']}()` already used")
        receiver = self._getattr_accessor(func) if not node.args else None
        if receiver is not None:
            self.record(node, FIXED_UPSTREAM, f"upstream calls it through `getattr({receiver}, \"{self.params['accessor']}\")()`")

    def _getattr_accessor(self, func: cst.BaseExpression) -> str | None:
        """``X`` when ``func`` is ``getattr(X, "<accessor>")`` (with or without a default)."""
        if not (isinstance(func, cst.Call) and dotted(func.func) == "getattr" and len(func.args) in (2, 3)):
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
        accessor = cst.Call(func=cst.Attribute(value=receiver, attr=cst.Name(self.params["accessor"])))
        self.record(original_node, APPLIED, f"`{dotted(original_node) or self.params['path']}` -> `.{self.params['accessor']}()`")
        return accessor

