"""Helpers shared by the draft model and the decoding loops.

``datasets`` is imported at module level although only the prompt loader needs it: the
research code this file is shaped after does the same, and the recipe moves the import.
"""

import torch
from datasets import load_dataset


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Spread the conditioning layers over the middle of the target stack.

    The first and the last two target layers carry little that the draft can use (token
    identity and next-token logits), so the ids stay inside [1, num_target_layers - 3].
    """
    lo = 1
    hi = max(lo, num_target_layers - 3)
    if num_draft_layers <= 1:
        return [(lo + hi) // 2]
    step = (hi - lo) / (num_draft_layers - 1)
    return [lo + round(i * step) for i in range(num_draft_layers)]


def extract_context_feature(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the outputs of the chosen target layers along the feature axis.

    ``hidden_states[0]`` is the embedding output, so layer ``i`` lives at index ``i + 1``.
    """
    picked = [hidden_states[layer + 1] for layer in layer_ids]
    return torch.cat(picked, dim=-1)


def sample(logits: torch.Tensor, temperature: float = 0.0) -> torch.Tensor:
    """Greedy below a tiny temperature, otherwise one multinomial draw per position."""
    if temperature < 1e-5:
        return logits.argmax(dim=-1)
    *lead, vocab = logits.shape
    probs = torch.softmax(logits.float() / temperature, dim=-1).reshape(-1, vocab)
    return torch.multinomial(probs, num_samples=1).reshape(*lead)


_PROMPT_SOURCES = {
    # name: (hub id, subset, split, field that holds the prompt)
    "gsm8k": ("openai/gsm8k", "main", "test", "question"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train", "problem"),
    "humaneval": ("openai/openai_humaneval", None, "test", "prompt"),
    "mbpp": ("google-research-datasets/mbpp", "sanitized", "test", "prompt"),
    "alpaca": ("tatsu-lab/alpaca", None, "train", "instruction"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt"),
}


def load_and_process_dataset(data_name: str) -> list[dict]:
    """Return ``[{"turns": [prompt, ...]}, ...]`` for one of the benchmark prompt sets."""
    if data_name not in _PROMPT_SOURCES:
        raise ValueError(f"unknown dataset {data_name!r}; choose from {sorted(_PROMPT_SOURCES)}")
    hub_id, subset, split, field = _PROMPT_SOURCES[data_name]
    rows = load_dataset(hub_id, subset, split=split) if subset else load_dataset(hub_id, split=split)
    records = []
    for row in rows:
        turns = row[field]
        # mt-bench rows already hold a list of turns; everything else is single-turn
        records.append({"turns": list(turns) if isinstance(turns, list) else [turns]})
    return records
