"""CropCompat: route legacy ``cache.crop(n)`` through a helper that works on every transformers.

Upstream was written for transformers 4.x, where ``crop(n)`` with ``n >= 0`` meant "keep
the first n tokens". On 5.x that raises ValueError for every model: crop now takes a
negative count of tokens to drop, and on linear-attention layers it raises unless past
recording is on. ``_ddpatch_runtime.crop_cache(cache, n)`` keeps the legacy meaning on
both, and (once a verify was recorded) rolls the Gated DeltaNet state back exactly.

Only receivers that are caches by data flow are rewritten: a name assigned from a
``*Cache(...)`` call, passed as ``past_key_values=``, or a parameter annotated as a
cache or named ``past_key_values``. ``image.crop(box)`` is left alone.
"""

from __future__ import annotations

import libcst as cst

from .base import APPLIED, FIXED_UPSTREAM, PATCHED, Example, Step, dotted, is_runtime_call, keyword, runtime_call


def cache_names(function: cst.FunctionDef) -> set[str]:
    """Names that hold a KV cache inside ``function``."""
    names: set[str] = set()
    for param in function.params.params + function.params.kwonly_params + function.params.posonly_params:
        annotation = dotted(param.annotation.annotation) if param.annotation else None
        if param.name.value.startswith("past_key_values") or (annotation or "").endswith("Cache"):
            names.add(param.name.value)

    class _Collect(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            if isinstance(node.value, cst.Call) and (dotted(node.value.func) or "").endswith("Cache"):
                for target in node.targets:
                    if isinstance(target.target, cst.Name):
                        names.add(target.target.value)

        def visit_Call(self, node: cst.Call) -> None:
            arg = keyword(node, "past_key_values")
            if arg is not None and isinstance(arg.value, cst.Name):
                names.add(arg.value.value)

    function.body.visit(_Collect())
    return names


class CropCompat(Step):
    ID = "crop-compat"
    DESCRIPTION = "Rewrite `cache.crop(n)` to `_ddpatch_runtime.crop_cache(cache, n)`, legacy crop semantics on any transformers."
    TRIGGERS = ("crop", r"\.crop\(|crop_cache\(")
    PARAMS = {"helper": "crop_cache"}
    USES_RUNTIME = True
    EXAMPLES = (
        Example(
            """
            def step(target, ids, start):
                cache = DynamicCache()
                target(ids, past_key_values=cache)
                cache.crop(start)
            """,
            """
            import _ddpatch_runtime

            def step(target, ids, start):
                cache = DynamicCache()
                target(ids, past_key_values=cache)
                _ddpatch_runtime.crop_cache(cache, start)
            """,
            "a positive crop keeps its 4.x meaning on 5.x",
        ),
        Example(
            "def thumbnail(image, box):\n    return image.crop(box)\n",
            "def thumbnail(image, box):\n    return image.crop(box)\n",
            "not a cache: left alone",
        ),
    )

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self._caches: list[set[str]] = [set()]

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self._caches.append(cache_names(node))
        return super().visit_FunctionDef(node)

    def leave_FunctionDef(self, original_node, updated_node):
        self._caches.pop()
        return super().leave_FunctionDef(original_node, updated_node)

    def _crop_receiver(self, node: cst.Call) -> str | None:
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value == "crop" and isinstance(func.value, cst.Name):
            if func.value.value in self._caches[-1] and len(node.args) == 1 and node.args[0].keyword is None:
                return func.value.value
        return None

    def visit_Call(self, node: cst.Call) -> None:
        if is_runtime_call(node, self.params["helper"]):
            self.record(node, PATCHED, "crop already goes through the runtime helper")
            return
        name = dotted(node.func) or ""
        if self._crop_receiver(node) and isinstance(node.args[0].value, cst.UnaryOperation):
            if isinstance(node.args[0].value.operator, cst.Minus):
                self.record(node, FIXED_UPSTREAM, "crop already takes a negative count (5.x semantics)")
        elif "crop" in name.split(".")[-1].lower() and name.split(".")[-1] != "crop" and node.args:
            first = node.args[0].value
            if isinstance(first, cst.Name) and first.value in self._caches[-1]:
                self.record(node, FIXED_UPSTREAM, f"crop goes through upstream's own `{name}`")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        receiver = self._crop_receiver(original_node)
        if receiver is None:
            return updated_node
        value = original_node.args[0].value
        if isinstance(value, cst.UnaryOperation) and isinstance(value.operator, cst.Minus):
            return updated_node
        self.record(original_node, APPLIED, f"`{receiver}.crop(...)` -> `crop_cache({receiver}, ...)`")
        return runtime_call(self, self.params["helper"], [cst.Arg(cst.Name(receiver)), updated_node.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)])
