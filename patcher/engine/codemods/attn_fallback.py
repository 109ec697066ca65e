"""AttnFallback: use flash-attn when it is installed and sdpa when it is not.

Upstream benchmarks raise when ``flash_attn`` is missing and hard-code
``"flash_attention_2"`` for the draft. The raise becomes a warning, and each bare
``"flash_attention_2"`` given as an attention implementation becomes a choice made at
run time. A choice the user makes explicitly (``"flash_attention_2" if args.flash_attn
else "sdpa"``) is left alone.

Statuses and the evidence each rests on:

* ``applied`` -- a raise for a missing flash-attn became a warning, or a bare
  ``"flash_attention_2"`` became a run-time choice that falls back to sdpa.
* ``already-applied`` / ``fixed-upstream`` -- the choice already is made at run time with
  ``find_spec("flash_attn")`` (``already-applied`` with ddpatch's provenance line), or
  upstream picks sdpa itself unless flash-attn is asked for or present.
* ``no-match`` -- the anchor has neither.
"""

from __future__ import annotations

import ast
import json
import re

import libcst as cst
from libcst.codemod.visitors import AddImportsVisitor

from .base import APPLIED, FIXED_UPSTREAM, PATCHED, Example, Step, ast_dotted, ast_inside, ast_nodes, code, dotted


def _strings(node: cst.CSTNode, kind: type) -> list:
    found = []

    class _Collect(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            if isinstance(n, kind):
                found.append(n)
            return True

    node.visit(_Collect())
    return found


def _names(raised: ast.Raise, package: str) -> bool:
    return raised.exc is not None and any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and package in n.value for n in ast.walk(raised.exc)
    )


