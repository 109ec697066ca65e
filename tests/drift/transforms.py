"""Small code transformations that turn a copy of ``vendored/`` into a drifted fork.

Every transform either rewrites through LibCST and counts its edits, or replaces exact text
anchors and checks how often each anchor occurs. When ``vendored/`` changes so that an anchor
is gone, the transform raises :class:`DriftAnchorError` instead of silently producing a
"variant" identical to the original: a drift test that tests nothing would look green forever.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable, Iterable

import libcst as cst

INDENT = "    "


class DriftAnchorError(AssertionError):
    """A transform did not find what it rewrites: vendored/ changed, update the transform."""


# ---------------------------------------------------------------- text anchors


def replace(text: str, old: str, new: str, count: int = 1, where: str = "") -> str:
    """``text`` with ``old`` replaced by ``new``; ``old`` must occur exactly ``count`` times."""
    found = text.count(old)
    if found != count:
        raise DriftAnchorError(f"{where}: anchor {old!r} occurs {found} times, expected {count}")
    return text.replace(old, new)


def edit(root: Path, rel: str, *pairs: tuple) -> None:
    """Apply ``(old, new)`` or ``(old, new, count)`` replacements to ``root/rel`` in order."""
    path = root / rel
    text = path.read_text(encoding="utf-8")
    for pair in pairs:
        old, new, *count = pair
        text = replace(text, old, new, count[0] if count else 1, where=rel)
    path.write_text(text, encoding="utf-8")


def insert_before(root: Path, rel: str, anchor: str, block: str) -> None:
    """Put ``block`` right before the single occurrence of ``anchor``."""
    edit(root, rel, (anchor, block + anchor))


# ---------------------------------------------------------------- LibCST transforms


class CountingTransformer(cst.CSTTransformer):
    """A transformer that counts its edits, so that an edit-free run can fail loudly."""

    def __init__(self) -> None:
        super().__init__()
        self.changes = 0


def transform(root: Path, rel: str, make: Callable[[], CountingTransformer], min_changes: int = 1) -> int:
    path = root / rel
    module = cst.parse_module(path.read_text(encoding="utf-8"))
    transformer = make()
    new = module.visit(transformer)
    if transformer.changes < min_changes:
        raise DriftAnchorError(
            f"{rel}: {type(transformer).__name__} made {transformer.changes} edits, expected at least {min_changes}"
        )
    path.write_text(new.code, encoding="utf-8")
    return transformer.changes


def _newline(indent: str) -> cst.ParenthesizedWhitespace:
    # inside brackets: end the line, then indent relative to the enclosing statement's block
    return cst.ParenthesizedWhitespace(
        first_line=cst.TrailingWhitespace(), empty_lines=[], indent=True, last_line=cst.SimpleWhitespace(indent)
    )


class ExplodeArguments(CountingTransformer):
    """black's "magic trailing comma" layout: every call with two or more arguments and every
    plain parameter list of three or more gets one item per line and a trailing comma."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0

    @staticmethod
    def _explodable(node: cst.Call) -> bool:
        return len(node.args) >= 2 and not any(isinstance(a.value, cst.GeneratorExp) for a in node.args)

    def visit_Call(self, node: cst.Call) -> None:
        if self._explodable(node):
            self._depth += 1

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not self._explodable(original_node):
            return updated_node
        depth = self._depth
        self._depth -= 1
        inner, outer = INDENT * depth, INDENT * (depth - 1)
        args = []
        for i, arg in enumerate(updated_node.args):
            last = i == len(updated_node.args) - 1
            comma = cst.Comma(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=_newline(outer if last else inner))
            args.append(arg.with_changes(comma=comma, whitespace_after_arg=cst.SimpleWhitespace("")))
        self.changes += 1
        return updated_node.with_changes(args=args, whitespace_before_args=_newline(inner))

    def leave_Parameters(self, original_node: cst.Parameters, updated_node: cst.Parameters) -> cst.Parameters:
        plain = (
            len(updated_node.params) >= 3
            and not updated_node.posonly_params
            and not updated_node.kwonly_params
            and updated_node.star_arg is cst.MaybeSentinel.DEFAULT
            and updated_node.star_kwarg is None
        )
        if not plain:
            return updated_node
        params = []
        for i, param in enumerate(updated_node.params):
            last = i == len(updated_node.params) - 1
            comma = cst.Comma(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=_newline("" if last else INDENT))
            params.append(param.with_changes(comma=comma, whitespace_after_param=cst.SimpleWhitespace("")))
        params[0] = params[0].with_changes(whitespace_after_star=cst.SimpleWhitespace(""))
        self.changes += 1
        return updated_node.with_changes(params=params)

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        params = updated_node.params.params
        if params and isinstance(params[0].comma, cst.Comma) and isinstance(params[0].comma.whitespace_after, cst.ParenthesizedWhitespace):
            return updated_node.with_changes(whitespace_before_params=_newline(INDENT))
        return updated_node


