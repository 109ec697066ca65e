"""Speed of transformers' own speculative ``generate()`` under ``patcher.lossless`` against plain greedy ``generate()``.

Not a test: it prints, per preset and mode, the median tokens/s over repeats (time.perf_counter around
``generate()``, after one warm-up run; the variants are interleaved in every repeat so that machine
noise hits them alike), the speedup against plain ``generate()``, the mean tokens committed per
target forward, and whether the output equals plain greedy (it must). ``--control`` adds each mode
with only transformers' refusal lifted (no recording, lossy): the recording's own cost.

The presets are random models: the MTP head and the assistant are scripted to propose the target's
greedy continuation with probability 0.65 (as ``ddpatch verify --generate`` does), prompt lookup runs
on prompts with repeated n-grams, and DFlash uses a random seeded drafter (it is rejected almost
always). The figures measure the plumbing on CPU, not what a trained drafter would gain.

    python benchmarks/bench_generate.py                              # mid-qwen3_5, CPU
    python benchmarks/bench_generate.py --presets tiny-qwen3_5,tiny-nemotron-h --json
    python benchmarks/bench_generate.py --control --repeats 5 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patcher.lossless import lossless  # noqa: E402
from patcher.verify.judge import generate_mode as gm  # noqa: E402
from patcher.verify.models.presets import MASK_TOKEN_ID, build_target  # noqa: E402


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, MASK_TOKEN_ID, (6,), generator=gen)
    return torch.cat([motif] * (length // 6 + 1))[None, :length]


def one_run(target, mode: str, ids, reference, new_tokens: int, kwargs: dict, record: bool):
    """(seconds, new tokens, target forwards) of one greedy generate()."""
    forwards, depth = [], target.config.get_text_config().num_hidden_layers

    def count(module, args, kwargs):  # the target's own forwards: not an early-exit draft's (fewer layers)
        if module.config.get_text_config().num_hidden_layers == depth:
            forwards.append(kwargs.get("input_ids"))

    handle = target.register_forward_pre_hook(count, with_kwargs=True)
    script = gm.Script(ids[0].tolist() + reference, 0, MASK_TOKEN_ID)
    scripting = (gm.scripted_mtp(script) if mode == "mtp" else gm.scripted_assistant(kwargs["assistant_model"], script)
                 if mode == "assistant" else None)
    try:
        with (scripting or _null()), (lossless(target, record=record) if mode != "generate()" else _null()):
            start = time.perf_counter()
            out = target.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
            seconds = time.perf_counter() - start
    finally:
        handle.remove()
    unique = [f for i, f in enumerate(forwards) if i == 0 or f is not forwards[i - 1]]  # lossless re-enters the hooks once
    return seconds, out[0, ids.shape[1]:].tolist(), len(unique)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def bench_preset(name: str, modes: list[str], new_tokens: int, repeats: int, prompt_len: int, control: bool, workdir: Path) -> dict:
    try:
        target = gm.mtp_checkpoint(name, workdir / name)
        has_mtp = True
    except Exception:
        target, has_mtp = build_target(name, seed=0), False
    assistant = build_target("tiny-qwen3", seed=100)
    drafter = gm.dflash_drafter(target)
    ids = prompt(prompt_len)
    with torch.inference_mode():
        reference = target.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    variants = [("generate()", "generate()", {}, True)]
    for mode in modes:
        if (mode == "mtp" and not has_mtp) or (mode == "early-exit" and gm.early_exit_layer(target) is None):
            continue
        kwargs = gm.generate_kwargs(mode, target, assistant, drafter)
        variants.append((mode, mode, kwargs, True))
        if control:
            variants.append((f"{mode} (control)", mode, kwargs, False))
    times: dict[str, list[float]] = {v[0]: [] for v in variants}
    facts: dict[str, dict] = {}
    for r in range(repeats + 1):  # the first round warms up and is not timed
        for label, mode, kwargs, record in variants:
            with torch.inference_mode():
                seconds, new, forwards = one_run(target, mode, ids, reference, new_tokens, kwargs, record)
            if r:
                times[label].append(seconds)
            print(f"  {name} round {r} {label}: {seconds:.2f} s", file=sys.stderr, flush=True)
            facts[label] = {"identical": new == reference, "forwards": forwards}
    base = statistics.median(times["generate()"])
    rows = []
    for label, *_ in variants:
        med = statistics.median(times[label])
        rows.append({"mode": label, "median_s": round(med, 4), "tokens_per_s": round(new_tokens / med, 2),
                     "speedup": round(base / med, 3), "tokens_per_forward": round(new_tokens / max(1, facts[label]["forwards"]), 2),
                     "identical": facts[label]["identical"]})
    return {"preset": name, "new_tokens": new_tokens, "prompt_len": prompt_len, "repeats": repeats, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="mid-qwen3_5")
    parser.add_argument("--modes", default=",".join(gm.MODES))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--control", action="store_true", help="also each mode with only the refusal lifted (lossy)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import transformers

    results = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(), "presets": []}
    with tempfile.TemporaryDirectory(prefix="ddpatch-bench-generate-") as tmp:
        for name in args.presets.split(","):
            results["presets"].append(bench_preset(name, args.modes.split(","), args.new_tokens, args.repeats, args.prompt_len,
                                                   args.control, Path(tmp)))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"transformers {results['transformers']}, torch {results['torch']}, {results['threads']} thread(s)")
    for p in results["presets"]:
        print(f"\n{p['preset']}: {p['new_tokens']} new tokens, prompt {p['prompt_len']}, median of {p['repeats']}")
        print(f"  {'mode':<26}{'tok/s':>8}{'speedup':>9}{'tok/fwd':>9}  identical")
        for r in p["rows"]:
            print(f"  {r['mode']:<26}{r['tokens_per_s']:>8.1f}{r['speedup']:>8.2f}x{r['tokens_per_forward']:>9.2f}  {r['identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