class AttnFallback(Step):
    ID = "attn-fallback"
    DESCRIPTION = "Fall back to sdpa when flash-attn is absent instead of raising or forcing flash_attention_2."
    TRIGGERS = ()
    PARAMS = {"package": "flash_attn", "implementation": "flash_attention_2", "fallback": "sdpa"}
    EXAMPLES = (
        Example(
            """
            if not installed_flash_attn:
                raise RuntimeError("flash_attn must be installed")
            draft_attn_implementation = "flash_attention_2"
            """,
            """
            import warnings
            import importlib.util

            if not installed_flash_attn:
                warnings.warn("flash_attn is not installed; ddpatch falls back to sdpa attention", stacklevel=1)
            draft_attn_implementation = ("flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa")
            """,
        ),
        Example(
            'impl = "flash_attention_2" if args.flash_attn else "sdpa"\n',
            'impl = "flash_attention_2" if args.flash_attn else "sdpa"\n',
            "an explicit user choice is kept",
        ),
    )

    @classmethod
    def triggers(cls, params) -> tuple[str, ...]:
        return (re.escape(params["implementation"]) + "|" + re.escape(params["package"]),)

    @classmethod
    def may_match(cls, tree: ast.Module, params) -> bool:
        # transformers names flash_attention_2 in hundreds of files; a site is one of four shapes
        impl, package = params["implementation"], params["package"]

        def is_impl(node: ast.expr) -> bool:
            return isinstance(node, ast.Constant) and node.value == impl

        for node in ast_nodes(tree, ast.keyword):
            if node.arg == "attn_implementation" and is_impl(node.value):
                return True
        for node in ast_nodes(tree, ast.Assign):
            if is_impl(node.value) and any(isinstance(t, ast.Name) and "attn_implementation" in t.id for t in node.targets):
                return True
        for node in ast_nodes(tree, ast.IfExp):
            if any(isinstance(c, ast.Call) and c.args and isinstance(c.args[0], ast.Constant) and c.args[0].value == package
                   for c in ast.walk(node.test)):
                return True  # may be a `find_spec("<package>")` choice already made
            fallback = isinstance(node.orelse, ast.Constant) and node.orelse.value == params["fallback"]
            if is_impl(node.body) and fallback and "flash" in ast.unparse(node.test).lower():
                return True  # upstream's own `"flash_attention_2" if <flash flag> else "sdpa"`
        raises = [r for r in ast_nodes(tree, ast.Raise) if _names(r, package)]
        for node in ast_nodes(tree, ast.If) if raises else ():
            test = node.test
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and "flash" in (ast_dotted(test.operand) or "").lower():
                if any(ast_inside(r, node) for r in raises):
                    return True
        return False

    @classmethod
    def looks_for(cls, params) -> str:
        return f"`\"{params['implementation']}\"` asked for, or {params['package']} required"

    def _choice(self) -> cst.BaseExpression:
        p = self.params
        AddImportsVisitor.add_needed_import(self.context, "importlib.util")
        return cst.parse_expression(
            f'("{p["implementation"]}" if importlib.util.find_spec("{p["package"]}") is not None else "{p["fallback"]}")'
        )

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self._ifs: list[cst.BaseExpression] = []

    def visit_If(self, node: cst.If) -> None:
        self._ifs.append(node.test)

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
        self._ifs.pop()
        return updated_node

    def _under_missing_package_check(self) -> bool:
        """Inside ``if not <flag naming the package>:``, the shape of upstream's hard requirement."""
        if not self._ifs:
            return False
        test = self._ifs[-1]
        if not (isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not)):
            return False
        flag = dotted(test.expression) or ""
        return "flash" in flag.lower()

    def _names_package(self, raised: cst.BaseExpression) -> bool:
        """Whether the error's message names the package; ``f"...{flash_attn_version}"`` names a variable."""
        texts = [n.evaluated_value for n in _strings(raised, cst.SimpleString)]
        texts += [n.value for n in _strings(raised, cst.FormattedStringText)]
        return any(isinstance(t, str) and self.params["package"] in t for t in texts)

    def _is_literal(self, node: cst.BaseExpression, param: str) -> bool:
        return isinstance(node, cst.SimpleString) and node.evaluated_value == self.params[param]

    def _is_impl_literal(self, node: cst.BaseExpression) -> bool:
        return self._is_literal(node, "implementation")

    def visit_IfExp(self, node: cst.IfExp) -> None:
        test = code(node.test)
        if f'find_spec("{self.params["package"]}")' in test:
            self.record(node, PATCHED, "attention implementation already chosen at run time")
        elif self._is_impl_literal(node.body) and "flash" in test.lower() and self._is_literal(node.orelse, "fallback"):
            self.record(node, FIXED_UPSTREAM, f"upstream already picks {self.params['fallback']} unless `{test}`")

    def leave_Assign(self, original_node: cst.Assign, updated_node: cst.Assign) -> cst.Assign:
        names = [t.target.value for t in original_node.targets if isinstance(t.target, cst.Name)]
        if self._is_impl_literal(original_node.value) and any("attn_implementation" in n for n in names):
            self.record(original_node, APPLIED, f"`{names[0]}` falls back to {self.params['fallback']}")
            return updated_node.with_changes(value=self._choice())
        return updated_node

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        if original_node.keyword is not None and original_node.keyword.value == "attn_implementation":
            if self._is_impl_literal(original_node.value):
                self.record(original_node, APPLIED, f"attn_implementation falls back to {self.params['fallback']}")
                return updated_node.with_changes(value=self._choice())
        return updated_node

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine):
        if len(original_node.body) != 1 or not isinstance(original_node.body[0], cst.Raise):
            return updated_node
        raised = original_node.body[0].exc
        if raised is None or not self._names_package(raised) or not self._under_missing_package_check():
            return updated_node
        AddImportsVisitor.add_needed_import(self.context, "warnings")
        message = f"{self.params['package']} is not installed; ddpatch falls back to {self.params['fallback']} attention"
        self.record(original_node, APPLIED, f"missing {self.params['package']} now warns instead of raising")
        warn = cst.parse_statement(f"warnings.warn({json.dumps(message)}, stacklevel=1)\n")
        return warn.with_changes(leading_lines=updated_node.leading_lines)

    def evidence(self, function: cst.FunctionDef) -> str | None:
        text = cst.Module(body=[function]).code
        if self.params["fallback"] in text and self.params["implementation"] in text:
            return f"`{function.name.value}` already chooses between {self.params['implementation']} and {self.params['fallback']}"
        if self.params["implementation"] not in text and self.params["package"] not in text:
            return f"`{function.name.value}` no longer mentions {self.params['implementation']}"
        return None
