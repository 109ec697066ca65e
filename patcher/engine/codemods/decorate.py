"""DecorateFunction: wrap an upstream function with a runtime decorator bound to its parameters.

DDTree's ``compact_dynamic_cache(past_key_values, past_length, keep_current_indices)``
compacts only layers that have keys, so the Gated DeltaNet state keeps every tree node.
Decorating it with ``_ddpatch_runtime.tree_commit("past_key_values", "past_length",
"keep_current_indices")`` commits the recurrent layers to the accepted path first and
then lets upstream compact the attention layers as before. The decorator's arguments
are the function's own parameter names, read from its signature.

Statuses and the evidence each rests on:

* ``applied`` -- the function now carries ``@_ddpatch_runtime.<decorator>(...)`` bound to
  its first parameters.
* ``already-applied`` / ``fixed-upstream`` -- the decorator is already there
  (``already-applied`` with ddpatch's provenance line).
* ``no-match`` -- the function is gone or has fewer parameters than the decorator binds.
"""

from __future__ import annotations

import json
import re

import libcst as cst

from .base import APPLIED, PATCHED, RUNTIME_MODULE, Example, Step, dotted


class DecorateFunction(Step):
    ID = "decorate-function"
    DESCRIPTION = "Decorate a named function with a runtime helper bound to its first parameters."
    TRIGGERS = ()
    PARAMS = {"function": "compact_dynamic_cache", "decorator": "tree_commit", "bind": 3}
    USES_RUNTIME = True
    EXAMPLES = (
        Example(
            """
            def compact_dynamic_cache(past_key_values, past_length, keep_current_indices):
                ...
            """,
            """
            import _ddpatch_runtime

            @_ddpatch_runtime.tree_commit("past_key_values", "past_length", "keep_current_indices")
            def compact_dynamic_cache(past_key_values, past_length, keep_current_indices):
                ...
            """,
        ),
    )

    @classmethod
    def triggers(cls, params) -> tuple[str, ...]:
        return (re.escape(params["function"]), r"\bdef\s+" + re.escape(params["function"]) + r"\b")

    def _has_decorator(self, node: cst.FunctionDef) -> bool:
        wanted = f"{RUNTIME_MODULE}.{self.params['decorator']}"
        for d in node.decorators:
            expr = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
            if dotted(expr) == wanted:
                return True
        return False

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef):
        if original_node.name.value != self.params["function"]:
            return super().leave_FunctionDef(original_node, updated_node)
        if self._has_decorator(original_node):
            self.record(original_node, PATCHED, f"`{self.params['decorator']}` already applied", function=original_node.name.value)
            return super().leave_FunctionDef(original_node, updated_node)
        params = [p.name.value for p in original_node.params.posonly_params + original_node.params.params]
        n = int(self.params["bind"])
        if len(params) < n:
            return super().leave_FunctionDef(original_node, updated_node)
        args = ", ".join(json.dumps(p) for p in params[:n])
        decorator = cst.Decorator(decorator=cst.parse_expression(f"{self.runtime().value}.{self.params['decorator']}({args})"))
        self.record(
            original_node,
            APPLIED,
            f"`{original_node.name.value}` decorated with `{self.params['decorator']}({args})`",
            function=original_node.name.value,
        )
        return super().leave_FunctionDef(original_node, updated_node.with_changes(decorators=[decorator, *updated_node.decorators]))
