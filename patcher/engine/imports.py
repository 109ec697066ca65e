"""The tree's imports: which of its files each file imports, and the imports that resolve to nothing.

Read with a regular expression over every file (cheap). An import that resolves to nothing counts
only where it is written unconditionally at the module's top level (at column 0, outside a
triple-quoted string): one inside ``try: ... except ImportError``, under an ``if`` (``if
TYPE_CHECKING:``, ``if is_torch_available():``) or inside a function is optional, conditional or
lazy by intent, and a string that looks like an import is not one.

An import resolves when the file it names is in the tree (next to the importing script, at the
tree's root or under ``src/``, or relative to the importing package), or, for a top-level name
that is no file of the tree, when the module is in the standard library or installed in this
environment. Nothing is imported to decide it: ``importlib``'s path finder only looks on disk, and
the working folder is left out of its search (a sibling in the folder you run ddpatch from is not
the tree's).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .codemods.base import RUNTIME_MODULE

_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(?P<dots>\.*)(?P<mod>[\w.]*)[ \t]+import[ \t]+(?P<names>\([^)]*\)|[^\n#;]+)"
    r"|import[ \t]+(?P<plain>[^\n#;]+))", re.M)


@dataclass
class Import:
    line: int
    module: str  # as written: "..pkg.mod", "distributed", ". name"
    resolved: str | None  # the tree file it names (tree-relative), or None
    found: bool  # resolves somewhere (the tree, the stdlib, this environment)
    in_tree: bool  # the failure is one the tree alone decides (a relative import, a dotted import into a tree package)


@dataclass
class TreeImports:
    root: Path
    edges: dict[str, set[str]] = field(default_factory=dict)  # file -> tree files it imports
    broken: dict[str, list[Import]] = field(default_factory=dict)  # file -> imports that resolve to nothing

    def reach(self, starts: set[str]) -> set[str]:
        """``starts`` and every tree file they import, transitively."""
        seen, todo = set(starts), list(starts)
        while todo:
            for nxt in self.edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen


def read_imports(root: Path, texts: dict[str, str]) -> TreeImports:
    """Every tree file's imports of other tree files, and the unconditional module-level imports that resolve to nothing."""
    out = TreeImports(root)
    finder = _Finder(root, set(texts))
    for rel, text in texts.items():
        if "import" not in text:
            continue
        edges: set[str] = set()
        suspects: list[Import] = []
        for m in _IMPORT.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            for imp in finder.resolve(rel, m, line):
                if imp.resolved:
                    edges.add(imp.resolved)
                elif not imp.found:
                    suspects.append(imp)
        out.edges[rel] = edges - {rel}
        if suspects:
            confirmed = _confirm(text, suspects)
            if confirmed:
                out.broken[rel] = confirmed
    return out


class _Finder:
    def __init__(self, root: Path, files: set[str]) -> None:
        self.root = root
        self.files = files
        #: the folders that hold a file of the run (anything else, a file left out or the runtime, is looked up on disk)
        self.folders = {str(PurePosixPath(f).parent) for f in files}
        self._exists: dict[tuple, str | bool] = {}
        self._installed: dict[str, bool] = {}
        here = {"", ".", os.getcwd()}
        self._path = [p for p in sys.path if p not in here and Path(p).resolve() != root]

    def exists(self, folder: PurePosixPath, dotted: str) -> str | bool:
        """The tree file ``dotted`` names under ``folder`` (``a/b.py`` or ``a/b/__init__.py``), True for a folder
        without ``__init__`` (a namespace package), else False."""
        key = (folder, dotted)
        if key not in self._exists:
            rel = PurePosixPath(folder, *dotted.split("."))
            found: str | bool = False
            for candidate in (f"{rel}.py", f"{rel}/__init__.py"):
                if candidate in self.files or (self.root / candidate).is_file():
                    found = candidate
                    break
            self._exists[key] = found or str(rel) in self.folders or (self.root / rel).is_dir()
        return self._exists[key]

    def installed(self, top: str) -> bool:
        if top not in self._installed:
            import importlib.machinery

            found = top in sys.builtin_module_names or top in getattr(sys, "stdlib_module_names", ())
            if not found:
                try:
                    found = importlib.machinery.PathFinder.find_spec(top, self._path) is not None
                except (ImportError, ValueError):
                    found = False
            self._installed[top] = found
        return self._installed[top]

    def roots(self, rel: str) -> list[PurePosixPath]:
        """Where an absolute import of ``rel`` looks in the tree: its script folder, the folder above its package, the root, src/."""
        folder = PurePosixPath(rel).parent
        above = folder
        while str(above) not in ("", ".") and f"{above}/__init__.py" in self.files:
            above = above.parent
        return list(dict.fromkeys([folder, above, PurePosixPath("."), PurePosixPath("src")]))

    def resolve(self, rel: str, m: re.Match, line: int) -> list[Import]:
        if m.group("plain") is not None:
            mods = [part.split(" as ")[0].strip() for part in m.group("plain").split(",")]
            return [self._absolute(rel, mod, line) for mod in mods if re.fullmatch(r"[\w.]+", mod)]
        dots, mod = m.group("dots"), m.group("mod")
        if not dots:
            return [self._absolute(rel, mod, line)] if mod else []
        base = PurePosixPath(rel).parent
        for _ in range(len(dots) - 1):
            if str(base) in ("", "."):
                return []  # above the tree's root: not the tree's to judge
            base = base.parent
        if mod:
            if mod.split(".")[0] == RUNTIME_MODULE:
                return []
            hit = self.exists(base, mod)
            return [Import(line, dots + mod, hit if isinstance(hit, str) else None, bool(hit), True)]
        out = []
        names = [n.split(" as ")[0].strip() for n in m.group("names").strip("()").replace("\n", " ").split(",")]
        init = self.root / base / "__init__.py"
        init_text = init.read_text(encoding="utf-8", errors="replace") if init.is_file() else ""
        for name in (n for n in names if re.fullmatch(r"\w+", n) and n != RUNTIME_MODULE):
            hit = self.exists(base, name)
            found = bool(hit) or re.search(rf"\b{re.escape(name)}\b", init_text) is not None
            out.append(Import(line, f"{dots}{name}", hit if isinstance(hit, str) else None, found, True))
        return out

    def _absolute(self, rel: str, mod: str, line: int) -> Import:
        top = mod.split(".")[0]
        if top == RUNTIME_MODULE:
            return Import(line, mod, None, True, False)
        for folder in self.roots(rel):
            hit = self.exists(folder, top)
            if hit:
                full = self.exists(folder, mod) if "." in mod else hit
                if full:
                    return Import(line, mod, full if isinstance(full, str) else None, True, True)
                if not isinstance(hit, str) or hit.endswith("__init__.py"):
                    return Import(line, mod, None, False, True)  # the package is the tree's, the module is not in it
        return Import(line, mod, None, self.installed(top), False)


def _confirm(text: str, suspects: list[Import]) -> list[Import]:
    """The suspects that are unconditional module-level imports: written at column 0 (an import under ``try``, ``if``,
    ``with`` or ``def`` is indented) and not inside a triple-quoted string (an even count of them before it)."""
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    out = []
    for imp in suspects:
        at = starts[imp.line - 1] if imp.line - 1 < len(starts) else len(text)
        if text[at:at + 1] not in ("i", "f"):
            continue
        before = text[:at]
        if (before.count('"""') + before.count("'''")) % 2 == 0:
            out.append(imp)
    return out
