"""Where every renderer writes: a rich console on a stream (colour only on a terminal, or when asked),
and JSON objects as one indented document."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import IO

#: A run over at least this many files shows a progress bar (on a terminal).
MANY_FILES = 50


def console(stream: IO[str] | None = None, color: str = "auto"):
    from rich.console import Console

    stream = stream or sys.stdout
    force = {"always": True, "never": False}.get(color)
    return Console(
        file=stream,
        force_terminal=force,
        no_color=(color == "never"),
        highlight=False,
        soft_wrap=True,
        width=None if (force or stream.isatty()) else 200,
    )


def print_table(con, table) -> None:
    """Print a rich table; piped, without the padding rich puts at the end of each line."""
    if con.is_terminal:
        con.print(table)
        return
    with con.capture() as captured:
        con.print(table)
    con.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def print_json(payload: dict, stream=None) -> None:
    (stream or sys.stdout).write(json.dumps(payload, indent=2) + "\n")


@contextlib.contextmanager
def file_progress(label: str):
    """A ``progress(done, total)`` callback: a transient bar on stderr once a run has many files.

    Nothing is drawn when stderr is not a terminal, so piped and JSON output stay as they are.
    """
    with contextlib.ExitStack() as stack:
        bar = {}

        def update(done: int, total: int) -> None:
            if total < MANY_FILES or not sys.stderr.isatty():
                return
            if not bar:
                from rich.progress import Progress

                bar["progress"] = stack.enter_context(Progress(console=console(sys.stderr), transient=True))
                bar["task"] = bar["progress"].add_task(label, total=total)
            bar["progress"].update(bar["task"], completed=done)

        yield update


@contextlib.contextmanager
def verify_progress(show: bool = True):
    """A callback for verify's progress events: a transient bar on stderr, only on a terminal (None otherwise)."""
    if not show or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import Progress

    with Progress(console=console(sys.stderr), transient=True) as bar:
        task = bar.add_task("verify: loading", total=None)
        yield lambda e: bar.update(task, completed=e["done"], total=e["total"], description=e["label"])
