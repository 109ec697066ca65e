"""How a patched module imports the runtime copied beside it: it depends on how the module itself is imported.

The runtime goes next to each file that calls it (``_ddpatch_runtime/`` in the file's folder). A module of a
regular package (its folder has ``__init__.py``) is imported as ``pkg.mod``: it needs ``from . import
_ddpatch_runtime``. A script or a module at the tree's root is imported with its folder on ``sys.path``: ``import
_ddpatch_runtime``. A folder without ``__init__.py`` below the root (a namespace package) can be either:

* a module there that uses relative imports can only be imported as ``pkg.mod``: relative;
* one the tree imports as ``pkg.mod`` (``import pkg.mod``, ``from pkg import mod``, ``from pkg.mod import x``,
  or a sibling's relative import) but that imports nothing relatively itself may also be run as a script:
  ``BOTH``, written as ``try: from . import _ddpatch_runtime`` / ``except ImportError: import _ddpatch_runtime``;
* anything else is a script folder: absolute, as before.

Read with a regular expression over the texts already in memory; nothing is imported.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

#: ``in_package`` for a module that may be imported both ways (see the module docstring).
BOTH = "both"

_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(?P<dots>\.*)(?P<mod>[\w.]*)[ \t]+import[ \t]+(?P<names>\([^)]*\)|[^\n#;]+)"
    r"|import[ \t]+(?P<plain>[^\n#;]+))", re.M)
_RELATIVE = re.compile(r"^[ \t]*from[ \t]+\.", re.M)


def _names(text: str) -> list[str]:
    return [n.strip().split(" as ")[0].strip() for n in text.strip("() \t\n").replace("\n", " ").split(",") if n.strip()]


def package_modes(root: Path, texts: dict[str, str]) -> dict[str, object]:
    """Tree-relative path -> the ``in_package`` its runtime import is written with: True, False or ``BOTH``."""
    modes: dict[str, object] = {}
    loose: dict[str, str] = {}  # modules of folders without __init__.py below the root -> their path without ".py"
    for rel in texts:
        path = PurePosixPath(rel)
        if (root / path.parent / "__init__.py").exists():
            modes[rel] = True
        elif str(path.parent) in ("", ".") or path.suffix != ".py":
            modes[rel] = False
        elif _RELATIVE.search(texts[rel]):
            modes[rel] = True
        else:
            loose[rel] = str(path.with_suffix(""))
    if not loose:
        return modes
    imported: set[str] = set()  # "a/b/mod" for every module some file imports as part of a package
    for rel, text in texts.items():
        if "import" not in text:
            continue
        here = PurePosixPath(rel).parent
        for m in _IMPORT.finditer(text):
            if m.group("plain") is not None:
                imported.update(n.replace(".", "/") for n in _names(m.group("plain")) if "." in n)
                continue
            dots, module = m.group("dots"), m.group("mod")
            if dots:
                base = here
                for _ in range(len(dots) - 1):
                    base = base.parent
                stem = (base / module.replace(".", "/")).as_posix() if module else base.as_posix()
            else:
                stem = module.replace(".", "/")
            names = _names(m.group("names"))
            if dots or "." in module:
                imported.add(stem)
            if dots or module:
                imported.update(f"{stem}/{n}" for n in names if n != "*")
    for rel, stem in loose.items():
        # imported as the full dotted path from the root, or from a folder below it that is on sys.path (src/)
        parts = stem.split("/")
        modes[rel] = BOTH if any("/".join(parts[i:]) in imported for i in range(len(parts) - 1)) else False
    return modes
