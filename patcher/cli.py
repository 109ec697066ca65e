"""The ``ddpatch`` command line: click only. Each command calls ``patcher.api`` and renders the
result object it returns with ``patcher.report``; nothing imports this module.

Exit codes, for every command:
  0  done, nothing pending
  1  changes pending (``check``, ``diff``), a verify check failed, or (``ci``, as CI tools
     report failures) a step no longer matches at the newest commit
  2  a recipe step no longer matches (``apply``/``diff``/``check``), a skipped file, bad input,
     or an error (one line on stderr says which)
  3  an internal error of ddpatch (the verifier crashed): not a verdict on the tree
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from . import __version__, api
from .report.console import file_progress as _progress
from .report.console import print_json, verify_progress
from .report.diff import diff_stat, diff_text, print_diff
from .report.formats import CI_FORMATS, render_ci_as
from .report.json_report import apply_payload, error_payload, patch_payload, recipe_payload, recipes_payload, revert_payload, verify_payload
from .report.text import (apply_error_lines, apply_text, check_text, demo_text, error_lines, print_summary, recipe_text, recipes_text,
                           render_verify, revert_text)
from .results import EXIT_ERROR, EXIT_FAILED, EXIT_INTERNAL, EXIT_OK
from .verify.presets import PRESETS  # the names only: torch is not imported

EXIT_PENDING = EXIT_FAILED  # changes pending, or a verify check failed
FORMAT = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True, help="Output format.")


class Failure(click.ClickException):
    exit_code = EXIT_ERROR

    def show(self, file=None) -> None:
        click.echo(f"ddpatch: error: {self.format_message()}", err=True)


def _wants_json(argv: list[str]) -> bool:
    return "--format=json" in argv or any(a == "--format" and b == "json" for a, b in zip(argv, argv[1:]))


class Main(click.Group):
    """The ``ddpatch`` group: every error, click's usage errors included, is one ``ddpatch: error:`` line.

    With ``--format json`` an error also prints a JSON object on stdout (``command``,
    ``error``, ``exit_code``), so that a script always gets one.
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `ddpatch`: the help is the answer
                exc.show()
                sys.exit(exc.exit_code)
            message = exc.format_message()
            if isinstance(exc, click.UsageError) and exc.ctx is not None:
                message += f" (see `{exc.ctx.command_path} --help`)"
            if _wants_json(argv):
                command = next((a for a in argv if a in self.commands), None)
                print_json(error_payload(command, message, exc.exit_code))
            click.echo(f"ddpatch: error: {message}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("ddpatch: error: aborted", err=True)
            sys.exit(EXIT_ERROR)
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)


def friendly(fn):
    """Turn known errors into one clear line and exit code 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except api.INPUT_ERRORS as exc:
            raise Failure(str(exc)) from None
        except OSError as exc:  # e.g. a full disk while writing: one line, not a traceback
            where = f": {exc.filename}" if exc.filename else ""
            raise Failure(f"{exc.strerror or exc}{where}") from None

    return wrapper


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddpatch")
def main() -> None:
    """Compatibility recipes for speculative-decoding research code, and a verifier that proves them lossless.

    \b
    ddpatch recipes list
    ddpatch diff  --recipe qwen3_6-gdn path/to/ddtree
    ddpatch apply --recipe qwen3_6-gdn path/to/ddtree --out patched/
    ddpatch verify patched/
    """


# ----------------------------------------------------------------------------- recipes
@main.group()
def recipes() -> None:
    """List the built-in recipes or show one."""


@recipes.command("list")
@FORMAT
@friendly
def recipes_list(fmt: str) -> None:
    """The known recipes, one line each."""
    items = api.recipes()
    if fmt == "json":
        print_json(recipes_payload(items))
    else:
        click.echo(recipes_text(items), nl=False)


@recipes.command("show")
@click.argument("name")
@FORMAT
@friendly
def recipes_show(name: str, fmt: str) -> None:
    """A recipe's steps: what each matches and writes, with an example of each."""
    recipe, docs = api.recipe_docs(name)
    if fmt == "json":
        print_json(recipe_payload(recipe, docs))
    else:
        click.echo(recipe_text(recipe, docs), nl=False)


# ----------------------------------------------------------------------------- apply / diff / check
def _options(*options):
    """One decorator that adds ``options`` in the order given."""
    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


