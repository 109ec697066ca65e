"""WrapCall: route a model call through a runtime helper that takes the model first.

Speculative verification calls the target with its cache inside the decode loop. On a
hybrid target those calls must record what a later commit needs (the Gated DeltaNet
state before the verify and the inputs of each GDN layer) and, for a tree, run the
recurrent layers per root-to-leaf path. ``target(ids, past_key_values=cache, ...)``
inside a loop becomes ``_ddpatch_runtime.verify_forward(target, ids, past_key_values=cache, ...)``.
The prefill call, outside the loop, is left as it is.
"""

from __future__ import annotations

import ast
import re

import libcst as cst

from .base import APPLIED, PATCHED, RUNTIME_MODULE, Example, Step, ast_calls, ast_dotted, ast_inside, ast_nodes, dotted, is_runtime_call, keyword, runtime_call


class WrapCall(Step):
    ID = "wrap-call"
    DESCRIPTION = "Route `target(..., past_key_values=...)` calls inside decode loops through `_ddpatch_runtime.verify_forward`."
    TRIGGERS = ()
    PARAMS = {"callees": ["target"], "helper": "verify_forward", "keyword": "past_key_values", "in_loop": True}
    USES_RUNTIME = True
    EXAMPLES = (
        Example(
            """
            def generate(target, ids, cache):
                target(ids, past_key_values=cache)
                while True:
                    out = target(ids, past_key_values=cache, use_cache=True)
            """,
            """
            import _ddpatch_runtime

            def generate(target, ids, cache):
                target(ids, past_key_values=cache)
                while True:
                    out = _ddpatch_runtime.verify_forward(target, ids, past_key_values=cache, use_cache=True)
            """,
            "the prefill outside the loop is not a verify",
        ),
    )

    @classmethod
    def triggers(cls, params) -> tuple[str, ...]:
        callees = "|".join(re.escape(c) for c in params["callees"])
        return (re.escape(params["keyword"]), rf"(?:{callees})\s*\(|{re.escape(params['helper'])}\(")  # ast decides

    @classmethod
    def may_match(cls, tree: ast.Module, params) -> bool:
        # `model(..., past_key_values=...)` is in every transformers model's forward; only a
        # call inside a loop is a verify
        helper = f"{RUNTIME_MODULE}.{params['helper']}"
        calls = ast_calls(tree)
        if any(ast_dotted(call.func) == helper for call in calls):
            return True
        wanted = []
        for call in calls:
            name = ast_dotted(call.func) or ""
            if any(name == c or name.endswith("." + c) for c in params["callees"]) and any(k.arg == params["keyword"] for k in call.keywords):
                wanted.append(call)
        if not wanted or not params["in_loop"]:
            return bool(wanted)
        loops = ast_nodes(tree, ast.For, ast.AsyncFor, ast.While)
        return any(ast_inside(call, loop) for call in wanted for loop in loops)

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self._loops = [0]

    def visit_FunctionDef(self, node):
        self._loops.append(0)
        return super().visit_FunctionDef(node)

    def leave_FunctionDef(self, original_node, updated_node):
        self._loops.pop()
        return super().leave_FunctionDef(original_node, updated_node)

    def visit_While(self, node: cst.While) -> None:
        self._loops[-1] += 1

    def leave_While(self, original_node, updated_node):
        self._loops[-1] -= 1
        return updated_node

    def visit_For(self, node: cst.For) -> None:
        self._loops[-1] += 1

    def leave_For(self, original_node, updated_node):
        self._loops[-1] -= 1
        return updated_node

    def _callee(self, node: cst.Call) -> str | None:
        name = dotted(node.func)
        if name is None or keyword(node, self.params["keyword"]) is None:
            return None
        if not any(name == c or name.endswith("." + c) for c in self.params["callees"]):
            return None
        if self.params["in_loop"] and not self._loops[-1]:
            return None
        return name

    def visit_Call(self, node: cst.Call) -> None:
        if is_runtime_call(node, self.params["helper"]):
            self.record(node, PATCHED, f"call already goes through `{self.params['helper']}`")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        callee = self._callee(original_node)
        if callee is None:
            return updated_node
        self.record(original_node, APPLIED, f"`{callee}(...)` in the decode loop -> `{self.params['helper']}({callee}, ...)`")
        first = cst.Arg(updated_node.func)
        comma = updated_node.args[0].comma if updated_node.args else cst.MaybeSentinel.DEFAULT
        if isinstance(comma, cst.Comma):
            first = first.with_changes(comma=comma)  # keep one argument per line in a multi-line call
        return runtime_call(self, self.params["helper"], [first, *updated_node.args]).with_changes(
            whitespace_before_args=updated_node.whitespace_before_args
        )