class SingleQuotes(CountingTransformer):
    """``"text"`` -> ``'text'`` where that cannot change the string (no quotes or escapes inside)."""

    def leave_SimpleString(self, original_node: cst.SimpleString, updated_node: cst.SimpleString) -> cst.SimpleString:
        value = updated_node.value
        if len(value) < 2 or value[0] != '"' or value.startswith('"""'):
            return updated_node
        body = value[1:-1]
        if "'" in body or "\\" in body or '"' in body:
            return updated_node
        self.changes += 1
        return updated_node.with_changes(value=f"'{body}'")


class RenameNames(CountingTransformer):
    """Rename variables and parameters inside the named functions (all renames at once, so a
    mapping may swap two names). Attribute names and keyword-argument names are callee
    vocabulary, not local names, and stay."""

    def __init__(self, functions: Iterable[str], mapping: dict[str, str]) -> None:
        super().__init__()
        self.functions = set(functions)
        self.mapping = mapping
        self._inside = 0
        self.seen: set[str] = set()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if node.name.value in self.functions:
            self._inside += 1
            self.seen.add(node.name.value)

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if original_node.name.value in self.functions:
            self._inside -= 1
            return updated_node.with_changes(name=original_node.name)
        return updated_node

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        if self._inside and original_node.value in self.mapping:
            self.changes += 1
            return updated_node.with_changes(value=self.mapping[original_node.value])
        return updated_node

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.Attribute:
        if self._inside and original_node.attr.value in self.mapping:
            self.changes -= 1
            return updated_node.with_changes(attr=original_node.attr)
        return updated_node

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        if self._inside and original_node.keyword is not None and original_node.keyword.value in self.mapping:
            self.changes -= 1
            return updated_node.with_changes(keyword=original_node.keyword)
        return updated_node


def rename(root: Path, rel: str, functions: Iterable[str], mapping: dict[str, str]) -> None:
    functions = list(functions)
    made: list[RenameNames] = []

    def make() -> RenameNames:
        made.append(RenameNames(functions, mapping))
        return made[-1]

    path = root / rel
    module = cst.parse_module(path.read_text(encoding="utf-8"))
    new = module.visit(make())
    missing = set(functions) - made[-1].seen
    if missing:
        raise DriftAnchorError(f"{rel}: no function {sorted(missing)} to rename in")
    if made[-1].changes < 1:
        raise DriftAnchorError(f"{rel}: none of {sorted(mapping)} occurs in {functions}")
    path.write_text(new.code, encoding="utf-8")


# ---------------------------------------------------------------- moving code into helpers


def _function(tree: ast.Module, name: str, rel: str) -> ast.FunctionDef:
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(found) != 1:
        raise DriftAnchorError(f"{rel}: {len(found)} top-level functions named {name}")
    return found[0]


def move_loop_into_helper(
    root: Path, rel: str, function: str, first_line: str, helper: str, params: list[str], returns: list[str]
) -> None:
    """Move the statements of ``function`` from the line ``first_line`` through the end of the
    first ``while`` loop after it into a new top-level ``helper(params) -> returns``, called in
    their place. The moved lines keep their indentation: a top-level function body has the
    same one as ``function``'s."""
    path = root / rel
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    fn = _function(ast.parse(text), function, rel)
    starts = [s for s in fn.body if lines[s.lineno - 1].rstrip("\n") == first_line]
    if len(starts) != 1:
        raise DriftAnchorError(f"{rel}: {len(starts)} statements of {function} read {first_line!r}")
    loops = [s for s in fn.body if isinstance(s, ast.While) and s.lineno > starts[0].lineno]
    if not loops:
        raise DriftAnchorError(f"{rel}: no while loop after {first_line!r} in {function}")
    begin, end = starts[0].lineno - 1, loops[0].end_lineno
    moved = lines[begin:end]
    indent = first_line[: len(first_line) - len(first_line.lstrip())]
    if indent != INDENT:
        raise DriftAnchorError(f"{rel}: {function}'s body is not indented by four spaces")
    call = f"{INDENT}{', '.join(returns)} = {helper}(\n" + "".join(f"{INDENT * 2}{p},\n" for p in params) + f"{INDENT})\n"
    definition = (
        f"def {helper}(\n"
        + "".join(f"{INDENT}{p},\n" for p in params)
        + "):\n"
        + "".join(moved)
        + f"{INDENT}return {', '.join(returns)}\n\n\n"
    )
    head = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
    new = lines[:head] + [definition] + lines[head:begin] + [call] + lines[end:]
    path.write_text("".join(new), encoding="utf-8")


# ---------------------------------------------------------------- facts the claims check


def function_params(root: Path, rel: str, function: str) -> list[str]:
    tree = ast.parse((root / rel).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return [a.arg for a in node.args.args]
    raise AssertionError(f"{rel}: no function {function}")


def names_in(root: Path, rel: str, function: str) -> set[str]:
    tree = ast.parse((root / rel).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            found = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            return found | {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
    raise AssertionError(f"{rel}: no function {function}")


def same_ast(a: str, b: str) -> bool:
    return ast.dump(ast.parse(a)) == ast.dump(ast.parse(b))
