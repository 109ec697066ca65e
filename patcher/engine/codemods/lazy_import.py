"""LazyImport: move a module-level import of an optional package into the functions that use it.

DDTree imports ``datasets`` at the top of ``model/utils.py`` although only the dataset
loader uses it, so importing the generation code fails without ``datasets``. The import
statement moves, unchanged, to the top of each function that uses one of its names.
An import that module-level code also uses is left where it is.

Statuses and the evidence each rests on:

* ``applied`` -- the module-level import moved into each function that uses it.
* ``already-applied`` / ``fixed-upstream`` -- the import is already at the top of a
  function body (``already-applied`` with ddpatch's provenance line).
* ``no-match`` -- the anchor has no such import, or module-level code uses it.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict

import libcst as cst

from .base import APPLIED, PATCHED, Example, Step, ast_nodes, dotted


def _module_of(node: cst.Import | cst.ImportFrom) -> list[str]:
    if isinstance(node, cst.ImportFrom):
        return [dotted(node.module) or ""] if node.module is not None and not node.relative else []
    return [dotted(alias.name) or "" for alias in node.names]


def _bound_names(node: cst.Import | cst.ImportFrom) -> set[str]:
    if isinstance(node.names, cst.ImportStar):
        return set()
    out = set()
    for alias in node.names:
        if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
            out.add(alias.asname.name.value)
        else:
            out.add((dotted(alias.name) or "").split(".")[0])
    return out


class _Uses(cst.CSTVisitor):
    """Which functions (innermost ``def``; None for module level) use which names."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names
        self.stack: list[cst.FunctionDef | None] = [None]
        self.uses: dict[cst.FunctionDef | None, set[str]] = defaultdict(set)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        # decorators, defaults and annotations run when the def runs, in the enclosing scope
        for decorator in node.decorators:
            decorator.visit(self)
        node.params.visit(self)
        if node.returns is not None:
            node.returns.visit(self)
        self.stack.append(node)
        node.body.visit(self)
        self.stack.pop()
        return False

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Name(self, node: cst.Name) -> None:
        if node.value in self.names:
            self.uses[self.stack[-1]].add(node.value)


def _insert_at_top(body: cst.IndentedBlock, statement: cst.SimpleStatementLine) -> cst.IndentedBlock:
    stmts = list(body.body)
    at = 0
    if stmts and isinstance(stmts[0], cst.SimpleStatementLine) and isinstance(stmts[0].body[0], cst.Expr):
        if isinstance(stmts[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
            at = 1  # keep the docstring first
    stmts.insert(at, statement.with_changes(leading_lines=[]))
    return body.with_changes(body=stmts)


class LazyImport(Step):
    ID = "lazy-import"
    DESCRIPTION = "Move a module-level import of an optional package into the functions that use it."
    TRIGGERS = ()
    PARAMS = {"modules": ["datasets"]}
    EXAMPLES = (
        Example(
            """
            import torch
            from datasets import load_dataset

            def load(name):
                return load_dataset(name)
            """,
            """
            import torch

            def load(name):
                from datasets import load_dataset
                return load_dataset(name)
            """,
        ),
        Example(
            "from datasets import Dataset\nEMPTY = Dataset.from_dict({})\n",
            "from datasets import Dataset\nEMPTY = Dataset.from_dict({})\n",
            "module-level code uses it: it must stay",
        ),
    )

    @classmethod
    def triggers(cls, params) -> tuple[str, ...]:
        # an import statement of the module, not the word: `datasets` is in many docstrings
        names = "|".join(re.escape(m) for m in params["modules"])
        return (names, rf"\bfrom[\s\\]+(?:{names})\b|\bimport\s(?:[^\n;]|\\\n)*\b(?:{names})\b")

    @classmethod
    def may_match(cls, tree: ast.Module, params) -> bool:
        # a module-level import moves; one at the top of a function body is already moved
        def optional(node: ast.stmt) -> bool:
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""] if not node.level else []
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                return False
            return any(m == w or m.startswith(w + ".") for m in modules for w in params["modules"])

        bodies = [tree.body] + [n.body for n in ast_nodes(tree, ast.FunctionDef, ast.AsyncFunctionDef)]
        return any(optional(stmt) for body in bodies for stmt in body)

    @classmethod
    def looks_for(cls, params) -> str:
        return f"an import of {' or '.join(params['modules'])} at module level"

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self._moves: dict[cst.SimpleStatementLine, list[cst.FunctionDef]] = {}
        self._targets: dict[cst.FunctionDef, list[cst.SimpleStatementLine]] = defaultdict(list)

    def _optional(self, node: cst.CSTNode) -> bool:
        wanted = self.params["modules"]
        return isinstance(node, (cst.Import, cst.ImportFrom)) and any(
            m == w or m.startswith(w + ".") for m in _module_of(node) for w in wanted
        )

    def visit_Module(self, node: cst.Module) -> bool:
        for stmt in node.body:
            if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1 or not self._optional(stmt.body[0]):
                continue
            names = _bound_names(stmt.body[0])
            uses = _Uses(names)
            node.visit(uses)
            if not names or None in uses.uses or not uses.uses:
                continue
            self._moves[stmt] = list(uses.uses)
            for fn in uses.uses:
                self._targets[fn].append(stmt)
        return True

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        for stmt in node.body.body:
            if isinstance(stmt, cst.SimpleStatementLine) and any(self._optional(s) for s in stmt.body):
                self.record(stmt, PATCHED, "optional import already inside the function", function=node.name.value)
        return super().visit_FunctionDef(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef):
        for stmt in self._targets.get(original_node, []):
            updated_node = updated_node.with_changes(body=_insert_at_top(updated_node.body, stmt))
        return super().leave_FunctionDef(original_node, updated_node)

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine):
        functions = self._moves.get(original_node)
        if functions is None:
            return updated_node
        for fn in functions:
            self.record(original_node, APPLIED, f"import moved into `{fn.name.value}`", function=fn.name.value)
        return cst.RemoveFromParent()
