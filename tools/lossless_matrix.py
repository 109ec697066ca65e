"""Every family x shape x mode under ``patcher.lossless``, against plain greedy ``generate()``; the docs' tables.

    python3 tools/lossless_matrix.py                  # run here, print the table, compare with this release's data (exit 1 if it differs)
    python3 tools/lossless_matrix.py --write          # run, then write tests/data/lossless_families/<release>.json
    python3 tools/lossless_matrix.py --docs           # rewrite the tables in docs/models.md and docs/generate.md from the data
    python3 tools/lossless_matrix.py --family nemotron_h --json   # one family, as JSON

Families and shapes: ``tests/lossless_families.py`` (each family's own default layer pattern shrunk in size,
ddpatch's preset, NemotronH's real pattern). For each shape: the probe's verdict (``patcher.lossless.probe``),
and when ``lossless`` serves it, ``NEW_TOKENS`` new tokens in each mode of ``MODES`` against plain greedy
``generate()`` of the same prompt: ``exact``, or where the first token differs. A refused shape is refused on
entry in one line (its reason is recorded). The data of a release is written in that release's environment:

    for r in 5.21.0 5.23.0 5.24.0 5.25.0; do
        PYTHONPATH=. ${DDPATCH_MATRIX_DIR:-/tmp/ddpatch-matrix}/v$r/bin/python tools/lossless_matrix.py --write
    done
    python3 tools/lossless_matrix.py --docs

Exit status: 0 when every served mode is exact and the run matches the data (or was written), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import lossless_docs  # noqa: E402 (tools/ is on the path)
import lossless_families as lf  # noqa: E402
from lossless_docs import MODES  # noqa: E402 (the docs' columns)

DATA = ROOT / "tests" / "data" / "lossless_families"
NEW_TOKENS = 32
RELEASES = ("5.21.0", "5.23.0", "5.24.0", "5.25.0")
#: the stateful assistant of every family: Qwen3.5's default shape (NemotronH's for Qwen3.5 itself)
STATEFUL_ASSISTANT = ("qwen3_5_text", "nemotron_h")


def release() -> str:
    import transformers

    return transformers.__version__.split("+")[0]


def prompt(seed: int = 0, length: int = 12):
    import torch

    return torch.randint(0, 60, (1, length), generator=torch.Generator().manual_seed(seed))


def repeated_prompt(seed: int = 0):
    import torch

    motif = torch.randint(0, 60, (5,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([motif, motif, motif[:3], motif, motif[:4]])[None]


def greedy(model, ids, new: int = NEW_TOKENS, **kwargs):
    import torch

    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, **kwargs)
    return out if kwargs.get("return_dict_in_generate") else out[0, ids.shape[1]:].tolist()


@contextlib.contextmanager
def scripted(assistant, reference: list[int], seed: int):
    """The assistant's greedy choice at its last position is ``reference``'s token there with probability
    ``generate_mode.RIGHT`` (another token otherwise); it drafts 5 tokens a round, whatever its confidence."""
    import torch

    from patcher.verify.judge.generate_mode import Script
    from patcher.verify.models.presets import MASK_TOKEN_ID

    script = Script(reference, seed, MASK_TOKEN_ID)
    chosen: dict = {}  # position -> token: under lossless the hook sees each forward twice (verify_forward's inner call)

    def hook(module, args, kwargs, output):
        position = _position(args, kwargs)
        if position not in chosen:
            chosen.clear()
            chosen[position] = script.token(position)
        logits = torch.zeros_like(output.logits[:, -1])
        logits[:, chosen[position]] = 10.0
        output.logits[:, -1] = logits
        return output

    config = assistant.generation_config
    saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold)
    config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold = 5, "constant", 0.0
    handle = assistant.register_forward_hook(hook, with_kwargs=True)
    try:
        yield script
    finally:
        handle.remove()
        config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold = saved


def _position(args, kwargs) -> int:
    """How many tokens precede the one this forward proposes: the whole 2D mask generate() hands a forward, else
    the positions, else the cache's length (the hook runs after the forward: the cache holds them all)."""
    from patcher.lossless import cache_of
    from patcher.runtime.caches import _cache_length

    mask = kwargs.get("attention_mask")
    if mask is not None and getattr(mask, "dim", lambda: 0)() == 2:
        return int(mask.shape[-1])
    for name in ("cache_position", "position_ids"):
        value = kwargs.get(name)
        if value is not None:
            return int(value.reshape(-1)[-1]) + 1
    return _cache_length(cache_of(args, kwargs))


