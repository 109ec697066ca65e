"""Helpers shared by the CLI tests: ``run(*args)`` invokes ``ddpatch`` in process (click's runner), each
argument passed as its ``str``, exceptions not caught (an internal error fails the test with its traceback).

The journal folder a CLI test writes to is the ``journal_home`` fixture of ``tests/conftest.py`` (a file
asks for it for all its tests with ``pytestmark = pytest.mark.usefixtures("journal_home")``).
"""

from __future__ import annotations

from click.testing import CliRunner

from patcher.cli import main


def run(*args):
    """``ddpatch ARGS...`` in this process: click's ``Result`` (``exit_code``, ``output``, ``stdout``, ``stderr``)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
