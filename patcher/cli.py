"""The ``ddpatch`` command line: click only. Each command calls ``patcher.api`` and renders the
result object it returns with ``patcher.report``; nothing imports this module.

Exit codes: ``patcher.commands.base`` and docs/exit-codes.md, written down once there.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from . import __version__, api
from .report.console import file_progress as _progress
from .report.console import print_json, verify_progress
from .report.diff import diff_stat, diff_stat_rows, diff_text, print_diff
from .report.formats import concise_text
from .report.json_report import apply_payload, error_payload, patch_payload, recipe_payload, recipes_payload, revert_payload, verify_payload
from .report.text import (apply_error_lines, apply_text, check_text, demo_text, error_lines, print_summary, recipe_text, recipes_text,
                           render_verify, revert_text)
from .commands.base import (EXIT_PENDING, FORMAT, Failure, Main, configured, friendly, ints, lossy_line, next_step, options,
                            recipe_options, report_errors)
from .commands.ci import ci
from .commands.env import env as env_command
from .commands.referee import referee as referee_command
from .results import EXIT_FAILED, EXIT_INTERNAL, EXIT_OK
from .verify.models.presets import PRESETS  # the names only: torch is not imported

# the short names the commands below use
_options, _ints, _configured, _report_errors, _lossy_line, _next_step = options, ints, configured, report_errors, lossy_line, next_step


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddpatch")
def main() -> None:
    """Compatibility recipes for speculative-decoding research code, and a verifier that proves them lossless.

    \b
    ddpatch check path/to/ddtree
    ddpatch diff  path/to/ddtree
    ddpatch apply path/to/ddtree --out patched/
    ddpatch verify patched/

    Exit codes: 0 clean, 1 findings, 2 usage or input error, 3 internal error, 130 interrupted.
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
def _run(command, recipe_name, path, select, ignore, upstream, jobs, **options):
    """``api.check``/``api.diff``/``api.apply`` with a progress bar on a terminal."""
    with _progress(command) as progress:
        return getattr(api, command)(path, recipe_name, select=select, ignore=ignore, upstream=upstream, jobs=jobs or 0,
                                     progress=progress, **options)


@main.command()
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
    o = _configured(path, options)
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
    _report_errors(error_lines(result.report) + _lossy_line(lossy_blocked, result.report.recipe.name) + apply_error_lines(result))
    if result.lossy and not result.blocked:  # --allow-lossy: written as asked, and said once (not as an error)
        click.echo(f"ddpatch: warning: --allow-lossy: the selection leaves out {', '.join(result.lossy)}; the patched tree "
                   "decodes lossy on a hybrid model (a control, not a fix)", err=True)
    if result.written:
        what = "show that the control fails" if result.lossy else "prove the patched tree decodes losslessly"
        narrowing = "".join(f" --exclude {shlex.quote(p)}" for p in result.report.exclude)  # verify keeps it (MANIFEST.json too)
        _next_step(f"ddpatch verify {shlex.quote(str(result.out or result.report.root))}{narrowing}    # {what}", fmt)
    sys.exit(code)


@main.command()
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
    o = _configured(path, options)
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
    _report_errors(error_lines(report) + _lossy_line(lossy, report.recipe.name))
    sys.exit(code)


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@recipe_options
@friendly
def check(path, **options) -> None:
    """Report each step's status; writes nothing. A site apply would rewrite is `pending`.

    Exit 0: nothing to do; 1: changes pending, a step no longer matches, a file was
    skipped, or the selection is lossy; 2: bad input.
    """
    o = _configured(path, options)
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
    _report_errors(error_lines(report) + _lossy_line(lossy, report.recipe.name))
    if report.changed and not report.no_match and not lossy:
        suggestion = f"ddpatch diff {path}" + ("" if report.skipped else f"    then: ddpatch apply {path} --out PATCHED")
        _next_step(suggestion, fmt if not concise else "json")
    sys.exit(code)


