"""``ddpatch verify``: a patched tree's decoders run in a child process and judged, or (``--generate``) transformers' own
speculative ``generate()`` under ``patcher.lossless``; its option groups, which ``demo`` shares."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .. import api
from ..report.console import print_json, verify_progress
from ..report.json_report import error_payload, verify_payload
from ..report.text import render_verify
from ..results import EXIT_INTERNAL, EXIT_OK
from .base import EXIT_PENDING, FORMAT, Failure, configured, friendly, ints, options


verify_options = options(
    click.option("--preset", "presets", multiple=True, type=click.Choice(sorted(api.PRESETS)),
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


def verify_kwargs(presets, target, draft, scripted_draft, trust_remote_code, seeds, tree_budgets, entries=(), greedy_only=False,
                  reviewed=(), exclude=(), **rest) -> dict:
    """``verify_options``' values as ``api.verify`` options (None: the verifier's default)."""
    return dict(presets=list(presets) or None, target=str(target) if target else None, draft=str(draft) if draft else None,
                exclude=list(exclude) or None,
                scripted_draft=scripted_draft or None, trust_remote_code=trust_remote_code or None,
                seeds=ints(seeds, 0, "--seeds"), tree_budgets=ints(tree_budgets, 1, "--tree-budgets"),
                entries=list(entries) or None, greedy_only=greedy_only or None, reviewed=list(reviewed) or None, **rest)


def verify_and_report(tree: Path, fmt: str, timeout: float, options: dict, html_file: Path | None = None) -> int:
    """``api.verify`` on ``tree``, rendered; its exit code (a bad input or a timeout: one ``ddpatch: error:`` line)."""
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
            from ..report.html import write_html

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


sampling_options = options(
    click.option("--temperature", type=click.FloatRange(min=0), default=None,
                 help="Verify sampled decoding (seeded): the logits oracle and a distributional test judge it. Default 0: greedy."),
    click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None, help="Nucleus sampling, with --temperature (only decoders that take top_p run)."),
    click.option("--top-k", type=click.IntRange(min=1), default=None, help="Top-k sampling, with --temperature (only decoders that take top_k run)."),
    click.option("--sampling-runs", type=click.IntRange(min=0), default=None, help="Seeded runs of the distributional test (default 200; 0: off)."),
    click.option("--default-init", is_flag=True, help="Keep transformers' default init of the presets' state parameters (a weaker test: for controls)."),
    click.option("--logit-tolerance", type=click.FloatRange(min=0, min_open=True), default=None,
                 help="Largest |logit difference| the logits oracle allows (default: calibrated in the run, 4 x the measured noise floor; float32 at least 3e-5)."),
)


generate_options = options(
    click.option("--generate", is_flag=True, help="Verify transformers' own speculative generate() under patcher.lossless "
                 "(no PATH): token identity, logits, acceptance and speed against plain generate()."),
    click.option("--mode", "modes", default=None, help="With --generate: comma-separated modes among "
                 "mtp,assistant,prompt-lookup,dflash,early-exit (default: all)."),
    click.option("--assistant", type=click.Path(path_type=Path), default=None,
                 help="With --generate --target: a local assistant model folder."),
)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
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
    verify_options = configured(path, {**verify_options, "fmt": fmt})  # presets and format from the config file
    fmt = verify_options.pop("fmt")
    options = verify_kwargs(**verify_options)
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
    sys.exit(verify_and_report(path, fmt, timeout, options, html_file))


def _given(param: str) -> bool:
    """Whether ``param`` was given on the command line (not by default or by the config file)."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(param) == ParameterSource.COMMANDLINE


def _verify_generate(path, fmt, modes, assistant, options, temperature, top_p, top_k, sampling_runs) -> int:
    """``verify --generate``: ``api.verify_generate`` in this process, the same report."""
    known = api.generate_modes()
    if path is not None:
        raise Failure(f"--generate takes no PATH (got {path}): it verifies transformers' generate(), not a tree")
    chosen = [m.strip() for m in (modes or ",".join(known)).split(",") if m.strip()]
    unknown = [m for m in chosen if m not in known]
    if unknown or not chosen:
        raise Failure(f"--mode: unknown mode(s) {', '.join(unknown) or '(none)'}; known: {', '.join(known)}")
    if assistant is not None and not options.get("target"):
        raise Failure("--assistant needs --target (the presets bring their own assistant)")
    for flag, folder in (("--target", options.get("target")), ("--assistant", assistant)):
        if folder is not None and not Path(folder).is_dir():
            raise Failure(f"{flag} {folder} is not a folder")
    try:
        outcome = api.verify_generate(chosen, assistant, temperature=temperature, top_p=top_p, top_k=top_k, sampling_runs=sampling_runs,
                                      **options)
    except Exception as exc:  # one line, and JSON on every path
        return _verify_failed(fmt, f"{type(exc).__name__}: {exc}".splitlines()[0], EXIT_INTERNAL)
    code = EXIT_OK if outcome.passed else EXIT_PENDING
    if fmt == "json":
        print_json(verify_payload(outcome, code))
    else:
        render_verify(outcome)
    return code