def first_difference(expected, got) -> str:
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return f"diverges at new token {i}"
    return "exact" if len(expected) == len(got) else f"{len(got)} of {len(expected)} tokens"


def run_mode(mode: str, model, helpers: dict, references: dict, record: bool = True) -> str:
    """What ``mode`` does under ``lossless`` (``record=False``: the control, the refusal lifted, nothing recorded)."""
    import functools

    import torch

    from patcher import lossless as module

    lossless = functools.partial(module.lossless, record=record)

    ids, repeated = prompt(), repeated_prompt()
    reference = references["prompt"]
    if mode == "greedy":
        with lossless(model):
            return first_difference(reference, greedy(model, ids))
    if mode == "prompt-lookup":
        with lossless(model):
            return first_difference(references["repeated"], greedy(model, repeated, prompt_lookup_num_tokens=3))
    if mode in ("assistant", "stateful-assistant"):
        helper = helpers[mode]
        with scripted(helper, ids[0].tolist() + reference, seed=1) as script, lossless(model, helper):
            got = greedy(model, ids, assistant_model=helper)
        partial = sum(0 < a < n for a, n in script.blocks)
        verdict = first_difference(reference, got)
        return verdict if verdict != "exact" or partial else "exact (no partial acceptance)"
    if mode == "continue":
        with lossless(model):
            first = greedy(model, repeated, new=NEW_TOKENS // 2, prompt_lookup_num_tokens=3, return_dict_in_generate=True)
            cache = getattr(first, "cache", None) or getattr(first, "past_key_values", None)
            keyword = "cache" if hasattr(first, "cache") and first.cache is not None else "past_key_values"
            # plain greedy from the returned cache: transformers' own prompt lookup from a non-empty cache diverges at
            # the first continued token on 5.25 without ddpatch (Llama, nothing stateful), so it is not the check here
            rest = greedy(model, first.sequences, new=NEW_TOKENS - NEW_TOKENS // 2, **{keyword: cache})
        return first_difference(references["repeated"], first.sequences[0, repeated.shape[1]:].tolist() + rest)
    if mode == "sampling":
        # speculative sampling: the target's logits at every emitted token must be its from-scratch logits
        torch.manual_seed(0)
        with lossless(model):
            out = model.generate(repeated, attention_mask=torch.ones_like(repeated), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, top_k=0, pad_token_id=0,
                                 prompt_lookup_num_tokens=3, return_dict_in_generate=True, output_logits=True)
        used = torch.cat(out.logits, dim=0)
        with torch.no_grad():
            scratch = model(input_ids=out.sequences, use_cache=False).logits[0, repeated.shape[1] - 1:-1]
        error = float((used - scratch).abs().max())
        return "exact" if error <= max(4 * references["floor"], 1e-5) else f"logits off by {error:.1g}"
    raise ValueError(f"unknown mode {mode!r}")


def run_shape(model_type: str, shape: str, modes=MODES) -> dict:
    from patcher.lossless import UnsupportedModelError, probe

    try:
        model = lf.build(model_type, shape)
    except Exception as exc:
        return {"verdict": "not built", "reason": _line(exc)}
    verdict = probe(model)
    row = {"probe_seconds": round(verdict.seconds, 3), "floor": verdict.floor, "error": verdict.error}
    if verdict.reason is not None:
        return {**row, "verdict": "refused", "reason": verdict.reason}
    references, helpers = _Lazy(lambda name: _reference(model, name)), _Lazy(lambda name: _helper(model_type, shape, name))
    row.update(verdict="served", modes={})
    for mode in modes:
        try:
            row["modes"][mode] = run_mode(mode, model, helpers, references)
        except UnsupportedModelError as exc:  # the assistant of the mode, refused on entry in one line
            row["modes"][mode] = f"assistant refused: {_line(exc)}"
        except Exception as exc:
            row["modes"][mode] = f"error: {_line(exc)}"
            try:  # the same run with nothing recorded: transformers' own failure, or ddpatch's?
                run_mode(mode, model, helpers, references, record=False)
            except Exception as native:
                if type(native) is type(exc):
                    row["modes"][mode] = f"transformers fails: {_line(exc)}"
    return row


class _Lazy(dict):
    """What a mode needs, computed the first time one asks (a run of two modes builds no unused assistant)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, name):
        self[name] = value = self.make(name)
        return value


def _reference(model, name: str):
    """Plain greedy ``generate()`` outside ``lossless``: ``prompt``'s and ``repeated``'s new tokens, and ``floor``, how
    far the logits of ``repeated``'s are from one from-scratch forward over its output."""
    import torch

    if name == "prompt":
        return greedy(model, prompt())
    ids = repeated_prompt()
    scores = greedy(model, ids, return_dict_in_generate=True, output_logits=True)
    if name == "repeated":
        return scores.sequences[0, ids.shape[1]:].tolist()
    with torch.no_grad():
        scratch = model(input_ids=scores.sequences, use_cache=False).logits[0, ids.shape[1] - 1:-1]
    return float((torch.cat(scores.logits) - scratch).abs().max())


def _helper(model_type: str, shape: str, name: str):
    from patcher.lossless import probe

    if name == "assistant":
        helper = lf.build(model_type, shape, seed=1)
    else:
        helper = lf.build(STATEFUL_ASSISTANT[1] if model_type == STATEFUL_ASSISTANT[0] else STATEFUL_ASSISTANT[0], seed=2)
    probe(helper)  # before the scripted hook is on it: the probe runs the model as it is, hooks included
    return helper


def run(families=None, modes=MODES, echo=None) -> dict:
    out = {}
    for model_type in families or lf.FAMILIES:
        if not lf.shipped(model_type):
            continue
        for shape in lf.shapes(model_type):
            start = time.perf_counter()
            out.setdefault(model_type, {})[shape] = row = run_shape(model_type, shape, modes)
            if echo:
                echo(f"{model_type:20} {shape:8} {time.perf_counter() - start:5.1f}s  {summary(row)}")
    return out


def summary(row: dict) -> str:
    if row["verdict"] != "served":
        return f"{row['verdict']}: {row.get('reason', '')}"
    bad = {m: v for m, v in row["modes"].items() if not acceptable(v)}
    native = {m: v for m, v in row["modes"].items() if v.startswith("transformers fails")}
    return (f"served, NOT EXACT: {bad}" if bad else "served, every mode exact"
            + (f" or failing in transformers itself: {native}" if native else ""))


def acceptable(outcome: str) -> bool:
    """Exact, a failure transformers has without ddpatch (the same run with nothing recorded raises the same), or an
    assistant ``lossless`` refused on entry: never a wrong token."""
    return outcome.startswith(("exact", "transformers fails", "assistant refused"))


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def comparable(data: dict) -> dict:
    """What the data says, without the timings and floors (they move between runs)."""
    return {mt: {shape: {k: v for k, v in row.items() if k in ("verdict", "reason", "modes")} for shape, row in shapes.items()}
            for mt, shapes in data.items()}


def load(rel: str) -> dict | None:
    path = DATA / f"{rel}.json"
    return json.loads(path.read_text()) if path.exists() else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write this release's data file")
    parser.add_argument("--docs", action="store_true", help="rewrite the docs' tables from the recorded data (no run)")
    parser.add_argument("--family", action="append", help="only this model type (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the run as JSON")
    args = parser.parse_args(argv)
    if args.docs:
        changed = lossless_docs.write_docs()
        print("\n".join(f"wrote {p}" for p in changed) or "docs already match the data")
        return 0
    rel = release()
    data = run(args.family, echo=None if args.json else print)
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True))
    bad = [f"{mt}/{s}" for mt, shapes in data.items() for s, row in shapes.items()
           if row["verdict"] == "served" and not all(acceptable(v) for v in row["modes"].values())]
    if args.write:
        recorded = (load(rel) or {}) if args.family else {}
        recorded.update(data)
        DATA.mkdir(parents=True, exist_ok=True)
        (DATA / f"{rel}.json").write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        print(f"wrote {DATA / f'{rel}.json'}")
        return 1 if bad else 0
    recorded = load(rel)
    differs = recorded is None or comparable({k: recorded.get(k, {}) for k in data}) != comparable(data)
    if differs:
        print(f"differs from {DATA / f'{rel}.json'}" if recorded else f"no data for transformers {rel}")
    if bad:
        print("NOT EXACT: " + ", ".join(bad))
    return 1 if bad or differs else 0


if __name__ == "__main__":
    sys.exit(main())
