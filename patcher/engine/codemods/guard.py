"""GuardCall: run a device-only call only when the device exists.

``torch.cuda.synchronize()`` inside a timing helper, ``torch.cuda.set_device(...)`` at start-up, or
``torch.cuda.reset_peak_memory_stats()`` before a timed region raises on a machine without CUDA; the verifier
runs on CPU. The statement is wrapped in ``if torch.cuda.is_available():``. Calls are matched by qualified
name, so ``from torch import cuda; cuda.synchronize()`` is found too. (Reading the statistics,
``torch.cuda.max_memory_allocated()`` and its kin, gives 0 without CUDA and needs no guard.)

A CUDA event used for timing (``torch.cuda.Event(enable_timing=True)``, then ``.record()``,
``.elapsed_time(...)``) is a value, not a statement: the code goes on using it. Its constructor goes through
``_ddpatch_runtime.cuda_event(...)``, which returns the same ``torch.cuda.Event`` where CUDA is available (a GPU
run times itself as before) and a wall-clock stand-in with the same methods where it is not. Where the module
keeps torch lazy, the runtime (which imports torch) is imported right before the statement, not at module level.

The guard imports nothing at module level that the module did not already import there:
a module that keeps torch lazy (DFlash's ``benchmark.py`` imports it inside
``_run_transformers``, so that its sglang, vLLM and MLX clients load without torch, and
upstream's own ``tests/test_package.py`` checks that) stays lazy. The guard is spelled
through the call's own receiver (``torch.cuda.set_device(...)`` after a local ``import
torch`` is guarded by that same ``torch``; ``cuda.synchronize()`` by ``cuda.is_available()``),
so it resolves where the call resolves. Only a call with no such receiver (``from
torch.cuda import synchronize``) needs ``import torch``: at module level where the module
already imports torch there unconditionally, otherwise right before the guard.

Statuses and the evidence each rests on:

* ``applied`` -- the statement calling a listed function (by qualified name) is now inside
  ``if torch.cuda.is_available():`` (spelled through the call's receiver, as above).
* ``already-applied`` / ``fixed-upstream`` -- it already is inside that exact guard, in either
  spelling (``already-applied`` with ddpatch's provenance line); ``fixed-upstream`` also for a
  statement inside another ``if`` that tests CUDA or the device, for a call in a
  conditional expression or an ``and`` whose test does (``sync() if torch.cuda.is_available() else None``),
  for one inside a ``try`` whose handler catches what it raises without CUDA (``except Exception``,
  or both ``RuntimeError`` and ``AssertionError``: a CPU build raises the second, a CUDA build
  without a device the first), and for an anchor that no longer calls any listed function (``evidence``).
* ``applied`` too -- ``torch.cuda.Event(...)`` became ``_ddpatch_runtime.cuda_event(...)`` (``already-applied``
  once it is).
* ``no-match`` -- an anchor that still names a listed call the step does not match; a call in a
  conditional expression whose test does not check the device (the site says which); an event built in a
  compound statement's header of a module that keeps torch lazy (no place to import the runtime there).
"""

from __future__ import annotations

import ast
import re

import libcst as cst
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider, QualifiedNameProvider

from .base import (APPLIED, FIXED_UPSTREAM, NO_MATCH, PATCHED, RUNTIME_MODULE, Example, Step, ast_dotted, ast_nodes, code, dotted,
                   is_runtime_call, runtime_call, runtime_import_statement)


