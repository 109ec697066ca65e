"""The ``ddpatch`` command line.

Exit codes, for every command:
  0  done, nothing pending
  1  changes pending (``check``, ``diff``), a verify check failed, or (``ci``, as CI tools
     report failures) a step no longer matches at the newest commit
  2  a recipe step no longer matches (``apply``/``diff``/``check``), a skipped file, bad input,
     or an error (one line on stderr says which)
  3  an internal error of ddpatch (the verifier crashed): not a verdict on the tree
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import sys
from pathlib import Path

import click

from . import __version__

EXIT_OK, EXIT_PENDING, EXIT_ERROR = 0, 1, 2
EXIT_INTERNAL = 3  # ddpatch itself failed (a crash of the verifier): never a verdict
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
                from .report import print_json

                command = next((a for a in argv if a in self.commands), None)
                print_json({"command": command, "error": message, "exit_code": exc.exit_code})
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
        from .engine import EngineError
        from .journal import JournalError
        from .recipe import RecipeError

        try:
            return fn(*args, **kwargs)
        except (EngineError, RecipeError, JournalError, ValueError) as exc:
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
    from .recipe import builtin_recipes, load_recipe
    from .report import print_json

    items = [load_recipe(name) for name in sorted(builtin_recipes())]
    if fmt == "json":
        print_json({"recipes": [{"name": r.name, "version": r.version, "description": r.description,
                                  "verified": r.verified, "refused": r.refused} for r in items]})
        return
    for r in items:
        click.echo(f"{r.name:<16} v{r.version}  {r.description.splitlines()[0] if r.description else ''}")
        if r.verified:
            click.echo(f"{'':<16}  verified on: " + ", ".join(f"{t} ({p})" for t, p in r.verified.items()))
        if r.refused:
            click.echo(f"{'':<16}  refused: " + ", ".join(f"{t} ({p})" for t, p in r.refused.items()))


@recipes.command("show")
@click.argument("name")
@FORMAT
@friendly
def recipes_show(name: str, fmt: str) -> None:
    """A recipe's steps: what each matches and writes, with an example of each."""
    from .codemods import CODEMODS
    from .recipe import load_recipe
    from .report import print_json

    r = load_recipe(name)
    if fmt == "json":
        steps = []
        for s in r.steps:
            cls = CODEMODS[s.codemod]
            steps.append(
                {
                    "id": s.id,
                    "codemod": s.codemod,
                    "description": cls.DESCRIPTION,
                    "why": s.why,
                    "params": {**cls.PARAMS, **s.params},
                    "anchors": {k: list(v) for k, v in s.anchors.items()},
                    "upstreams": list(s.upstreams),
                    "examples": [{"before": e.clean().before, "after": e.clean().after, "note": e.note} for e in cls.EXAMPLES],
                }
            )
        print_json({"name": r.name, "version": r.version, "transformers": r.transformers, "steps": steps,
                    "verified": r.verified, "refused": r.refused})
        return
    click.echo(f"{r.name} v{r.version} (transformers {r.transformers})")
    click.echo(r.description)
    if r.verified:
        click.echo("\nverified lossless on (model type: ddpatch verify --preset):")
        for model_type, preset in r.verified.items():
            click.echo(f"   {model_type:<18} {preset}")
    if r.refused:
        click.echo("refused in one line (model type: preset):")
        for model_type, preset in r.refused.items():
            click.echo(f"   {model_type:<18} {preset}")
    for i, s in enumerate(r.steps, 1):
        cls = CODEMODS[s.codemod]
        click.echo(f"\n{i}. {s.id}  [{s.codemod}]" + (f"  (only {', '.join(s.upstreams)})" if s.upstreams else ""))
        click.echo(f"   matches/writes: {cls.DESCRIPTION}")
        if s.why:
            click.echo("   why: " + " ".join(s.why.split()))
        for up, fns in s.anchors.items():
            click.echo(f"   anchors ({up}): {', '.join(fns)}")
        for ex in cls.EXAMPLES[:2]:
            ex = ex.clean()
            label = "example (left alone)" if ex.before == ex.after else "example"
            click.echo(f"   {label}{': ' + ex.note if ex.note else ''}")
            if ex.before == ex.after:
                click.echo(_indent(ex.before, "     | "))
            else:
                click.echo(_indent(ex.before, "     - "))
                click.echo(_indent(ex.after, "     + "))


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines())


