"""``ddpatch referee``: a serving engine's acceptance beside a correct decoder's, the same pair on the same prompts."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .. import api
from ..errors import RefereeError
from ..report.console import print_json
from ..report.json_report import error_payload
from ..report.referee import referee_text
from ..results import EXIT_ERROR, EXIT_INTERNAL
from .base import FORMAT, ints


@click.command("referee", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine", required=True, metavar="URL",
              help="The running engine: llama.cpp's llama-server, vLLM or SGLang, e.g. http://127.0.0.1:8080.")
@click.option("--target", type=click.Path(path_type=Path), required=True, help="The target's Hugging Face folder (the model the engine serves).")
@click.option("--draft", type=click.Path(path_type=Path), required=True, help="The drafter's Hugging Face folder (the one the engine drafts with).")
@click.option("--prompts-file", type=click.Path(path_type=Path), default=None,
              help="Prompts as verify reads them: JSONL (turns, question, prompt, messages) or plain text, one per line.")
@click.option("--prompts", type=click.IntRange(min=1), default=None, help="How many prompts (default: 4 built-in, or the file's first 8).")
@click.option("--max-new-tokens", type=click.IntRange(min=4), default=64, show_default=True, help="New tokens per prompt.")
@click.option("--tree-budgets", default="8,16", show_default=True,
              help="DDTree budgets to say what a tree would reach with the pair (what an engine without trees gives up).")
@click.option("--engine-kind", type=click.Choice(["llama.cpp", "vllm", "sglang"]), default=None,
              help="The engine's kind (default: found out from its answers).")
@click.option("--engine-api", type=click.Choice(["completion", "v1"]), default=None,
              help="llama.cpp: its own /completion (default) or the OpenAI-compatible /v1/completions.")
@click.option("--dtype", default="float32", show_default=True, help="The dtype ddpatch's reference runs the pair in.")
@click.option("--engine-dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="The dtype the engine computes in (default: what it says: llama.cpp's /props model_ftype, a dtype label "
                   "in vLLM's /metrics, SGLang's server info). Where its tokens part from the target's float32 greedy, a "
                   "margin within this dtype's measured rounding is a near-tie, not a loss.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Seconds one engine request may take.")
@FORMAT
def referee(engine, target, draft, prompts_file, prompts, max_new_tokens, tree_budgets, engine_kind, engine_api, dtype,
            engine_dtype, timeout, fmt) -> None:
    """Is the engine's acceptance right? The engine's tokens and acceptance beside ddpatch's reference.

    Sends each prompt to the running engine at temperature 0 (as token ids), reads its own acceptance counters
    (llama.cpp's timings and /metrics, vLLM's spec_decode metrics, SGLang's meta_info) in one definition (mean
    tokens a verification round commits, the bonus included), checks its tokens against the target's greedy
    decoding, and runs ddpatch's from-scratch DFlash (and DDTree at --tree-budgets) on the same prompts with the
    same pair. One verdict: the engine reaches a correct DFlash's acceptance (the drafter is the limit), loses
    acceptance (the integration), or is not lossless. A DFlash2 or DSpark drafter (read from its config) is judged
    by its own kind's chain reference; a kind without one is refused. docs/engines.md says what each engine counts.

    Exit 0: exact, and at a correct DFlash's acceptance; 1: a finding, or inconclusive; 2: bad input (an engine that
    does not answer or reports no counters, another tokenizer, a prompt over the context); 3: ddpatch's own error.
    """
    budgets = ints(tree_budgets, 1, "--tree-budgets")
    show = fmt != "json"
    try:
        outcome = api.referee(engine, target, draft, prompts_file=prompts_file, prompts=prompts, max_new_tokens=max_new_tokens,
                              budgets=budgets, kind=engine_kind, engine_api=engine_api, dtype=dtype, timeout=timeout,
                              **({"engine_dtype": engine_dtype} if engine_dtype else {}),
                              progress=(lambda text: click.echo(f"  {text}", err=True)) if show else None)
    except (RefereeError, *api.INPUT_ERRORS) as exc:
        sys.exit(_failed(fmt, str(exc), EXIT_ERROR))
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # a bug of ours must not read as a verdict on the engine
        sys.exit(_failed(fmt, f"internal error: {type(exc).__name__}: {exc}", EXIT_INTERNAL))
    if fmt == "json":
        print_json({"command": "referee", **outcome.result, "exit_code": outcome.exit_code})
    else:
        click.echo(referee_text(outcome.result), nl=False)
    sys.exit(outcome.exit_code)


def _failed(fmt: str, message: str, code: int) -> int:
    if fmt == "json":
        print_json(error_payload("referee", message, code))
    click.echo(f"ddpatch: error: {message}", err=True)
    return code
