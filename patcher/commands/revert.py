"""``ddpatch revert``: the latest in-place apply undone, byte for byte (a command of the ``ddpatch`` group)."""

from __future__ import annotations

from pathlib import Path

import click

from .. import api
from ..report.console import print_json
from ..report.json_report import revert_payload
from ..report.text import revert_text
from ..results import EXIT_OK
from .base import FORMAT, friendly


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Also revert files edited since the apply.")
@FORMAT
@friendly
def revert(path: Path, force: bool, fmt: str) -> None:
    """Undo the latest in-place `ddpatch apply` on PATH, byte for byte (contents and modes).

    A file edited since the apply is left alone (and nothing is restored) unless --force,
    which names each such file and keeps its edited text as <file>.orig. A journal entry
    whose path leaves the tree is refused. The journals are kept outside the tree under
    $DDPATCH_HOME (default ~/.cache/ddpatch).

    Exit 0: restored, or already reverted; 2: nothing recorded for PATH, a file changed
    since, or bad input (one `ddpatch: error:` line on stderr).
    """

    result = api.revert(path, force=force)
    if fmt == "json":
        print_json(revert_payload(str(path.resolve()), result, EXIT_OK))
    else:
        click.echo(revert_text(result), nl=False)