# ----------------------------------------------------------------------------- apply / diff / check
def recipe_options(fn):
    options = [
        click.option("--recipe", "recipe_name", required=True, help="A built-in recipe name or a path to a recipe .toml."),
        click.option("--select", default=None, help="Only these step ids (comma-separated)."),
        click.option("--ignore", default=None, help="Skip these step ids (comma-separated)."),
        click.option("--upstream", default=None, help="Treat the tree as this upstream layout instead of detecting it."),
        click.option("--jobs", "-j", type=int, default=0, help="Parallel worker processes (default: number of CPUs)."),
        click.option("-v", "--verbose", is_flag=True, help="List every site."),
        FORMAT,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


#: A run over at least this many files shows a progress bar (on a terminal).
MANY_FILES = 50


@contextlib.contextmanager
def _progress(label: str):
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

                from .report import console

                bar["progress"] = stack.enter_context(Progress(console=console(sys.stderr), transient=True))
                bar["task"] = bar["progress"].add_task(label, total=total)
            bar["progress"].update(bar["task"], completed=done)

        yield update


def _run(recipe_name, path, select, ignore, upstream, jobs, label="files"):
    import os
    from dataclasses import replace

    from .engine import run_recipe
    from .recipe import RecipeError, load_recipe

    recipe = load_recipe(recipe_name)
    ids = {s.id for s in recipe.steps}
    chosen = [s for s in recipe.steps]
    for flag, value in (("--select", select), ("--ignore", ignore)):
        if value:
            names = {v.strip() for v in value.split(",") if v.strip()}
            unknown = names - ids
            if unknown:
                raise RecipeError(f"{flag}: unknown step(s) {', '.join(sorted(unknown))}; known: {', '.join(s.id for s in recipe.steps)}")
            chosen = [s for s in chosen if (s.id in names) == (flag == "--select")]
    if not chosen:
        raise RecipeError("no steps left to run after --select/--ignore")
    recipe = replace(recipe, steps=tuple(chosen))
    with _progress(label) as progress:
        return run_recipe(recipe, Path(path), upstream=upstream, jobs=jobs or os.cpu_count() or 1, progress=progress)


def _require_code(report) -> None:
    """A tree with none of the recipe's code is bad input: say so in one line."""
    if report.upstream is not None or report.changed or report.skipped:
        return
    if any(site for step in report.steps for site in step.sites):
        return
    markers = "; ".join(f"{u.name}: {', '.join(u.markers)}" for u in report.recipe.upstreams.values())
    raise Failure(
        f"no code for recipe {report.recipe.name} under {report.root}: no upstream layout detected (marker functions {markers}) "
        "and no step found a site; pass --upstream NAME to check it as that layout"
    )


def _report_errors(report) -> None:
    """One ``ddpatch: error:`` line on stderr per failure, the cause (a skipped file) first."""
    from .report import error_lines

    for line in error_lines(report):
        click.echo(f"ddpatch: error: {line}", err=True)


def _exit_code(report, pending: bool) -> int:
    if report.no_match or report.skipped:
        return EXIT_ERROR
    return EXIT_PENDING if pending and report.changed else EXIT_OK


def _payload(report, command: str, code: int, **extra) -> dict:
    return {"command": command, **report.as_dict(), "exit_code": code, **extra}


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
    from . import journal
    from .engine import mark_pending, refuse_unwritable, write_report
    from .report import print_diff, print_json, print_summary

    report = _run(recipe_name, path, select, ignore, upstream, jobs, "apply")
    _require_code(report)
    if out is None:
        refuse_unwritable(report)  # a read-only file is skipped, like one that cannot be parsed
    blocked = bool(report.no_match or report.skipped) and not allow_partial
    written: list[str] = []
    dest = None
    if blocked:
        mark_pending(report)
    else:
        base = report.root if report.root.is_dir() else report.root.parent
        if out is not None:
            dest = _prepare_out(report.root, out, force)
        elif report.changed:
            journal.record(base, {f.path: f.encoded() for f in report.changed}, report.recipe.label)
        written = write_report(report, dest)
    code = _exit_code(report, pending=False)
    if fmt == "json":
        print_json(_payload(report, "apply", code, written=written, out=str(dest) if dest else None))
    else:
        print_summary(report, "apply", verbose)
        if show_diff:
            print_diff(report)
        if written:
            click.echo(f"wrote {len(written)} file(s) under {dest or report.root}")
        elif not blocked:
            click.echo("nothing to change" + (f"; copied the tree to {dest}" if dest else ""))
    _report_errors(report)
    if blocked and report.changed:
        why = "a step is no-match" if report.no_match else "a file was skipped"
        click.echo(f"ddpatch: error: nothing written: {why}; use --allow-partial to write the rest", err=True)
    sys.exit(code)


def _prepare_out(root: Path, out: Path, force: bool, hint: str = "use --force to write into it") -> Path:
    out = out.resolve()
    if out == root or out.is_relative_to(root) and root.is_dir():
        raise ValueError(f"--out {out} must be outside the tree being patched")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} exists and is not empty ({hint})")
    if root.is_dir():
        shutil.copytree(root, out, symlinks=True, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    else:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root, out / root.name)
    return out


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
    from .engine import mark_pending
    from .report import diff_stat, diff_text, print_diff, print_json

    report = _run(recipe_name, path, select, ignore, upstream, jobs, "diff")
    _require_code(report)
    mark_pending(report)
    code = _exit_code(report, pending=True)
    if fmt == "json":
        print_json(_payload(report, "diff", code, diff=diff_text(report)))
    elif stat:
        click.echo(diff_stat(report), nl=False)
    else:
        print_diff(report, color)
    _report_errors(report)
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
    from .engine import mark_pending
    from .report import print_json, print_summary

    report = _run(recipe_name, path, select, ignore, upstream, jobs, "check")
    _require_code(report)
    mark_pending(report)
    code = _exit_code(report, pending=True)
    if fmt == "json":
        print_json(_payload(report, "check", code))
    else:
        print_summary(report, "check", verbose)
        pending = len(report.changed)
        click.echo(f"{pending} file(s) would change" if pending else "nothing to change")
    _report_errors(report)
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


