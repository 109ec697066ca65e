"""Benchmark DFlash against plain autoregressive decoding with the transformers backend.

    python -m dflash.benchmark --model Qwen/Qwen3-8B --draft-model z-lab/Qwen3-8B-DFlash --dataset gsm8k
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import warnings
from types import SimpleNamespace

_DATASETS = {
    # name: (hub id, subset, split, prompt field)
    "gsm8k": ("openai/gsm8k", "main", "test", "question"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem"),
    "humaneval": ("openai/openai_humaneval", None, "test", "prompt"),
    "mbpp": ("google-research-datasets/mbpp", "sanitized", "test", "prompt"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt"),
}


def _prepare_dataset(name: str) -> list[str | list[str]]:
    """The raw prompts of one prompt set, straight from the hub."""
    # imported here so that the package (and the decoder) works without `datasets`
    from datasets import load_dataset

    hub_id, subset, split, field = _DATASETS[name]
    return [row[field] for row in load_dataset(hub_id, subset, split=split)]


def load_and_process_dataset(data_name: str) -> list[dict]:
    """``[{"turns": [...]}, ...]`` for a known prompt set."""
    return [{"turns": p if isinstance(p, list) else [p]} for p in _prepare_dataset(data_name)]


def _get_transformers_attn_impl() -> str:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        warnings.warn("flash_attn is not installed; falling back to sdpa, expect a smaller speedup", stacklevel=2)
        return "sdpa"
    return "flash_attention_2"


def _run_transformers(args: argparse.Namespace) -> dict[int, list[SimpleNamespace]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import DFlashDraftModel, dflash_generate

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    attn = _get_transformers_attn_impl()
    load = {"attn_implementation": attn, "dtype": torch.bfloat16}
    target = AutoModelForCausalLM.from_pretrained(args.model, **load).cuda().eval()
    draft = DFlashDraftModel.from_pretrained(args.draft_model, **load).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    block_size = args.block_size or draft.block_size

    prompts = load_and_process_dataset(args.dataset)
    random.Random(0).shuffle(prompts)
    if args.max_samples:
        prompts = prompts[: args.max_samples]

    results: dict[int, list[SimpleNamespace]] = {1: [], block_size: []}
    for record in prompts:
        chat = [{"role": "user", "content": record["turns"][0]}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        input_ids = tokenizer(text, return_tensors="pt").input_ids.cuda()
        for size in results:
            results[size].append(
                dflash_generate(
                    draft,
                    target,
                    input_ids,
                    max_new_tokens=args.max_new_tokens,
                    stop_token_ids=[tokenizer.eos_token_id],
                    temperature=args.temperature,
                    block_size=size,
                    return_stats=True,
                )
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description="DFlash speedup benchmark")
    option = parser.add_argument
    option("--model", required=True, help="target model")
    option("--draft-model", required=True, help="DFlash draft checkpoint")
    option("--dataset", choices=sorted(_DATASETS), required=True)
    option("--block-size", type=int, default=None, help="defaults to the draft's block size")
    option("--max-samples", type=int, default=None)
    option("--max-new-tokens", type=int, default=2048)
    option("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    results = _run_transformers(args)
    baseline, *others = results
    base_tpot = statistics.fmean(r.time_per_output_token for r in results[baseline])
    for size in others:
        tpot = statistics.fmean(r.time_per_output_token for r in results[size])
        tau = statistics.fmean(n for r in results[size] for n in r.acceptance_lengths)
        print(f"block {size}: speedup {base_tpot / tpot:.2f}x, mean acceptance length {tau:.2f}")


if __name__ == "__main__":
    main()
