"""``ddpatch ci``: re-verify a recipe against upstream commits (a command of the ``ddpatch`` group)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .. import api
from ..report.formats import CI_FORMATS, render_ci_as
from .base import Failure, configured, friendly

def _ci_ints(value: str | None, flag: str) -> list[int] | None:
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise Failure(f"{flag}: expected comma-separated integers, got {value!r}") from None
    if not out or any(v < 0 or flag == "--tree-budgets" and v < 1 for v in out):
        raise Failure(f"{flag}: expected comma-separated integers >= {1 if flag == '--tree-budgets' else 0}, got {value!r}")
    return out


@click.command("ci", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--recipe", "recipe_name", default=None, help="A built-in recipe name or a path to a recipe .toml.")
@click.option("--repo", type=click.Path(path_type=Path), default=None, help="The upstream git repository (a clone or a bare repository); read only.")
@click.option("--rev", default="HEAD", show_default=True, help="The newest commit to check (any commit-ish).")
@click.option("--since", default=None, help="Also check every commit after this known-good one, up to --rev; it is the baseline.")
@click.option("--upstream", default=None, help="Treat every commit as this upstream layout instead of detecting it.")
@click.option("--all-commits", is_flag=True, help=f"Evaluate every commit of the range (default: bisect ranges of more than {api.BISECT_THRESHOLD}).")
@click.option("--verify", "do_verify", is_flag=True, help="Also run `ddpatch verify` on each evaluated commit's patched tree.")
@click.option("--preset", "presets", multiple=True, help="With --verify: built-in tiny model (repeatable; default tiny-qwen3_5).")
@click.option("--seeds", default=None, help="With --verify: comma-separated seeds.")
@click.option("--prompts", type=click.IntRange(min=1), default=None, help="With --verify: prompts per seed.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None, help="With --verify: new tokens per prompt.")
@click.option("--block-size", type=click.IntRange(min=2), default=None, help="With --verify: draft block size.")
@click.option("--tree-budgets", default=None, help="With --verify: DDTree node budgets, comma-separated.")
@click.option("--verify-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True, help="With --verify: seconds per commit before the verifier is stopped.")
@click.option("--format", "fmt", type=click.Choice(list(CI_FORMATS)), default="text", show_default=True, help="Output format (stdout).")
@click.option("--junit-file", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Also write the JUnit XML report here.")
@click.option("--sarif-file", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Also write the SARIF 2.1.0 report here.")
@click.option("--json-file", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Also write the JSON report here.")
@click.option("--hunk-lines", type=int, default=api.HUNK_LINES, show_default=True, help="Lines of upstream diff shown per change (0: all).")
@click.option("--update-lock", is_flag=True, help="When the run is green, record --rev as last_verified for its upstream in the lock file.")
@click.option("--lock", "lock_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The lock file for --update-lock (default: ddpatch-upstream.lock in the working folder, your fork; created if missing).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True, help="Worker processes per commit for the recipe engine (>= 1).")
@click.option("--config", "config_file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Read settings from this file instead of the nearest ddpatch.toml / pyproject.toml [tool.ddpatch] of the working folder.")
@click.option("--isolated", is_flag=True, help="Read no config file.")
@click.option("--print-workflow", is_flag=True, help="Print a GitHub Actions workflow that runs this on a schedule, and exit.")
@friendly
def ci(recipe_name, repo, rev, since, upstream, all_commits, do_verify, presets, seeds, prompts, max_new_tokens, block_size,
       tree_budgets, verify_timeout, fmt, junit_file, sarif_file, json_file, hunk_lines, update_lock, lock_path, jobs, config_file, isolated,
       print_workflow) -> None:
    """Re-verify a recipe against upstream commits: per commit and step, applied / already-applied /
    fixed-upstream / no-match, and the first commit at which each step's status changed.

    Each commit is read from the repository's object store into a temporary tree; the
    repository, its checkout and its index are never written. The exit status is judged on
    --rev: 0 every step matches (and verify passed); 1 a step is no-match or verify failed;
    2 bad input or a repository that cannot be read.

    \b
    ddpatch ci --recipe qwen3_6-gdn --repo ../dflash --rev main
    ddpatch ci --recipe qwen3_6-gdn --repo ../dflash --since 44947fb
    ddpatch ci --recipe qwen3_6-gdn --repo ../ddtree --since dafc3b9 --verify --preset tiny-qwen3_5
    ddpatch ci --recipe qwen3_6-gdn --repo ../ddtree --format junit > results.xml
    ddpatch ci --print-workflow > .github/workflows/ddpatch-upstream-ci.yml
    """
    if print_workflow:
        click.echo(api.workflow_template(), nl=False)
        return
    if repo is None:
        raise Failure("--repo is required (the upstream git repository to check)")
    given = [flag for flag, value in (("--preset", presets), ("--seeds", seeds), ("--prompts", prompts), ("--max-new-tokens", max_new_tokens),
                                      ("--block-size", block_size), ("--tree-budgets", tree_budgets)) if value]
    if given and not do_verify:
        raise Failure(f"{', '.join(given)} only apply with --verify; add --verify or leave them out")
    settings = configured(None, dict(recipe_name=recipe_name, upstream=upstream, jobs=jobs, presets=presets,
                                      config_file=config_file, isolated=isolated))
    recipe_name, upstream, jobs, presets = settings["recipe_name"], settings["upstream"], settings["jobs"], settings["presets"]
    verify_options = None
    if do_verify:
        verify_options = {k: v for k, v in dict(
            presets=list(presets) or None, seeds=_ci_ints(seeds, "--seeds"), prompts=prompts, max_new_tokens=max_new_tokens,
            block_size=block_size, tree_budgets=_ci_ints(tree_budgets, "--tree-budgets")).items() if v is not None}
    progress = (lambda line: click.echo(f"ddpatch ci: {line}", err=True)) if sys.stderr.isatty() else None
    try:
        result = api.ci(recipe_name, repo, rev=rev, since=since, upstream=upstream, verify=verify_options, verify_timeout=verify_timeout,
                        jobs=jobs, all_commits=all_commits, hunk_lines=hunk_lines, lock=lock_path, update_lock=update_lock,
                        progress=progress)
    except (api.CIError, api.RecipeError) as exc:
        raise Failure(str(exc)) from None
    for path, kind in ((junit_file, "junit"), (sarif_file, "sarif"), (json_file, "json")):
        if path is not None:
            path.write_text(render_ci_as(result, kind), encoding="utf-8")
    click.echo(render_ci_as(result, fmt), nl=False)
    sys.exit(result.exit_code)