def verify_options(fn):
    from .presets import PRESETS

    options = [
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
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _verify_options(presets, target, draft, scripted_draft, device_map, dtype, attn_implementation, trust_remote_code, seeds, prompts, max_new_tokens, block_size, tree_budgets):
    return dict(
        presets=list(presets) or None,
        target=str(target) if target else None,
        draft=str(draft) if draft else None,
        scripted_draft=scripted_draft or None,
        device_map=device_map,
        dtype=dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code or None,
        seeds=_ints(seeds, 0, "--seeds"),
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        tree_budgets=_ints(tree_budgets, 1, "--tree-budgets"),
    )


def _verify_and_report(tree: Path, fmt: str, timeout: float, options: dict) -> int:
    from .report import console, print_json
    from .verify import VerifyError, render, run_verify

    try:
        if fmt == "json" or not sys.stderr.isatty():
            outcome = run_verify(tree, timeout=timeout, **options)
        else:
            from rich.progress import Progress

            with Progress(console=console(sys.stderr), transient=True) as bar:
                task = bar.add_task("verify: loading", total=None)
                outcome = run_verify(
                    tree, timeout=timeout,
                    progress=lambda e: bar.update(task, completed=e["done"], total=e["total"], description=e["label"]),
                    **options,
                )
    except VerifyError as exc:
        return _verify_failed(fmt, str(exc), exc.exit_code)
    code = EXIT_OK if outcome.passed else EXIT_PENDING
    try:
        if fmt == "json":
            print_json({"command": "verify", "passed": outcome.passed, "seconds": round(outcome.seconds, 2), **outcome.result, "exit_code": code})
        else:
            render(outcome)
    except Exception as exc:  # a bug of ours must not read as a verdict on the tree
        return _verify_failed(fmt, f"internal error: rendering the report failed: {type(exc).__name__}: {exc}", EXIT_INTERNAL)
    return code


def _verify_failed(fmt: str, message: str, code: int) -> int:
    """One ``ddpatch: error:`` line on stderr (and a JSON object on stdout with --format json)."""
    from .report import print_json

    if fmt == "json":
        print_json({"command": "verify", "passed": False, "error": message, "exit_code": code})
    click.echo(f"ddpatch: error: {message}", err=True)
    return code


def sampling_options(fn):
    options = [
        click.option("--temperature", type=click.FloatRange(min=0), default=None,
                     help="Verify sampled decoding (seeded): the logits oracle and a distributional test judge it. Default 0: greedy."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None, help="Nucleus sampling, with --temperature (only decoders that take top_p run)."),
        click.option("--top-k", type=click.IntRange(min=1), default=None, help="Top-k sampling, with --temperature (only decoders that take top_k run)."),
        click.option("--sampling-runs", type=click.IntRange(min=0), default=None, help="Seeded runs of the distributional test (default 200; 0: off)."),
        click.option("--default-init", is_flag=True, help="Keep transformers' default init of the presets' state parameters (a weaker test: for controls)."),
        click.option("--logit-tolerance", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Largest |logit difference| the logits oracle allows (default per dtype: float32 1e-4, bfloat16 0.25, float16 0.05)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@verify_options
@sampling_options
@FORMAT
@friendly
def verify(path, presets, target, draft, scripted_draft, device_map, dtype, attn_implementation, trust_remote_code, seeds, prompts, max_new_tokens, block_size, tree_budgets, timeout,
           temperature, top_p, top_k, sampling_runs, default_init, logit_tolerance, fmt) -> None:
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
    options = _verify_options(presets, target, draft, scripted_draft, device_map, dtype, attn_implementation, trust_remote_code, seeds, prompts, max_new_tokens, block_size, tree_budgets)
    if (top_p is not None or top_k is not None) and not temperature:
        raise Failure("--top-p and --top-k need --temperature > 0")
    options.update(temperature=temperature, top_p=top_p, top_k=top_k, sampling_runs=sampling_runs, default_init=default_init or None,
                   logit_tolerance=logit_tolerance)
    sys.exit(_verify_and_report(path, fmt, timeout, options))


def vendored_root() -> Path:
    root = Path(__file__).resolve().parent.parent / "vendored"
    if not root.is_dir():
        raise Failure("the built-in upstream-shaped code ships with the source checkout; install ddpatch with `pip install -e .` from a clone")
    return root


@main.command()
@click.option("--upstream", type=click.Choice(["ddtree", "dflash"]), default="ddtree", show_default=True, help="Which built-in upstream-shaped tree to patch.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Keep the patched tree here (default: a temporary folder).")
@click.option("--no-verify", is_flag=True, help="Only patch and show the diff.")
@verify_options
@friendly
def demo(upstream, out, no_verify, presets, target, draft, scripted_draft, device_map, dtype, attn_implementation, trust_remote_code, seeds, prompts, max_new_tokens, block_size, tree_budgets, timeout) -> None:
    """The main job on the embedded default: patch the built-in upstream-shaped code, show the diff, verify it."""
    import tempfile

    from .engine import write_report
    from .report import print_diff, print_summary

    source = vendored_root() / upstream
    with tempfile.TemporaryDirectory(prefix="ddpatch-demo-") as tmp:
        dest = _prepare_out(source, out or Path(tmp) / upstream, force=False, hint="give --out a new or empty folder")
        report = _run("qwen3_6-gdn", dest, None, None, None, 1)
        write_report(report, dest)
        print_summary(report, "apply")
        print_diff(report, created=False)
        for f in (f for f in report.changed if f.original is None):
            click.echo(f"+ {f.path} (new file, {len((f.patched or '').splitlines())} lines: the ddpatch runtime helper)")
        where = dest if out else f"{dest} (temporary: use --out DIR to keep it)"
        click.echo(f"patched copy of vendored/{upstream} written to {where}\n")
        if report.no_match:
            sys.exit(EXIT_ERROR)
        if no_verify:
            return
        options = _verify_options(presets, target, draft, scripted_draft, device_map, dtype, attn_implementation, trust_remote_code, seeds, prompts, max_new_tokens, block_size, tree_budgets)
        code = _verify_and_report(dest, "text", timeout, options)
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
    from . import journal
    from .report import print_json

    if not path.exists():
        raise Failure(f"path does not exist: {path}")
    restored = journal.revert(path.resolve(), force=force)
    if fmt == "json":
        print_json({"command": "revert", "root": str(path.resolve()), "restored": restored, "exit_code": EXIT_OK})
    else:
        click.echo(f"restored {len(restored)} file(s)")


from .ci import ci as _ci  # noqa: E402

main.add_command(_ci)


if __name__ == "__main__":  # pragma: no cover
    main()
