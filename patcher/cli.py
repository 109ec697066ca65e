"""The ``ddpatch`` command line: the click group and its wiring. Each command lives in ``patcher.commands`` (one module
per command or small group), calls ``patcher.api`` and renders the result object it returns with ``patcher.report``;
nothing imports this module.

Exit codes: ``patcher.commands.base`` and docs/exit-codes.md, written down once there.
"""

from __future__ import annotations

import click

from . import __version__
from .commands.base import Main
from .commands.ci import ci
from .commands.demo import demo
from .commands.env import env
from .commands.patch import apply, check, diff
from .commands.recipes import recipes
from .commands.referee import referee
from .commands.revert import revert
from .commands.verify import verify


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddpatch")
def main() -> None:
    """Compatibility recipes for speculative-decoding research code, and a verifier that proves them lossless.

    \b
    ddpatch check path/to/ddtree
    ddpatch diff  path/to/ddtree
    ddpatch apply path/to/ddtree --out patched/
    ddpatch verify patched/

    Exit codes: 0 clean, 1 findings, 2 usage or input error, 3 internal error, 130 interrupted.
    """


for command in (recipes, apply, diff, check, verify, demo, revert, ci, env, referee):
    main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    main()
