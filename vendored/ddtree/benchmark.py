"""Compare autoregressive decoding, DFlash chains and DDTree trees on a prompt set.

One process per GPU; launch several with torchrun and each takes every WORLD_SIZE-th prompt.
"""

import argparse
import json
import os
import random
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from model import DFlashDraftModel, load_and_process_dataset
from dflash import dflash_generate
from ddtree import ddtree_generate


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-name-or-path", required=True, help="target model (hub id or local folder)")
    parser.add_argument("--draft-name-or-path", required=True, help="DFlash draft checkpoint")
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=None, help="defaults to the draft's own block size")
    parser.add_argument("--tree-budget", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--flash-attn", action="store_true", help="also use FlashAttention-2 for the target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("results.json"))
    return parser.parse_args()


def summarize(runs: list) -> dict[str, float]:
    tpot = statistics.fmean(r.time_per_output_token for r in runs)
    accepted = [n for r in runs for n in r.acceptance_lengths]
    return {
        "tokens_per_second": 1.0 / tpot if tpot > 0 else float("nan"),
        "time_per_output_token": tpot,
        "mean_acceptance_length": statistics.fmean(accepted) if accepted else 0.0,
        "time_to_first_token": statistics.fmean(r.time_to_first_token for r in runs),
    }


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    def has_flash_attn() -> bool:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return False
        return True

    installed_flash_attn = has_flash_attn()
    if not installed_flash_attn:
        raise RuntimeError("flash_attn must be installed: the DFlash draft is only run with FlashAttention-2")

    # sdpa unless asked: DDTree verifies with a custom 4D mask, which sdpa accepts as given
    target_attn_implementation = "flash_attention_2" if args.flash_attn else "sdpa"
    draft_attn_implementation = "flash_attention_2"

    target = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, attn_implementation=target_attn_implementation, dtype=torch.bfloat16, device_map="cuda"
    ).eval()
    draft = DFlashDraftModel.from_pretrained(
        args.draft_name_or_path, attn_implementation=draft_attn_implementation, dtype=torch.bfloat16, device_map="cuda"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    block_size = args.block_size or draft.block_size
    mask_token_id = draft.mask_token_id
    stop_token_ids = [tokenizer.eos_token_id]

    prompts = load_and_process_dataset(args.dataset)
    if args.max_samples is not None:
        prompts = prompts[: args.max_samples]
    prompts = prompts[rank::world_size]

    runs: dict[str, list] = {"baseline": [], "dflash": [], **{f"ddtree@{b}": [] for b in args.tree_budget}}
    common = dict(mask_token_id=mask_token_id, stop_token_ids=stop_token_ids, temperature=args.temperature)
    common["max_new_tokens"] = args.max_new_tokens
    for record in prompts:
        messages = [{"role": "user", "content": record["turns"][0]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        input_ids = tokenizer(text, return_tensors="pt").input_ids.to(target.device)
        # a block of one token drafts nothing: the autoregressive baseline, with the same bookkeeping
        runs["baseline"].append(dflash_generate(draft, target, input_ids, block_size=1, **common))
        runs["dflash"].append(dflash_generate(draft, target, input_ids, block_size=block_size, **common))
        for budget in args.tree_budget:
            result = ddtree_generate(draft, target, input_ids, block_size=block_size, tree_budget=budget, **common)
            runs[f"ddtree@{budget}"].append(result)

    report = {
        "dataset": args.dataset,
        "methods": {name: summarize(r) for name, r in runs.items() if r},
        "attn_implementation": {"draft": draft_attn_implementation, "target": target_attn_implementation},
        "block_size": block_size,
    }
    baseline_tpot = report["methods"].get("baseline", {}).get("time_per_output_token")
    for name, stats in report["methods"].items():
        if baseline_tpot:
            stats["speedup"] = baseline_tpot / stats["time_per_output_token"]
        print(f"{name:>14}: {stats['tokens_per_second']:8.2f} tok/s, tau={stats['mean_acceptance_length']:.2f}")
    if rank == 0:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
