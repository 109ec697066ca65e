"""``ddpatch check``, ``diff`` and ``apply``: a recipe run over a tree, reported, shown as a diff, or written (commands of
the ``ddpatch`` group; they share the progress bar and the lossy-selection check)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from .. import api
from ..report.console import file_progress, print_json
from ..report.diff import diff_stat, diff_stat_rows, diff_text, print_diff
from ..report.formats import concise_text
from ..report.json_report import apply_payload, patch_payload
from ..report.text import apply_error_lines, apply_text, check_text, error_lines, print_summary
from ..results import EXIT_FAILED
from .base import configured, friendly, lossy_line, next_step, recipe_options, report_errors


def _run(command, recipe_name, path, select, ignore, upstream, jobs, **options):
    """``api.check``/``api.diff``/``api.apply`` with a progress bar on a terminal."""
    with file_progress(command) as progress:
        return getattr(api, command)(path, recipe_name, select=select, ignore=ignore, upstream=upstream, jobs=jobs or 0,
                                     progress=progress, **options)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(path_type=Path))
@recipe_options
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write a patched copy of the tree here; the original is untouched.")
@click.option("--force", is_flag=True, help="With --out: write into a folder that is not empty.")
@click.option("--allow-partial", is_flag=True, help="Write the steps that matched even if some step is no-match.")
@click.option("--diff", "show_diff", is_flag=True, help="Also print the unified diff of what was written.")
@friendly
def apply(path, out, force, allow_partial, show_diff, **options) -> None:
    """Rewrite PATH in place (or into --out DIR) with a recipe.

    Re-running on a patched tree changes nothing and reports every step as
    already-applied. A no-match step, or a file that is skipped (it cannot be read,
    parsed or, in place, written), stops the run before anything is written, unless
    --allow-partial; its sites are then reported `pending` or `skipped`. In-place writes
    are atomic and journalled: `ddpatch revert PATH` undoes them.

    Exit 0: done (or nothing to do); 1: a step is no-match, a file was skipped, or the
    selection is lossy (nothing written); 2: bad input (one `ddpatch: error:` line).
    """
    o = configured(path, options)
    verbose, fmt, concise = o.pop("verbose"), o.pop("fmt"), o.pop("output_format") == "concise"
    result = _run("apply", o.pop("recipe_name"), path, out=out, force=force, allow_partial=allow_partial, **o)
    code = EXIT_FAILED if result.lossy and result.blocked else result.report.exit_code(pending=False)
    if fmt == "json":
        print_json({**apply_payload(result, code), "lossy": result.lossy})
    elif concise:
        click.echo(concise_text(result.report), nl=False)
    else:
        print_summary(result.report, "apply", verbose)
        if show_diff:
            print_diff(result.report)
        click.echo(apply_text(result), nl=False)
    lossy_blocked = result.lossy if result.blocked else []
    report_errors(error_lines(result.report) + lossy_line(lossy_blocked, result.report.recipe.name) + apply_error_lines(result))
    if result.lossy and not result.blocked:  # --allow-lossy: written as asked, and said once (not as an error)
        click.echo(f"ddpatch: warning: --allow-lossy: the selection leaves out {', '.join(result.lossy)}; the patched tree "
                   "decodes lossy on a hybrid model (a control, not a fix)", err=True)
    if result.written:
        what = "show that the control fails" if result.lossy else "prove the patched tree decodes losslessly"
        narrowing = "".join(f" --exclude {shlex.quote(p)}" for p in result.report.exclude)  # verify keeps it (MANIFEST.json too)
        next_step(f"ddpatch verify {shlex.quote(str(result.out or result.report.root))}{narrowing}    # {what}", fmt)
    sys.exit(code)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(path_type=Path))
@recipe_options
@click.option("--stat", is_flag=True, help="Print a diffstat instead of the diff (with --format json: a \"stat\" list).")
@click.option("--runtime-diff", is_flag=True, help="Also print the full diff of the ddpatch runtime copy (default: one line per file).")
@click.option("--color", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True)
@friendly
def diff(path, stat, runtime_diff, color, **options) -> None:
    """Print the unified diff that apply would write; writes nothing.

    Exit 0: no changes; 1: changes, a step is no-match or a file was skipped; 2: bad input.
    """
    o = configured(path, options)
    fmt, allow_lossy = o.pop("fmt"), o.pop("allow_lossy")
    o.pop("verbose"), o.pop("output_format")
    recipe_name = o.pop("recipe_name")
    report = _run("diff", recipe_name, path, **o)
    lossy = [] if allow_lossy else api.lossy_steps(report, api.load_recipe(recipe_name))
    code = EXIT_FAILED if lossy else report.exit_code(pending=True)
    if fmt == "json":
        extra = {"stat": diff_stat_rows(report)} if stat else {}
        print_json({**patch_payload(report, "diff", code, diff=diff_text(report, runtime=runtime_diff)), **extra, "lossy": lossy})
    elif stat:
        click.echo(diff_stat(report), nl=False)
    else:
        print_diff(report, color, runtime=runtime_diff)
    report_errors(error_lines(report) + lossy_line(lossy, report.recipe.name))
    sys.exit(code)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(path_type=Path))
@recipe_options
@friendly
def check(path, **options) -> None:
    """Report each step's status; writes nothing. A site apply would rewrite is `pending`.

    Exit 0: nothing to do; 1: changes pending, a step no longer matches, a file was
    skipped, or the selection is lossy; 2: bad input.
    """
    o = configured(path, options)
    verbose, fmt, concise, allow_lossy = o.pop("verbose"), o.pop("fmt"), o.pop("output_format") == "concise", o.pop("allow_lossy")
    recipe_name = o.pop("recipe_name")
    report = _run("check", recipe_name, path, **o)
    lossy = [] if allow_lossy else api.lossy_steps(report, api.load_recipe(recipe_name))
    code = EXIT_FAILED if lossy else report.exit_code(pending=True)
    if fmt == "json":
        print_json({**patch_payload(report, "check", code), "lossy": lossy})
    elif concise:
        click.echo(concise_text(report), nl=False)
    else:
        print_summary(report, "check", verbose)
        click.echo(check_text(report), nl=False)
    report_errors(error_lines(report) + lossy_line(lossy, report.recipe.name))
    if report.changed and not report.no_match and not lossy:
        suggestion = f"ddpatch diff {path}" + ("" if report.skipped else f"    then: ddpatch apply {path} --out PATCHED")
        next_step(suggestion, fmt if not concise else "json")
    sys.exit(code)
