"""``ddpatch env``: where this environment stands against ddpatch's tested versions (a command of the group)."""

from __future__ import annotations

import sys

import click

from .. import api
from ..report.console import print_json
from ..results import EXIT_FAILED, EXIT_OK
from .base import FORMAT, friendly


@click.command("env", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--strict", is_flag=True, help="Exit 1 when a required package is outside the tested range or missing.")
@FORMAT
@friendly
def env(strict: bool, fmt: str) -> None:
    """Versions and device, each against the range ddpatch was tested on.

    Python, torch, transformers, accelerate, libcst, the optional kernels (fla, causal-conv1d,
    flash-attn: installed or not) and the device (cpu, or the CUDA device's name).

    The tested transformers range and the policy for widening it: docs/transformers.md.
    Exit 0; with --strict, 1 when a required package is outside the tested range.
    """
    from ..env import environment_text  # torch is imported here, for the device, never at start-up

    info = api.env()
    code = EXIT_FAILED if strict and not info["inside_tested_range"] else EXIT_OK
    if fmt == "json":
        print_json({"command": "env", **info, "exit_code": code})
    else:
        click.echo(environment_text(info), nl=False)
    sys.exit(code)
