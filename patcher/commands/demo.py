"""``ddpatch demo``: the built-in upstream-shaped code patched, its diff shown and the patched tree verified."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .. import api
from ..report.console import print_json
from ..report.diff import diff_text, print_diff
from ..report.json_report import error_payload, patch_payload, verify_payload
from ..report.text import demo_text, print_summary
from ..results import EXIT_FAILED, EXIT_OK
from .base import FORMAT, friendly
from .verify import verify_and_report, verify_kwargs, verify_options


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--upstream", type=click.Choice(["ddtree", "dflash"]), default="ddtree", show_default=True, help="Which built-in upstream-shaped tree to patch.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Keep the patched tree here (default: a temporary folder).")
@click.option("--no-verify", is_flag=True, help="Only patch and show the diff.")
@verify_options
@FORMAT
@friendly
def demo(upstream, out, no_verify, timeout, fmt, **verify_options) -> None:
    """The main job on the embedded default: patch the built-in upstream-shaped code, show the diff, verify it.

    With --format json: one object, the patch report under "patch" and verify's under "verify".
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ddpatch-demo-") as tmp:
        report = api.patch_builtin(upstream, out or Path(tmp) / upstream)
        code = EXIT_FAILED if report.no_match else EXIT_OK
        if fmt == "json":
            sys.exit(_demo_json(report, code, no_verify, timeout, verify_options))
        print_summary(report, "apply")
        print_diff(report, created=False)
        click.echo(demo_text(report, upstream, kept=out is not None), nl=False)
        if report.no_match or no_verify:
            sys.exit(code)
        code = verify_and_report(report.root, "text", timeout, verify_kwargs(**verify_options))
    sys.exit(code)


def _demo_json(report, code: int, no_verify: bool, timeout: float, verify_options: dict) -> int:
    payload = {"command": "demo", "patch": patch_payload(report, "apply", code, diff=diff_text(report, runtime=False)), "verify": None}
    if code == EXIT_OK and not no_verify:
        try:
            outcome = api.verify(report.root, timeout=timeout, **verify_kwargs(**verify_options))
        except api.VerifyError as exc:
            print_json({**payload, **error_payload("demo", str(exc), exc.exit_code)})
            click.echo(f"ddpatch: error: {exc}", err=True)
            return exc.exit_code
        code = EXIT_OK if outcome.passed else EXIT_FAILED
        payload["verify"] = verify_payload(outcome, code)
    print_json({**payload, "exit_code": code})
    return code
