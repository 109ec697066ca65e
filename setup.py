"""The build step that puts the checkout's data folders into the ``patcher`` package (metadata: pyproject.toml).

A checkout keeps ``recipes/`` and ``vendored/`` at its root (docs/layout.md); a built wheel
(and the sdist it may be built from, through MANIFEST.in) carries them as ``patcher/data/recipes``
and ``patcher/data/vendored``, beside the trained pair, so that no top-level package but
``patcher`` lands in site-packages. ``patcher.shipped(name)`` finds either place. They are copied as
files, not declared as packages: the upstream-shaped trees are data that ddpatch patches, never
code it imports. An editable install (``pip install -e .``) copies nothing: the checkout's folders
are read where they are.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
#: checkout folder -> where it lies inside the built ``patcher`` package
SHIPPED = {"recipes": "patcher/data/recipes", "vendored": "patcher/data/vendored"}
#: never shipped: what running Python or an editor leaves in a checkout
IGNORED = shutil.ignore_patterns("__pycache__", "*.py[cod]", ".*")


class BuildWithShippedData(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for source, target in SHIPPED.items():
            dest = Path(self.build_lib) / target
            shutil.rmtree(dest, ignore_errors=True)  # a stale copy from an earlier build must not survive a deleted file
            shutil.copytree(ROOT / source, dest, ignore=IGNORED)


setup(cmdclass={"build_py": BuildWithShippedData})
