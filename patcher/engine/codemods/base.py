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
import ast
import textwrap
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Sequence

import libcst as cst
from libcst.codemod import Codemod, CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider
from libcst.metadata.position_provider import PositionProvidingCodegenState

from ...results import ALREADY_APPLIED, APPLIED, FIXED_UPSTREAM, NO_MATCH, UNCLASSIFIED, Site  # noqa: F401  (re-exported to the steps)

#: A site whose code already has this step's output form; the engine decides whether
#: ddpatch wrote it (already-applied) or upstream did (fixed-upstream).
PATCHED = "patched"

RUNTIME_MODULE = "_ddpatch_runtime"
#: Set by the engine in ``CodemodContext.scratch``: whether the file is inside a package (then the runtime is
#: imported relatively, next to it), or ``"both"`` where it may be imported either way (``patcher.engine.packages``).
IN_PACKAGE = "ddpatch.in_package"


@dataclass(frozen=True)
class Example:
    """A before/after pair; ``after == before`` marks code the step must leave alone."""

    before: str
    after: str
    note: str = ""
    #: The step parameters the example is for (empty: any); ``recipes show`` gives each step the examples of its own.
    params: dict = field(default_factory=dict, hash=False, compare=False)

    def clean(self) -> "Example":
        return Example(textwrap.dedent(self.before).lstrip("\n"), textwrap.dedent(self.after).lstrip("\n"), self.note, self.params)

    def fits(self, params: dict) -> bool:
        """Whether the example shows a step run with ``params``."""
        return all(params.get(k) == v for k, v in self.params.items())


#: Step classes without LibCST matcher decorators (``Step.__init__``).
_UNDECORATED: set[type] = set()