recipe_options = _options(
    click.option("--recipe", "recipe_name", required=True, help="A built-in recipe name or a path to a recipe .toml."),
    click.option("--select", default=None, help="Only these step ids (comma-separated)."),
    click.option("--ignore", default=None, help="Skip these step ids (comma-separated)."),
    click.option("--upstream", default=None, help="Treat the tree as this upstream layout instead of detecting it."),
    click.option("--jobs", "-j", type=int, default=0, help="Parallel worker processes (default: number of CPUs)."),
    click.option("-v", "--verbose", is_flag=True, help="List every site."),
    FORMAT,
)


def _run(command, recipe_name, path, select, ignore, upstream, jobs, **options):
    """``api.check``/``api.diff``/``api.apply`` with a progress bar on a terminal."""
    with _progress(command) as progress:
        return getattr(api, command)(path, recipe_name, select=select, ignore=ignore, upstream=upstream, jobs=jobs,
                                     progress=progress, **options)


def _report_errors(lines: list[str]) -> None:
    """One ``ddpatch: error:`` line on stderr per failure, the cause (a skipped file) first."""
    for line in lines:
        click.echo(f"ddpatch: error: {line}", err=True)


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@recipe_options
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write a patched copy of the tree here; the original is untouched.")
@click.option("--force", is_flag=True, help="With --out: write into a folder that is not empty.")
@click.option("--allow-partial", is_flag=True, help="Write the steps that matched even if some step is no-match.")
@click.option("--diff", "show_diff", is_flag=True, help="Also print the unified diff of what was written.")
@friendly
def apply(path, recipe_name, select, ignore, upstream, jobs, verbose, fmt, out, force, allow_partial, show_diff) -> None:
    """Rewrite PATH in place (or into --out DIR) with a recipe.

    Re-running on a patched tree changes nothing and reports every step as
    already-applied. A no-match step, or a file that is skipped (it cannot be read,
    parsed or, in place, written), stops the run before anything is written, unless
    --allow-partial; its sites are then reported `pending` or `skipped`. In-place writes
    are atomic and journalled: `ddpatch revert PATH` undoes them.

    Exit 0: done (or nothing to do); 2: a step is no-match, a file was skipped, or bad
    input (one `ddpatch: error:` line on stderr for each).
    """
    result = _run("apply", recipe_name, path, select, ignore, upstream, jobs, out=out, force=force, allow_partial=allow_partial)
    code = result.report.exit_code(pending=False)
    if fmt == "json":
        print_json(apply_payload(result, code))
    else:
        print_summary(result.report, "apply", verbose)
        if show_diff:
            print_diff(result.report)
        click.echo(apply_text(result), nl=False)
    _report_errors(error_lines(result.report) + apply_error_lines(result))
    sys.exit(code)


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@recipe_options
@click.option("--stat", is_flag=True, help="Print a diffstat instead of the diff.")
@click.option("--color", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True)
@friendly
def diff(path, recipe_name, select, ignore, upstream, jobs, verbose, fmt, stat, color) -> None:
    """Print the unified diff that apply would write; writes nothing.

    Exit 0: no changes; 1: changes; 2: a step is no-match or a file was skipped.
    """
    report = _run("diff", recipe_name, path, select, ignore, upstream, jobs)
    code = report.exit_code(pending=True)
    if fmt == "json":
        print_json(patch_payload(report, "diff", code, diff=diff_text(report)))
    elif stat:
        click.echo(diff_stat(report), nl=False)
    else:
        print_diff(report, color)
    _report_errors(error_lines(report))
    sys.exit(code)


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@recipe_options
@friendly
def check(path, recipe_name, select, ignore, upstream, jobs, verbose, fmt) -> None:
    """Report each step's status; writes nothing. A site apply would rewrite is `pending`.

    Exit 0: nothing to do; 1: changes pending; 2: a step no longer matches, a file was
    skipped, or an error.
    """
    report = _run("check", recipe_name, path, select, ignore, upstream, jobs)
    code = report.exit_code(pending=True)
    if fmt == "json":
        print_json(patch_payload(report, "check", code))
    else:
        print_summary(report, "check", verbose)
        click.echo(check_text(report), nl=False)
    _report_errors(error_lines(report))
    sys.exit(code)


def _ints(value: str | None, minimum: int | None = None, flag: str = "") -> list[int] | None:
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=flag or None) from None
    if not out:
        raise click.BadParameter(f"expected at least one integer, got {value!r}", param_hint=flag or None)
    if minimum is not None and any(v < minimum for v in out):
        raise click.BadParameter(f"every value must be >= {minimum}, got {value!r}", param_hint=flag or None)
    return out


