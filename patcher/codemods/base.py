"""What every recipe step shares: statuses, sites, examples, and the LibCST plumbing.

A step is a LibCST ``VisitorBasedCodemodCommand``, so it also runs under
``python -m libcst.tool codemod``. On top of LibCST it reports *sites*: each place it
rewrote (``applied``), each place where its output form is already present
(``patched``; the engine turns that into ``already-applied`` or ``fixed-upstream``
from the file's provenance line), and each place where upstream solved the same
problem in another form (``fixed-upstream``). A step that reports nothing in a
function it is anchored to is a ``no-match``: the code it was written for has
changed.
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import libcst as cst
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider

APPLIED = "applied"
ALREADY_APPLIED = "already-applied"
FIXED_UPSTREAM = "fixed-upstream"
NO_MATCH = "no-match"
#: A site whose code already has this step's output form; the engine decides whether
#: ddpatch wrote it (already-applied) or upstream did (fixed-upstream).
PATCHED = "patched"

RUNTIME_MODULE = "_ddpatch_runtime"
#: Set by the engine in ``CodemodContext.scratch``: whether the file is inside a package
#: (then the runtime is imported relatively, next to it).
IN_PACKAGE = "ddpatch.in_package"


@dataclass(frozen=True)
class Example:
    """A before/after pair; ``after == before`` marks code the step must leave alone."""

    before: str
    after: str
    note: str = ""

    def clean(self) -> "Example":
        return Example(textwrap.dedent(self.before).lstrip("\n"), textwrap.dedent(self.after).lstrip("\n"), self.note)


@dataclass
class Site:
    status: str
    line: int
    column: int
    function: str | None
    message: str
    step: str = ""
    path: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "function": self.function,
            "message": self.message,
        }


class Step(VisitorBasedCodemodCommand):
    """Base class of every codemod step. Subclasses set the class attributes below."""

    #: Stable id used in recipes and reports.
    ID: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""
    #: Regular expressions that must all match a file's text for the step to parse it.
    TRIGGERS: ClassVar[tuple[str, ...]] = ()
    #: Parameters with their defaults; a recipe may override them.
    PARAMS: ClassVar[dict[str, Any]] = {}
    #: What the step matches and writes; also its fixture-style documentation.
    EXAMPLES: ClassVar[tuple[Example, ...]] = ()
    #: Whether the step's output calls into the runtime helper module.
    USES_RUNTIME: ClassVar[bool] = False
    #: Whether the step needs scope analysis (qualified names); it costs a second pass.
    NEEDS_SCOPE: ClassVar[bool] = False

    METADATA_DEPENDENCIES: ClassVar[Sequence] = (PositionProvider,)

    def __init__(self, context: CodemodContext, **params: Any) -> None:
        super().__init__(context)
        unknown = set(params) - set(self.PARAMS)
        if unknown:
            raise ValueError(f"step {self.ID}: unknown parameter(s) {', '.join(sorted(unknown))}")
        self.params: dict[str, Any] = {**self.PARAMS, **{k: v for k, v in params.items() if v is not None}}
        self.sites: list[Site] = []
        self._functions: list[str] = []

    @classmethod
    def triggers(cls, params: dict[str, Any]) -> tuple[str, ...]:
        """Regexes that must all match a file's text for the step to parse it (the cheap prefilter).

        They cover both the form the step rewrites and the form it writes, so a patched
        file is still looked at (and reported already-applied).
        """
        return cls.TRIGGERS

    # -- libcst.tool integration -------------------------------------------------
    @classmethod
    def add_args(cls, arg_parser: argparse.ArgumentParser) -> None:
        for name, default in cls.PARAMS.items():
            flag = "--" + name.replace("_", "-")
            if isinstance(default, (list, tuple)):
                arg_parser.add_argument(flag, dest=name, nargs="+", default=None)
            else:
                arg_parser.add_argument(flag, dest=name, default=None)

    # -- helpers for subclasses -----------------------------------------------------
    @property
    def function(self) -> str | None:
        return self._functions[-1] if self._functions else None

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool | None:
        self._functions.append(node.name.value)
        return True

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.CSTNode:
        self._functions.pop()
        return updated_node

    def record(self, node: cst.CSTNode, status: str, message: str, function: str | None = ...) -> None:
        pos = self.get_metadata(PositionProvider, node, None)
        line, col = (pos.start.line, pos.start.column + 1) if pos is not None else (0, 0)
        fn = self.function if function is ... else function
        self.sites.append(Site(status, line, col, fn, message, step=self.ID))

    def runtime(self) -> cst.Name:
        """Schedule the runtime import for this file and return the name to call through."""
        if self.context.scratch.get(IN_PACKAGE):
            AddImportsVisitor.add_needed_import(self.context, "", RUNTIME_MODULE, relative=1)
        else:
            AddImportsVisitor.add_needed_import(self.context, RUNTIME_MODULE)
        return cst.Name(RUNTIME_MODULE)

    def evidence(self, function: cst.FunctionDef) -> str | None:
        """Evidence that ``function`` (an anchor with no site) no longer needs this step.

        Returning a reason makes the anchor ``fixed-upstream``; ``None`` makes it ``no-match``.
        """
        return None


def dotted(node: cst.BaseExpression) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = dotted(node.value)
        return None if head is None else f"{head}.{node.attr.value}"
    return None


def code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def parse_dotted(text: str) -> cst.BaseExpression:
    return cst.parse_expression(text)


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg
    return None


def runtime_call(step: Step, function: str, args: Sequence[cst.Arg]) -> cst.Call:
    return cst.Call(func=cst.Attribute(value=step.runtime(), attr=cst.Name(function)), args=list(args))


def is_runtime_call(node: cst.CSTNode, function: str) -> bool:
    return isinstance(node, cst.Call) and dotted(node.func) in (f"{RUNTIME_MODULE}.{function}",)