class FunctionStack:
    """A step's ``self._fns``: the data-flow ``Fn`` (``flow.ModuleFlow``, set as ``self.flow`` in ``visit_Module``) of each
    function the visit is inside, innermost last. Put it before ``Step`` in the bases."""

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self._fns.append(self.flow.by_node.get(node) if self.flow else None)
        return super().visit_FunctionDef(node)

    def leave_FunctionDef(self, original_node, updated_node):
        self._fns.pop()
        return super().leave_FunctionDef(original_node, updated_node)


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
        if type(self) in _UNDECORATED:
            # LibCST's MatcherDecoratableTransformer.__init__ walks every attribute of the instance
            # for matcher decorators (@m.visit, @m.call_if_inside, ...): about a fifth of a decoder
            # file's whole run, for each step and file. A step class found to have none skips it.
            Codemod.__init__(self, context)
            cst.CSTTransformer.__init__(self)
            self._extra_visit_funcs, self._extra_leave_funcs, self._matchers = {}, {}, {}
        else:
            super().__init__(context)
            if not (self._extra_visit_funcs or self._extra_leave_funcs or self._matchers):
                _UNDECORATED.add(type(self))
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
        file is still looked at (and reported already-applied). They are tried in order, so
        the first should start with a plain word: ``re`` looks for a leading word quickly,
        and tries every position of the file for a pattern that starts with ``\\b`` or a
        lookbehind (seconds on a site-packages tree).
        """
        return cls.TRIGGERS

    @classmethod
    def may_match(cls, tree: ast.Module, params: dict[str, Any]) -> bool:
        """Whether the file's stdlib ``ast`` has a node this step could report (the second prefilter).

        A step whose triggers are common words (``model(``, ``flash_attn``) checks the
        shape of its sites here: ``ast.parse`` is C, five times faster than LibCST's parser
        (and LibCST then rebuilds every node in a traversal), so most files the triggers let
        through are never parsed by LibCST. It may say True for a file without sites, never
        False for a file with one (tests/test_properties.py and tests/test_corpus.py check).
        """
        return True

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
        fn = self.function if function is ... else function
        site = Site(status, 0, 0, fn, message, step=self.ID, node=node)
        if PositionProvider in self.metadata:  # under libcst.tool; the engine places sites itself
            place(site, self.metadata[PositionProvider])
        self.sites.append(site)

    def runtime(self) -> cst.Name:
        """Schedule the runtime import for this file and return the name to call through."""
        if self.context.scratch.get(IN_PACKAGE) is True:
            AddImportsVisitor.add_needed_import(self.context, "", RUNTIME_MODULE, relative=1)
        else:
            AddImportsVisitor.add_needed_import(self.context, RUNTIME_MODULE)
        return cst.Name(RUNTIME_MODULE)

    #: A regex a file's text must match for ``scan_tree`` to be given it (None: no tree scan).
    TREE_TRIGGER: ClassVar[str | None] = None

    @classmethod
    def scan_tree(cls, sources: dict[str, str], params: dict[str, Any]) -> dict[str, Any]:
        """Parameters the step derives from the whole tree before files are run one by one.

        ``sources`` maps tree-relative paths to the texts that match ``TREE_TRIGGER``. A
        fact that lives in another file (the drafter's class, for a call in the decoder)
        reaches the per-file run this way; the result is merged into the step's params.
        """
        return {}

    @classmethod
    def looks_for(cls, params: dict[str, Any]) -> str:
        """What the step changes, as a noun phrase ("a module-level import of datasets"): said where an anchor of a
        benchmark is gone from the tree (``patcher.engine.absent``)."""
        return "what this step rewrites"

    @classmethod
    def near_miss(cls, text: str, function: str, params: dict[str, Any]) -> str | None:
        """What ``function`` (an anchor, or a helper it calls, with no site and no ``evidence``) does instead, read from
        its file's ``text``: said in the anchor's no-match, so that a user sees the form ddpatch saw. None: nothing."""
        return None

    def evidence(self, function: cst.FunctionDef) -> str | None:
        """Evidence that ``function`` (an anchor with no site) no longer needs this step.

        Returning a reason makes the anchor ``fixed-upstream``; ``None`` makes it ``no-match``.
        """
        return None


def place(site: Site, positions) -> None:
    pos = positions.get(site.node)
    site.line, site.column = (pos.start.line, pos.start.column + 1) if pos is not None else (0, 0)
    site.node = None


class _SitePositions(PositionProvidingCodegenState):
    """PositionProvider's code generation, keeping track of positions only inside the nodes asked for.

    PositionProvider records a range for every node of a file, which costs more than
    parsing it; a file's sites are a few nodes. Outside them the tokens are only
    collected, and counted when the next wanted node starts.
    """

    def __init__(self, module: cst.Module, provider: PositionProvider, wanted: set) -> None:
        super().__init__(default_indent=module.default_indent, default_newline=module.default_newline, provider=provider)
        self.wanted = wanted
        self.depth = 0  # nodes open since a wanted node started
        self.counted = 0  # tokens already folded into line/column

    def add_indent_tokens(self) -> None:
        self.tokens.extend(self.indent_tokens)
        if self.depth:
            for token in self.indent_tokens:
                self._update_position(token)

    def add_token(self, value: str) -> None:
        self.tokens.append(value)
        if self.depth:
            self._update_position(value)

    def before_codegen(self, node: cst.CSTNode) -> None:
        if not self.depth:
            if node not in self.wanted:
                return
            self._update_position("".join(self.tokens[self.counted:]))
        self.depth += 1
        super().before_codegen(node)

    def after_codegen(self, node: cst.CSTNode) -> None:
        if self.depth:
            super().after_codegen(node)
            self.depth -= 1
            self.counted = len(self.tokens)

    def record_syntactic_position(self, node, *, start_node=None, end_node=None):
        if self.depth:  # start_node and end_node are always inside node
            return super().record_syntactic_position(node, start_node=start_node, end_node=end_node)
        return nullcontext()


def site_positions(module: cst.Module, nodes: Iterable[cst.CSTNode]) -> dict:
    """``PositionProvider``'s ranges for ``nodes`` (and the nodes inside them) of ``module``."""
    provider = PositionProvider()
    module._codegen(_SitePositions(module, provider, set(nodes)))
    return provider._computed


def dotted(node: cst.BaseExpression) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = dotted(node.value)
        return None if head is None else f"{head}.{node.attr.value}"
    return None


def ast_dotted(node: ast.expr) -> str | None:
    """``dotted`` for the stdlib ``ast``, for ``may_match``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = ast_dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def cst_nodes(node: cst.CSTNode, *kinds: type) -> list:
    """The LibCST nodes of the given kinds inside ``node``, in visiting order (nested functions and classes included:
    a step reads them on their own too)."""
    found: list = []

    class _Collect(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            if isinstance(n, kinds):
                found.append(n)
            return True

    node.visit(_Collect())
    return found


def ast_nodes(tree: ast.Module, *kinds: type) -> list:
    """The nodes of ``tree`` of the given kinds, for ``may_match``.

    The tree is walked once and indexed by node type, and the index is kept on the tree:
    walking it in Python costs more than ``ast.parse``, and every step asks.
    """
    index = tree.__dict__.get("_ddpatch_index")
    if index is None:
        index = {}
        for node in ast.walk(tree):
            index.setdefault(type(node), []).append(node)
        tree._ddpatch_index = index
    return [node for kind in kinds for node in index.get(kind, ())]


def ast_calls(tree: ast.Module, keyword: str | None = None) -> list[ast.Call]:
    """The calls in ``tree``, or those passing ``keyword=``."""
    return [c for c in ast_nodes(tree, ast.Call) if keyword is None or any(k.arg == keyword for k in c.keywords)]


def ast_inside(node: ast.AST, outer: ast.AST) -> bool:
    """Whether ``node`` lies inside ``outer``, by their source spans (the stdlib ``ast`` has no parents)."""
    return (outer.lineno, outer.col_offset) <= (node.lineno, node.col_offset) and (
        node.end_lineno, node.end_col_offset) <= (outer.end_lineno, outer.end_col_offset)


def code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def parse_dotted(text: str) -> cst.BaseExpression:
    return cst.parse_expression(text)


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg
    return None


#: The keywords a transformers model call takes its cache under: ``past_key_values=`` (every 5.x release; deprecated
#: from 5.24, removal announced for 5.40) and ``cache=`` (5.24+, what code written for those releases passes).
CACHE_KEYWORDS = ("past_key_values", "cache")


def cache_keyword(call: cst.Call) -> cst.Arg | None:
    """The argument a model call passes its cache in, under either keyword; ``cache=`` counts only when its value
    could be a cache (a name, attribute, subscript or call), not a literal such as ``cache=True``."""
    arg = keyword(call, "past_key_values")
    if arg is not None:
        return arg
    arg = keyword(call, "cache")
    if arg is None or not isinstance(arg.value, (cst.Name, cst.Attribute, cst.Subscript, cst.Call)):
        return None
    if isinstance(arg.value, cst.Name) and arg.value.value in ("None", "True", "False"):
        return None
    return arg


def runtime_import_block() -> cst.Try:
    """The runtime's import for a module that may be imported as ``pkg.mod`` or run as a script (``packages.BOTH``)."""
    return cst.parse_statement(f"try:\n    from . import {RUNTIME_MODULE}\nexcept ImportError:  # run as a script, not as pkg.mod\n"
                               f"    import {RUNTIME_MODULE}\n")


def runtime_import_statement(step: Step) -> cst.BaseStatement:
    """The runtime's import as a statement of its own, for a function to import it where it is used (a module that
    keeps torch lazy must not import the runtime, which imports torch, at module level)."""
    mode = step.context.scratch.get(IN_PACKAGE)
    if mode is True:
        return cst.parse_statement(f"from . import {RUNTIME_MODULE}\n")
    return cst.parse_statement(f"import {RUNTIME_MODULE}\n") if not mode else runtime_import_block()


def runtime_call(step: Step, function: str, args: Sequence[cst.Arg]) -> cst.Call:
    return cst.Call(func=cst.Attribute(value=step.runtime(), attr=cst.Name(function)), args=list(args))


def is_runtime_call(node: cst.CSTNode, function: str) -> bool:
    return isinstance(node, cst.Call) and dotted(node.func) in (f"{RUNTIME_MODULE}.{function}",)