verify_options = _options(
    click.option("--preset", "presets", multiple=True, type=click.Choice(sorted(PRESETS)),
                 help="Built-in tiny model (repeatable). Default: tiny-qwen3_5 and the trained pair trained-qwen3_5."),
    click.option("--target", type=click.Path(path_type=Path), default=None, help="A local target model folder (from_pretrained, offline)."),
    click.option("--draft", type=click.Path(path_type=Path), default=None, help="A local draft model folder for the tree's DFlashDraftModel."),
    click.option("--scripted-draft", is_flag=True,
                 help="Script the draft's proposals from the target's greedy continuation (true token at rank 0, 1 or "
                      "nowhere), as the random presets always do. Needs --target (or the trained-qwen3_5 preset): with --target "
                      "alone, a draft that fits the target is built from the tree's own DFlashDraftModel; with --draft, "
                      "the real drafter's proposals are scripted."),
    click.option("--device-map", default=None, help="accelerate device_map for real models, e.g. auto."),
    click.option("--dtype", default=None, help="torch dtype for real models (default bfloat16)."),
    click.option("--attn-implementation", default=None, help="Target attention implementation (default sdpa)."),
    click.option("--trust-remote-code", is_flag=True, help="Allow model code from the model folder (off by default)."),
    click.option("--seeds", default=None, help="Comma-separated seeds (default 0,1)."),
    click.option("--prompts", type=click.IntRange(min=1), default=None,
                 help="Prompts per seed (default 2); with --prompts-file: the first N of the file (default 8, or all if fewer)."),
    click.option("--prompts-file", type=click.Path(path_type=Path), default=None, metavar="FILE",
                 help="Decode the models that read text (--target, the trained pair) on your own prompts: JSONL with turns "
                      "(MT-Bench), question (GSM8K), prompt (HumanEval) or chat messages per line, or plain text, one prompt "
                      "per line. The target's chat template is applied as upstream's benchmarks apply it. See docs/verifier.md."),
    click.option("--max-new-tokens", type=click.IntRange(min=1), default=None, help="New tokens per prompt (default 32)."),
    click.option("--block-size", type=click.IntRange(min=2), default=None, help="Draft block size, >= 2 (default 4)."),
    click.option("--tree-budgets", default=None, help="DDTree node budgets, comma-separated, each >= 1 (default 4,8; the trained pair 8,16)."),
    click.option("--entry", "entries", multiple=True, metavar="FILE:FUNCTION",
                 help="Verify this decoder (repeatable; FUNCTION may be Class.method). Default: every decoder the tree holds."),
    click.option("--greedy-only", is_flag=True, help="Skip the sampled pass a decoder that takes a temperature gets by default."),
    click.option("--reviewed", multiple=True, type=click.Choice(["noise", "positions", "features"]),
                 help="A drafter input the tree sets differently on purpose, reviewed: reported, not failed (repeatable)."),
    click.option("--mode-runs", type=click.IntRange(min=0), default=None,
                 help="Runs per decoder for the values of its mode parameters (bool flags, Literal or string modes) that "
                      "reach a branch the default runs left unrun (default 4; 0: none; docs/verifier.md#coverage)."),
    click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
                 help="Seconds before the verifier is stopped (> 0)."),
    click.option("--exclude", "exclude", multiple=True, metavar="GLOB",
                 help="Leave these files or folders out of the search for the tree's decoders (repeatable; as check's)."),
)


def _verify_options(presets, target, draft, scripted_draft, trust_remote_code, seeds, tree_budgets, entries=(), greedy_only=False,
                    reviewed=(), exclude=(), **rest) -> dict:
    """``verify_options``' values as ``api.verify`` options (None: the verifier's default)."""
    return dict(presets=list(presets) or None, target=str(target) if target else None, draft=str(draft) if draft else None,
                exclude=list(exclude) or None,
                scripted_draft=scripted_draft or None, trust_remote_code=trust_remote_code or None,
                seeds=_ints(seeds, 0, "--seeds"), tree_budgets=_ints(tree_budgets, 1, "--tree-budgets"),
                entries=list(entries) or None, greedy_only=greedy_only or None, reviewed=list(reviewed) or None, **rest)


def _verify_and_report(tree: Path, fmt: str, timeout: float, options: dict, html_file: Path | None = None) -> int:
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
        if html_file is not None:
            from .report.html import write_html

            write_html(outcome, html_file)
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
                 help="Largest |logit difference| the logits oracle allows (default: calibrated in the run, 4 x the measured noise floor; float32 at least 3e-5)."),
)


generate_options = _options(
    click.option("--generate", is_flag=True, help="Verify transformers' own speculative generate() under patcher.lossless "
                 "(no PATH): token identity, logits, acceptance and speed against plain generate()."),
    click.option("--mode", "modes", default=None, help="With --generate: comma-separated modes among "
                 "mtp,assistant,prompt-lookup,dflash,early-exit (default: all)."),
    click.option("--assistant", type=click.Path(path_type=Path), default=None,
                 help="With --generate --target: a local assistant model folder."),
)


@main.command()
@click.argument("path", type=click.Path(path_type=Path), required=False)
@verify_options
@sampling_options
@generate_options
@click.option("--html", "html_file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also write an offline, self-contained HTML page: |Δlogit| per position against the tolerance, near-ties, acceptance.")
@click.option("--upstream-tests", is_flag=True,
              help="Also run the tree's own tests (pytest, on CPU, as installed and without torch) before and after the patch: "
                   "a test that passed before and fails after is a finding that names the step.")
@click.option("--original", type=click.Path(path_type=Path), default=None,
              help="The unpatched tree, for --upstream-tests (which it implies): needed for a tree written by apply --out; an in-place "
                   "apply's journal holds the original files.")