class GuardCall(Step):
    ID = "guard-call"
    DESCRIPTION = "Wrap statements calling torch.cuda.synchronize/set_device in `if torch.cuda.is_available():`."
    TRIGGERS = ()
    PARAMS = {
        "calls": ["torch.cuda.synchronize", "torch.cuda.set_device", "torch.cuda.reset_peak_memory_stats",
                  "torch.cuda.reset_max_memory_allocated", "torch.cuda.reset_accumulated_memory_stats"],
        "guard": "torch.cuda.is_available()",
        "guard_import": "torch",
        # values a device-only constructor gives, built through the runtime helper that stands in without the device
        "stand_ins": {"torch.cuda.Event": "cuda_event"},
    }
    USES_RUNTIME = False  # per file: True once an event goes through the runtime
    NEEDS_SCOPE = True
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)
    EXAMPLES = (
        Example(
            """
            import torch

            def cuda_time():
                torch.cuda.synchronize()
                return time.perf_counter()
            """,
            """
            import torch

            def cuda_time():
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                return time.perf_counter()
            """,
        ),
        Example(
            """
            def run(args):
                import torch
                torch.cuda.set_device(args.rank)
            """,
            """
            def run(args):
                import torch
                if torch.cuda.is_available():
                    torch.cuda.set_device(args.rank)
            """,
            "torch imported lazily: the guard uses that import, and the module stays torch-free",
        ),
        Example(
            """
            import torch

            def timed(fn):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                return start.elapsed_time(end)
            """,
            """
            import torch
            import _ddpatch_runtime

            def timed(fn):
                start, end = _ddpatch_runtime.cuda_event(enable_timing=True), _ddpatch_runtime.cuda_event(enable_timing=True)
                start.record()
                fn()
                end.record()
                return start.elapsed_time(end)
            """,
            "a CUDA event where CUDA is available, a wall-clock stand-in with the same methods where it is not",
        ),
        Example(
            """
            def cuda_time():
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                return time.perf_counter()
            """,
            """
            def cuda_time():
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                return time.perf_counter()
            """,
            "already guarded: unchanged",
        ),
    )

    @classmethod
    def triggers(cls, params) -> tuple[str, ...]:
        names = [*params["calls"], *params["stand_ins"], *params["stand_ins"].values()]
        return ("|".join(re.escape(c.rsplit(".", 1)[-1]) + r"\(" for c in names),)

    @classmethod
    def may_match(cls, tree: ast.Module, params) -> bool:
        # a call to a guarded function, spelled through any of the file's
        # imports (`torch.xpu.synchronize()` and `stream.synchronize()` are not)
        bound: dict[str, set[str]] = {}
        called: list[str] = []
        for node in ast_nodes(tree, ast.Import, ast.ImportFrom):
            if isinstance(node, ast.Import):
                for a in node.names:
                    local = a.asname or a.name.split(".")[0]
                    bound.setdefault(local, set()).add(a.name if a.asname else local)
            elif not node.level:
                for a in node.names:
                    bound.setdefault(a.asname or a.name, set()).add(f"{node.module}.{a.name}")
        for node in ast_nodes(tree, ast.Call):  # a statement's call, or one in a conditional expression
            name = ast_dotted(node.func)
            if name:
                called.append(name)
        wanted = {*params["calls"], *params["stand_ins"], *(f"{RUNTIME_MODULE}.{h}" for h in params["stand_ins"].values())}
        for name in called:
            head, _, rest = name.partition(".")
            spellings = {name} | {b + ("." + rest if rest else "") for b in bound.get(head, ())}
            if spellings & wanted:
                return True
        return False

    @classmethod
    def looks_for(cls, params) -> str:
        return "a call of " + " / ".join([*params["calls"], *params["stand_ins"]])

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self._guards: list[str] = []
        self._catching: list[str] = []  # handlers of the enclosing ``try`` bodies that catch a call's error without CUDA
        self._suspended: list = []
        self._unprotected: set[int] = set()  # a try's else and finally blocks
        self._module_imports: set[str] = set()  # top-level packages the module imports unconditionally at top level
        self._statements = 0  # simple statements the visit is inside (a local runtime import goes before the outermost)
        self._local_runtime = False  # the statement being left built an event through a runtime imported right before it
        self._blocks: list[list] = []  # the enclosing blocks, innermost last: [id, whether the runtime was imported in it]

    def _listed(self, node: cst.BaseExpression) -> bool:
        if not isinstance(node, cst.Call):
            return False
        return bool({q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())} & set(self.params["calls"]))

    def visit_Try(self, node: cst.Try) -> None:
        caught = set()
        for handler in node.handlers:
            kinds = handler.type
            names = [dotted(e.value) for e in kinds.elements] if isinstance(kinds, cst.Tuple) else [dotted(kinds)] if kinds else [None]
            caught |= {n or "BaseException" for n in names}
        self._catching.append(next((c for c in ("BaseException", "Exception") if c in caught), None)
                              or ("RuntimeError, AssertionError" if {"RuntimeError", "AssertionError"} <= caught else ""))

        self._unprotected.update(id(n) for n in (node.orelse, node.finalbody) if n is not None)

    def leave_Try(self, original_node: cst.Try, updated_node: cst.Try) -> cst.Try:
        self._catching.pop()
        return updated_node

    # a handler, a try's else and its finally run outside the protection of the try they belong to
    def _unprotect(self, node) -> None:
        self._suspended.append(self._catching[-1])
        self._catching[-1] = ""

    def _protect(self, original_node, updated_node):
        self._catching[-1] = self._suspended.pop()
        return updated_node

    visit_ExceptHandler = visit_Finally = _unprotect
    leave_ExceptHandler = leave_Finally = _protect

    def visit_Else(self, node: cst.Else) -> None:
        self._suspended.append(None if id(node) not in self._unprotected else self._catching[-1])
        if id(node) in self._unprotected:
            self._catching[-1] = ""

    def leave_Else(self, original_node: cst.Else, updated_node: cst.Else) -> cst.Else:
        held = self._suspended.pop()
        if id(original_node) in self._unprotected:
            self._catching[-1] = held
        return updated_node

    def _conditional(self, node, test: cst.BaseExpression, branches: list) -> None:
        for branch in branches:
            if self._listed(branch):
                what, guard = code(branch.func), code(test)
                if "cuda" in guard or "device" in guard:
                    self.record(branch, FIXED_UPSTREAM, f"`{what}()` guarded by upstream in an expression (`{code(node)}`)")
                else:
                    self.record(branch, NO_MATCH, f"`{what}()` is called in `{code(node)}`, whose test does not check CUDA or "
                                                  f"the device; guard it with `if {self.params['guard']}:`")

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self._conditional(node, node.test, [node.body, node.orelse])

    def visit_BooleanOperation(self, node: cst.BooleanOperation) -> None:
        if isinstance(node.operator, cst.And):
            self._conditional(node, node.left, [node.right])

    def visit_Module(self, node: cst.Module) -> None:
        for stmt in node.body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue  # an import under `try:` / `if TYPE_CHECKING:` may not run: not a promise to rely on
            for small in stmt.body:
                if isinstance(small, cst.Import):
                    self._module_imports.update(code(a.name).split(".")[0] for a in small.names)
                elif isinstance(small, cst.ImportFrom) and not small.relative and small.module is not None:
                    self._module_imports.add(code(small.module).split(".")[0])

    def _guard_for(self, call: cst.Call) -> tuple[str, bool]:
        """The guard for ``call`` and whether it needs ``guard_import``: spelled through the call's receiver
        where that receiver is the guard's own module (``cuda.synchronize()`` -> ``cuda.is_available()``)."""
        guard = self.params["guard"]
        callee = guard.split("(", 1)[0].strip()
        module, _, name = callee.rpartition(".")
        if module and isinstance(call.func, cst.Attribute):
            receiver = call.func.value
            if module in {q.name for q in self.get_metadata(QualifiedNameProvider, receiver, set())}:
                return f"{code(receiver)}.{name}{guard[len(callee):]}", False
        return guard, bool(self.params["guard_import"])

    def _guarded_call(self, stmt: cst.SimpleStatementLine) -> cst.Call | None:
        if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Expr):
            return None
        call = stmt.body[0].value
        if not isinstance(call, cst.Call):
            return None
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, call.func, set())}
        return call if names & set(self.params["calls"]) else None

    # -- a device-only value: built through the runtime's stand-in ------------------------------------------
    def _stand_in(self, node: cst.Call) -> str | None:
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        return next((self.params["stand_ins"][n] for n in names if n in self.params["stand_ins"]), None)

    def visit_Call(self, node: cst.Call) -> None:
        if any(is_runtime_call(node, helper) for helper in self.params["stand_ins"].values()):
            self.USES_RUNTIME = True
            self.record(node, PATCHED, f"`{dotted(node.func)}(...)` already stands in where there is no CUDA")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        helper = self._stand_in(original_node)
        if helper is None:
            return updated_node
        what = code(original_node.func)
        lazy = self.params["guard_import"].split(".")[0] not in self._module_imports
        if lazy and not self._statements:
            self.record(original_node, NO_MATCH, f"`{what}(...)` in a compound statement's header, in a module that imports torch "
                                                 f"lazily: build it in a statement of its own, or with `{RUNTIME_MODULE}.{helper}(...)`")
            return updated_node
        self.USES_RUNTIME = True
        self.record(original_node, APPLIED, f"`{what}(...)` -> `{RUNTIME_MODULE}.{helper}(...)`: the same event where CUDA is "
                                            "available, a wall-clock stand-in (record, elapsed_time in ms) where it is not")
        if lazy:  # the runtime imports torch: imported where the event is built, never at module level
            self._local_runtime = True
            return cst.Call(func=cst.Attribute(value=cst.Name(RUNTIME_MODULE), attr=cst.Name(helper)), args=updated_node.args)
        return runtime_call(self, helper, updated_node.args)

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self._statements += 1

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self._blocks.append([id(node), False])

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> cst.IndentedBlock:
        self._blocks.pop()
        return updated_node

    def visit_If(self, node: cst.If) -> None:
        self._guards.append(code(node.test))

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
        self._guards.pop()
        return updated_node

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine):
        self._statements -= 1
        result = self._guarded(original_node, updated_node)
        if not self._local_runtime or self._statements:
            return result
        self._local_runtime = False
        if any(imported for _block, imported in self._blocks):
            return result  # an earlier statement of this block, or of one around it, imported it already
        if self._blocks:
            self._blocks[-1][1] = True
        statements = list(result.nodes) if isinstance(result, cst.FlattenSentinel) else [result]
        first = statements[0]
        local = runtime_import_statement(self).with_changes(leading_lines=first.leading_lines)
        return cst.FlattenSentinel([local, first.with_changes(leading_lines=[]), *statements[1:]])

    def _guarded(self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine):
        call = self._guarded_call(original_node)
        if call is None:
            return updated_node
        what = code(call.func)
        guard, needs_import = self._guard_for(call)
        if self._guards and self._guards[-1] in (guard, self.params["guard"]):
            self.record(original_node, PATCHED, f"`{what}()` already guarded")
            return updated_node
        if any("cuda" in g or "device" in g for g in self._guards):
            self.record(original_node, FIXED_UPSTREAM, f"`{what}()` guarded by upstream (`if {self._guards[-1]}`)")
            return updated_node
        if any(self._catching):  # the statement's own try (inside the body, not in a handler: the handler's calls run after)
            caught = next(c for c in reversed(self._catching) if c)
            self.record(original_node, FIXED_UPSTREAM, f"`{what}()` guarded by upstream: its `try` catches `{caught}`")
            return updated_node
        self.record(original_node, APPLIED, f"`{what}()` now runs only if {guard}")
        wrapped = cst.If(
            test=cst.parse_expression(guard),
            body=cst.IndentedBlock(body=[updated_node.with_changes(leading_lines=[])]),
            leading_lines=updated_node.leading_lines,
        )
        package = self.params["guard_import"]
        if not needs_import:
            return wrapped
        if package.split(".")[0] in self._module_imports:
            AddImportsVisitor.add_needed_import(self.context, package)  # the module imports it there already
            return wrapped
        # imported right before the guard, where the call runs: never a new module-level import
        local = cst.SimpleStatementLine(body=[cst.Import(names=[cst.ImportAlias(name=cst.parse_expression(package))])],
                                        leading_lines=updated_node.leading_lines)
        return cst.FlattenSentinel([local, wrapped.with_changes(leading_lines=[])])

    def evidence(self, function: cst.FunctionDef) -> str | None:
        text = cst.Module(body=[function]).code
        names = [*self.params["calls"], *self.params["stand_ins"]]
        if not any(c.rsplit(".", 1)[-1] + "(" in text for c in names):
            return f"`{function.name.value}` no longer calls {' or '.join(names)}"
        return None
