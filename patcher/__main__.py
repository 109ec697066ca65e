"""``python -m patcher`` is the ``ddpatch`` command."""

from .cli import main

main(prog_name="ddpatch")