@FORMAT
@friendly
def verify(path, timeout, temperature, top_p, top_k, sampling_runs, default_init, logit_tolerance, fmt, generate, modes, assistant,
           html_file, **verify_options) -> None:
    """Prove a patched tree decodes losslessly: speculative greedy output must equal the target's greedy.

    Finds every decoder the tree holds (a function that runs a model with a cache in a loop;
    --entry picks them) and every drafter class it defines, loads them in a child process,
    warms up, and runs a short benchmark of each decoder with each drafter class (a tree
    decoder at each budget): by default on tiny-qwen3_5 with a scripted draft, greedy and
    (for decoders that take a temperature) sampled, and on the shipped trained pair, whose
    acceptance is judged against a correct tree's. It checks token identity, the logits the
    decoder used against one from-scratch forward, that rounds accepted part of a block (else
    inconclusive), the drafter's inputs, acceptance and speed. Exit 0 only if every check
    passed; 1 if a check failed or was inconclusive; 2 on bad input or a timeout; 3 if the
    verifier itself crashed.

    \b
    ddpatch verify patched/                          # tiny hybrid preset, CPU
    ddpatch verify patched/ --preset tiny-qwen3_5-vlm
    ddpatch verify patched/ --target /models/Qwen3.6-27B --draft /models/Qwen3.6-27B-DFlash --device-map auto --dtype bfloat16
    ddpatch verify patched/ --target /models/Qwen3.6-27B --scripted-draft    # prove the rollback before any drafter exists
    ddpatch verify --generate --preset tiny-nemotron-h --mode assistant,prompt-lookup   # generate() under patcher.lossless
    """
    verify_options = _configured(path, {**verify_options, "fmt": fmt})  # presets and format from the config file
    fmt = verify_options.pop("fmt")
    options = _verify_options(**verify_options)
    if (top_p is not None or top_k is not None) and not temperature:
        raise Failure("--top-p and --top-k need --temperature > 0")
    if generate and (options.get("upstream_tests") or options.get("original")):
        raise Failure("--upstream-tests and --original judge a patched tree (PATH); --generate has none")
    if generate and options.pop("prompts_file", None) is not None and _given("prompts_file"):  # a config's is for the tree's decoders
        raise Failure("--prompts-file feeds a tree's decoders (PATH); --generate decodes its own prompts")
    if generate:
        sys.exit(_verify_generate(path, fmt, modes, assistant, options, temperature, top_p, top_k, sampling_runs))
    if path is None:
        raise Failure("missing PATH (the patched tree to verify), or --generate")
    options.update(temperature=temperature, top_p=top_p, top_k=top_k, sampling_runs=sampling_runs, default_init=default_init or None,
                   logit_tolerance=logit_tolerance)
    sys.exit(_verify_and_report(path, fmt, timeout, options, html_file))


def _given(param: str) -> bool:
    """Whether ``param`` was given on the command line (not by default or by the config file)."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(param) == ParameterSource.COMMANDLINE


def _verify_generate(path, fmt, modes, assistant, options, temperature, top_p, top_k, sampling_runs) -> int:
    """``verify --generate``: ``patcher.verify.judge.generate_mode`` in this process, the same report."""
    from .verify.judge.generate_mode import MODES, run_generate

    if path is not None:
        raise Failure(f"--generate takes no PATH (got {path}): it verifies transformers' generate(), not a tree")
    chosen = [m.strip() for m in (modes or ",".join(MODES)).split(",") if m.strip()]
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise Failure(f"--mode: unknown mode(s) {', '.join(unknown) or '(none)'}; known: {', '.join(MODES)}")
    if assistant is not None and not options.get("target"):
        raise Failure("--assistant needs --target (the presets bring their own assistant)")
    for flag, folder in (("--target", options.get("target")), ("--assistant", assistant)):
        if folder is not None and not Path(folder).is_dir():
            raise Failure(f"{flag} {folder} is not a folder")
    try:
        outcome = run_generate(modes=chosen, assistant=str(assistant) if assistant else None, temperature=temperature, top_p=top_p,
                               top_k=top_k, sampling_runs=sampling_runs, **options)
    except Exception as exc:  # one line, and JSON on every path
        return _verify_failed(fmt, f"{type(exc).__name__}: {exc}".splitlines()[0], EXIT_INTERNAL)
    code = EXIT_OK if outcome.passed else EXIT_PENDING
    if fmt == "json":
        print_json(verify_payload(outcome, code))
    else:
        render_verify(outcome)
    return code


@main.command()
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
        code = _verify_and_report(report.root, "text", timeout, _verify_options(**verify_options))
    sys.exit(code)


def _demo_json(report, code: int, no_verify: bool, timeout: float, verify_options: dict) -> int:
    payload = {"command": "demo", "patch": patch_payload(report, "apply", code, diff=diff_text(report, runtime=False)), "verify": None}
    if code == EXIT_OK and not no_verify:
        try:
            outcome = api.verify(report.root, timeout=timeout, **_verify_options(**verify_options))
        except api.VerifyError as exc:
            print_json({**payload, **error_payload("demo", str(exc), exc.exit_code)})
            click.echo(f"ddpatch: error: {exc}", err=True)
            return exc.exit_code
        code = EXIT_OK if outcome.passed else EXIT_FAILED
        payload["verify"] = verify_payload(outcome, code)
    print_json({**payload, "exit_code": code})
    return code


@main.command()
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


# ----------------------------------------------------------------------------- ci
main.add_command(ci)
main.add_command(env_command)
main.add_command(referee_command)


if __name__ == "__main__":  # pragma: no cover
    main()
