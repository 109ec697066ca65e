"""A recipe as one LibCST command, for ``python -m libcst.tool codemod``.

Every step is a ``VisitorBasedCodemodCommand``; this runs a recipe's steps in order the
way LibCST's own tool runs codemods (each step a full ``transform_module``: a copy of the
tree for its metadata, its metadata, one traversal, then LibCST's import visitors), with
no prefilter. benchmarks/bench_engine.py times it against ``ddpatch diff`` on the same
tree. Sites, statuses and the provenance line are ddpatch's, so the output differs from
``ddpatch diff`` by those lines only.

    python -m libcst.tool codemod -x patcher.engine.codemods.libcst_recipe.QwenRecipe --no-format -u 3 PATH
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Generator, Type

from libcst.codemod import Codemod, CodemodContext, MagicArgsCodemodCommand

from ..recipe import load_recipe
from . import CODEMODS
from .base import IN_PACKAGE


class RecipeCommand(MagicArgsCodemodCommand):
    DESCRIPTION = "Run the steps of a ddpatch recipe, in order, as LibCST codemods."

    @staticmethod
    def add_args(arg_parser: argparse.ArgumentParser) -> None:
        arg_parser.add_argument("--recipe", dest="recipe", default="qwen3_6-gdn", help="A built-in recipe name or a recipe .toml.")

    def __init__(self, context: CodemodContext, recipe: str = "qwen3_6-gdn") -> None:
        super().__init__(context)
        self.recipe = load_recipe(recipe)

    def get_transforms(self) -> Generator[Type[Codemod], None, None]:
        filename = self.context.filename
        # the engine's rule: inside a package the runtime is imported relatively
        self.context.scratch[IN_PACKAGE] = bool(filename) and os.path.exists(os.path.join(os.path.dirname(filename), "__init__.py"))
        for spec in self.recipe.steps:
            yield functools.partial(CODEMODS[spec.codemod], **spec.params)


class QwenRecipe(RecipeCommand):
    DESCRIPTION = "Run the qwen3_6-gdn recipe's steps as LibCST codemods."

    @staticmethod
    def add_args(arg_parser: argparse.ArgumentParser) -> None:
        pass

    def __init__(self, context: CodemodContext) -> None:
        super().__init__(context, "qwen3_6-gdn")
