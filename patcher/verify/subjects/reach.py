"""The tree's functions and the calls between them, read statically: which of the tree's own functions a decoder
reaches (``sample``, ``compact_dynamic_cache``, a drafter's ``forward``), and through which call sites.

A call is followed when it names a function of the tree: defined in the same module, imported from a module of the
tree (``from model import sample``, re-exported by a package's ``__init__``, relative imports too), an attribute of
an imported module (``utils.trim(...)``), a method through ``self``, or a parameter annotated with a class of the
tree (``model: DFlashDraftModel``: ``model(...)`` is its ``forward``). Anything else (torch, transformers, a call
through a variable) is not the tree's code and is not followed. Stdlib only; nothing is imported from the tree.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from .decoders import dotted, python_files

#: how far a chain of re-exports (``from .utils import sample`` in ``__init__``) is followed
MAX_HOPS = 6
#: how many functions a decoder's helpers are followed to (a guard against pathological trees)
MAX_HELPERS = 200


@dataclass
class Module:
    rel: str
    name: str
    package: str  # the package relative imports start from
    node: ast.Module
    source: str
    functions: dict = field(default_factory=dict)  # qualname ("f", "Class.m") -> FunctionDef
    classes: dict = field(default_factory=dict)  # name -> ClassDef
    imports: dict = field(default_factory=dict)  # local name -> (module, attribute or None)


class Tree:
    """The tree's modules, parsed when first asked for."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.files = {rel.as_posix(): path for path, rel in python_files(self.root)}
        self.by_name = {dotted(Path(rel)): rel for rel in self.files}
        self._parsed: dict[str, Module | None] = {}

    def module(self, rel: str) -> Module | None:
        if rel not in self._parsed:
            self._parsed[rel] = self._parse(rel)
        return self._parsed[rel]

    def _parse(self, rel: str) -> Module | None:
        path = self.files.get(rel) or (self.root / rel)
        try:
            source = path.read_text(encoding="utf-8")
            node = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            return None
        name = dotted(Path(rel))
        package = name if Path(rel).name == "__init__.py" else name.rpartition(".")[0]
        mod = Module(rel, name, package, node, source)
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mod.functions[stmt.name] = stmt
            elif isinstance(stmt, ast.ClassDef):
                mod.classes[stmt.name] = stmt
                for item in stmt.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        mod.functions[f"{stmt.name}.{item.name}"] = item
        for stmt in ast.walk(node):  # imports anywhere: forks import inside functions too
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        mod.imports[alias.asname] = (alias.name, None)
                    else:
                        top = alias.name.split(".")[0]
                        mod.imports.setdefault(top, (top, None))
            elif isinstance(stmt, ast.ImportFrom):
                base = self._absolute(mod, stmt.module, stmt.level)
                for alias in stmt.names:
                    if alias.name != "*":
                        mod.imports[alias.asname or alias.name] = (base, alias.name)
        return mod

    @staticmethod
    def _absolute(mod: Module, name: str | None, level: int) -> str:
        if not level:
            return name or ""
        parts = mod.package.split(".") if mod.package else []
        parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
        return ".".join(p for p in (*parts, name or "") if p)

    def function(self, key: tuple[str, str]):
        mod = self.module(key[0])
        return None if mod is None else mod.functions.get(key[1])

    # ------------------------------------------------------------------------- names
    def lookup(self, module: str, attr: str, hops: int = 0):
        """What ``attr`` of the tree's module ``module`` is: ("module", name), ("function", key), ("class", key) or None."""
        if hops > MAX_HOPS:
            return None
        if f"{module}.{attr}" in self.by_name:
            return ("module", f"{module}.{attr}")
        rel = self.by_name.get(module)
        mod = self.module(rel) if rel else None
        if mod is None:
            return None
        if attr in mod.functions and "." not in attr:
            return ("function", (mod.rel, attr))
        if attr in mod.classes:
            return ("class", (mod.rel, attr))
        if attr in mod.imports:
            source, name = mod.imports[attr]
            return ("module", source) if name is None and source in self.by_name else \
                self.lookup(source, name, hops + 1) if name is not None else None
        return None

    def name_in(self, mod: Module, name: str):
        """What a bare name of module ``mod`` is (a function, class or module of the tree, or None)."""
        if name in mod.functions and "." not in name:
            return ("function", (mod.rel, name))
        if name in mod.classes:
            return ("class", (mod.rel, name))
        if name in mod.imports:
            source, attr = mod.imports[name]
            if attr is None:
                return ("module", source) if source in self.by_name else None
            return self.lookup(source, attr)
        return None

    def method(self, cls: tuple[str, str], name: str, hops: int = 0):
        """``Class.name`` of the tree, looked up through the class's bases that are the tree's too."""
        mod = self.module(cls[0])
        node = mod.classes.get(cls[1]) if mod else None
        if node is None or hops > MAX_HOPS:
            return None
        if f"{cls[1]}.{name}" in mod.functions:
            return (mod.rel, f"{cls[1]}.{name}")
        for base in node.bases:
            found = self.value(mod, base, {})
            if found and found[0] == "class":
                hit = self.method(found[1], name, hops + 1)
                if hit:
                    return hit
        return None

    def value(self, mod: Module, node: ast.AST, instances: dict):
        """What an expression names: a module, function or class of the tree, an instance of a tree class (a
        parameter annotated with one, or ``self``), or None."""
        if isinstance(node, ast.Name):
            if node.id in instances:
                return ("instance", instances[node.id])
            return self.name_in(mod, node.id)
        if isinstance(node, ast.Attribute):
            base = self.value(mod, node.value, instances)
            if base is None:
                return None
            if base[0] == "module":
                return self.lookup(base[1], node.attr)
            if base[0] == "instance":
                found = self.method(base[1], node.attr)
                return ("function", found) if found else None
        return None

    def callee(self, mod: Module, call: ast.Call, instances: dict):
        """The tree function a call runs, or None (calling an instance of a tree class runs its ``forward``)."""
        found = self.value(mod, call.func, instances)
        if found is None:
            return None
        if found[0] == "function":
            return found[1]
        if found[0] == "instance":
            return self.method(found[1], "forward")
        return None

    def instances(self, key: tuple[str, str]) -> dict:
        """The names of function ``key`` that hold an instance of a tree class: ``self`` in a method, and the
        parameters annotated with a class of the tree."""
        mod, node = self.module(key[0]), self.function(key)
        out = {}
        if mod is None or node is None:
            return out
        if "." in key[1]:
            out["self"] = (mod.rel, key[1].split(".")[0])
        for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
            ann = arg.annotation
            if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
                try:
                    ann = ast.parse(ann.value, mode="eval").body
                except SyntaxError:
                    continue
            found = self.value(mod, ann, {}) if ann is not None else None
            if found and found[0] == "class":
                out[arg.arg] = found[1]
        return out

    def calls(self, key: tuple[str, str]) -> list[tuple[ast.Call, tuple[str, str]]]:
        """(call node, callee key) for every call of function ``key`` (nested functions included) into the tree."""
        mod, node = self.module(key[0]), self.function(key)
        if mod is None or node is None:
            return []
        instances = self.instances(key)
        out = []
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                target = self.callee(mod, sub, instances)
                if target is not None and target != key:
                    out.append((sub, target))
        return out

    def helpers(self, key: tuple[str, str]) -> dict[tuple[str, str], list[tuple[tuple[str, str], ast.Call]]]:
        """Every tree function ``key`` reaches, transitively, with the call sites that reach each:
        callee -> [(caller, call node)], in the order they were found."""
        out: dict = {}
        queue = [key]
        seen = {key}
        while queue and len(seen) < MAX_HELPERS:
            caller = queue.pop(0)
            for call, callee in self.calls(caller):
                out.setdefault(callee, []).append((caller, call))
                if callee not in seen:
                    seen.add(callee)
                    queue.append(callee)
        out.pop(key, None)
        return out

    def enclosing(self, rel: str, line: int) -> tuple[str, str] | None:
        """The module-level function or method of ``rel`` that holds ``line``."""
        mod = self.module(rel)
        if mod is None:
            return None
        for qualname, node in mod.functions.items():
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            if first <= line <= node.end_lineno:
                return (rel, qualname)
        return None
