"""How a patched module imports the runtime copied beside it: it depends on how the module itself is imported.

The runtime goes next to each file that calls it (``_ddpatch_runtime/`` in the file's folder). A module of a
regular package (its folder has ``__init__.py``) is imported as ``pkg.mod``: it needs ``from . import
_ddpatch_runtime``; so is a module at the root of a tree that is itself a package (``site-packages/dflash``: its
root has ``__init__.py``), which ``ddpatch verify`` imports as that package (``dflash.model``). A script or a module
at the root of any other tree is imported with its folder on ``sys.path``: ``import _ddpatch_runtime``. A folder without ``__init__.py`` below the root (a namespace package) can be either:

* a module there that uses relative imports can only be imported as ``pkg.mod``: relative;
* any other may be imported as ``pkg.mod`` (by the tree, ``import pkg.mod``, ``from pkg import mod``, a
  sibling's relative import; by a user's notebook; by ``ddpatch verify``, which imports every decoder from the
  tree's root) or run as a script from its folder: ``BOTH``, written as ``try: from . import _ddpatch_runtime``
  / ``except ImportError: import _ddpatch_runtime`` (run as a script, the relative import raises ImportError).

Read with a regular expression over the texts already in memory; nothing is imported.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

#: ``in_package`` for a module that may be imported both ways (see the module docstring).
BOTH = "both"

_RELATIVE = re.compile(r"^[ \t]*from[ \t]+\.", re.M)


def package_modes(root: Path, texts: dict[str, str]) -> dict[str, object]:
    """Tree-relative path -> the ``in_package`` its runtime import is written with: True, False or ``BOTH``."""
    modes: dict[str, object] = {}
    for rel in texts:
        path = PurePosixPath(rel)
        if (root / path.parent / "__init__.py").exists():
            modes[rel] = True
        elif str(path.parent) in ("", ".") or path.suffix != ".py":
            modes[rel] = False
        elif _RELATIVE.search(texts[rel]):
            modes[rel] = True
        else:  # a folder without __init__.py below the root: imported as pkg.mod or run as a script
            modes[rel] = BOTH
    return modes