verify_options = _options(
    click.option("--preset", "presets", multiple=True, type=click.Choice(sorted(PRESETS)), help="Built-in tiny model (repeatable). Default: tiny-qwen3_5."),
    click.option("--target", type=click.Path(path_type=Path), default=None, help="A local target model folder (from_pretrained, offline)."),
    click.option("--draft", type=click.Path(path_type=Path), default=None, help="A local draft model folder for the tree's DFlashDraftModel."),
    click.option("--scripted-draft", is_flag=True,
                 help="Script the draft's proposals from the target's greedy continuation (true token at rank 0, 1 or "
                      "nowhere), as the presets do. With --target alone, a draft that fits the target is built from "
                      "the tree's own DFlashDraftModel; with --draft, the real drafter's proposals are scripted."),
    click.option("--device-map", default=None, help="accelerate device_map for real models, e.g. auto."),
    click.option("--dtype", default=None, help="torch dtype for real models (default bfloat16)."),
    click.option("--attn-implementation", default=None, help="Target attention implementation (default sdpa)."),
    click.option("--trust-remote-code", is_flag=True, help="Allow model code from the model folder (off by default)."),
    click.option("--seeds", default=None, help="Comma-separated seeds (default 0,1)."),
    click.option("--prompts", type=click.IntRange(min=1), default=None, help="Prompts per seed (default 2)."),
    click.option("--max-new-tokens", type=click.IntRange(min=1), default=None, help="New tokens per prompt (default 32)."),
    click.option("--block-size", type=click.IntRange(min=2), default=None, help="Draft block size, >= 2 (default 4)."),
    click.option("--tree-budgets", default=None, help="DDTree node budgets, comma-separated, each >= 1 (default 4,8)."),
    click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
                 help="Seconds before the verifier is stopped (> 0)."),
)


def _verify_options(presets, target, draft, scripted_draft, trust_remote_code, seeds, tree_budgets, **rest) -> dict:
    """``verify_options``' values as ``api.verify`` options (None: the verifier's default)."""
    return dict(presets=list(presets) or None, target=str(target) if target else None, draft=str(draft) if draft else None,
                scripted_draft=scripted_draft or None, trust_remote_code=trust_remote_code or None,
                seeds=_ints(seeds, 0, "--seeds"), tree_budgets=_ints(tree_budgets, 1, "--tree-budgets"), **rest)


def _verify_and_report(tree: Path, fmt: str, timeout: float, options: dict) -> int:
    try:
        with verify_progress(show=fmt != "json") as progress:
            outcome = api.verify(tree, timeout=timeout, progress=progress, **options)
    except api.VerifyError as exc:
        return _verify_failed(fmt, str(exc), exc.exit_code)
    code = EXIT_OK if outcome.passed else EXIT_PENDING
    try:
        if fmt == "json":
            print_json(verify_payload(outcome, code))
        else:
            render_verify(outcome)
    except Exception as exc:  # a bug of ours must not read as a verdict on the tree
        return _verify_failed(fmt, f"internal error: rendering the report failed: {type(exc).__name__}: {exc}", EXIT_INTERNAL)
    return code


def _verify_failed(fmt: str, message: str, code: int) -> int:
    """One ``ddpatch: error:`` line on stderr (and a JSON object on stdout with --format json)."""
    if fmt == "json":
        print_json(error_payload("verify", message, code, passed=False))
    click.echo(f"ddpatch: error: {message}", err=True)
    return code


sampling_options = _options(
    click.option("--temperature", type=click.FloatRange(min=0), default=None,
                 help="Verify sampled decoding (seeded): the logits oracle and a distributional test judge it. Default 0: greedy."),
    click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None, help="Nucleus sampling, with --temperature (only decoders that take top_p run)."),
    click.option("--top-k", type=click.IntRange(min=1), default=None, help="Top-k sampling, with --temperature (only decoders that take top_k run)."),
    click.option("--sampling-runs", type=click.IntRange(min=0), default=None, help="Seeded runs of the distributional test (default 200; 0: off)."),
    click.option("--default-init", is_flag=True, help="Keep transformers' default init of the presets' state parameters (a weaker test: for controls)."),
    click.option("--logit-tolerance", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Largest |logit difference| the logits oracle allows (default per dtype: float32 1e-4, bfloat16 0.25, float16 0.05)."),
)


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@verify_options
@sampling_options
@FORMAT
@friendly
def verify(path, timeout, temperature, top_p, top_k, sampling_runs, default_init, logit_tolerance, fmt, **verify_options) -> None:
    """Prove a patched tree decodes losslessly: speculative greedy output must equal the target's greedy.

    Loads the tree's own dflash_generate / ddtree_generate / DFlashDraftModel in a child
    process, warms up, runs a short benchmark (DFlash and DDTree at each tree budget)
    and checks token identity, the logits the decoder used against one from-scratch
    forward, the reference decoder's own consistency, acceptance lengths and speed. With
    --temperature it decodes sampled and seeded, and adds a distributional test. Exit 0
    only if every check passed; 1 if a check failed; 2 on bad input or a timeout; 3 if
    the verifier itself crashed.

    \b
    ddpatch verify patched/                          # tiny hybrid preset, CPU
    ddpatch verify patched/ --preset tiny-qwen3_5-vlm
    ddpatch verify patched/ --target /models/Qwen3.6-27B --draft /models/Qwen3.6-27B-DFlash --device-map auto --dtype bfloat16
    ddpatch verify patched/ --target /models/Qwen3.6-27B --scripted-draft    # prove the rollback before any drafter exists
    """
    options = _verify_options(**verify_options)
    if (top_p is not None or top_k is not None) and not temperature:
        raise Failure("--top-p and --top-k need --temperature > 0")
    options.update(temperature=temperature, top_p=top_p, top_k=top_k, sampling_runs=sampling_runs, default_init=default_init or None,
                   logit_tolerance=logit_tolerance)
    sys.exit(_verify_and_report(path, fmt, timeout, options))


@main.command()
@click.option("--upstream", type=click.Choice(["ddtree", "dflash"]), default="ddtree", show_default=True, help="Which built-in upstream-shaped tree to patch.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Keep the patched tree here (default: a temporary folder).")
@click.option("--no-verify", is_flag=True, help="Only patch and show the diff.")
@verify_options
@friendly
def demo(upstream, out, no_verify, timeout, **verify_options) -> None:
    """The main job on the embedded default: patch the built-in upstream-shaped code, show the diff, verify it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ddpatch-demo-") as tmp:
        report = api.patch_builtin(upstream, out or Path(tmp) / upstream)
        print_summary(report, "apply")
        print_diff(report, created=False)
        click.echo(demo_text(report, upstream, kept=out is not None), nl=False)
        if report.no_match:
            sys.exit(EXIT_ERROR)
        if no_verify:
            return
        code = _verify_and_report(report.root, "text", timeout, _verify_options(**verify_options))
    sys.exit(code)


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Also revert files edited since the apply.")
@FORMAT
@friendly
def revert(path: Path, force: bool, fmt: str) -> None:
    """Undo the latest in-place `ddpatch apply` on PATH, byte for byte (contents and modes).

    A file edited since the apply is left alone (and nothing is restored) unless --force.
    The journals are kept outside the tree under $DDPATCH_HOME (default ~/.cache/ddpatch).

    Exit 0: restored; 2: nothing recorded for PATH, a file changed since, or bad input
    (one `ddpatch: error:` line on stderr).
    """

    restored = api.revert(path, force=force)
    if fmt == "json":
        print_json(revert_payload(str(path.resolve()), restored, EXIT_OK))
    else:
        click.echo(revert_text(restored), nl=False)


# ----------------------------------------------------------------------------- ci
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


@main.command("ci", context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option("--lock", "lock_path", type=click.Path(path_type=Path, dir_okay=False), default=None, help="The lock file for --update-lock (default: vendored/upstream.lock of this ddpatch).")
@click.option("--jobs", "-j", type=int, default=1, show_default=True, help="Worker processes per commit for the recipe engine.")
@click.option("--print-workflow", is_flag=True, help="Print a GitHub Actions workflow that runs this on a schedule, and exit.")
def ci(recipe_name, repo, rev, since, upstream, all_commits, do_verify, presets, seeds, prompts, max_new_tokens, block_size,
       tree_budgets, verify_timeout, fmt, junit_file, sarif_file, json_file, hunk_lines, update_lock, lock_path, jobs, print_workflow) -> None:
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
    if not recipe_name:
        raise Failure("--recipe is required (a built-in recipe name or a .toml path)")
    if repo is None:
        raise Failure("--repo is required (the upstream git repository to check)")
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


if __name__ == "__main__":  # pragma: no cover
    main()
