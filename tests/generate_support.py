"""What the ``lossless`` generate() tests share: seeded stateful targets (with an MTP head saved in a
checkpoint folder where the family has one), a scripted assistant and a scripted MTP head that are
right often but not always, prompts with repeated n-grams, and plain greedy references.

The targets are the verifier's presets (``patcher.verify.models.presets``): their state parameters are
drawn so that state matters, so a rollback that is not exact changes the greedy output.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from patcher.verify.judge import generate_mode
from patcher.verify.models.presets import MASK_TOKEN_ID, build_target

#: stateful presets: Gated DeltaNet, hybrid MoE, Mamba2 hybrids, short conv, Kimi Delta Attention
STATEFUL = ("tiny-qwen3_5", "tiny-qwen3_5-moe", "tiny-nemotron-h", "tiny-granitemoehybrid", "tiny-falcon-h1",
            "tiny-lfm2", "tiny-kimi-linear")
#: families whose transformers class loads MTP weights (``^mtp.*`` among the keys it ignores on load)
MTP_PRESETS = ("tiny-qwen3_5", "tiny-qwen3_5-moe")
NEW_TOKENS = 24


def prompt(seed: int = 0, length: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, MASK_TOKEN_ID, (1, length), generator=gen)


def repeated_prompt(seed: int = 0) -> torch.Tensor:
    """A prompt whose n-grams repeat, so that prompt lookup proposes candidates."""
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, MASK_TOKEN_ID, (5,), generator=gen)
    return torch.cat([motif, motif, motif[:3], motif, motif[:4]])[None]


@functools.lru_cache(maxsize=None)
def target(name: str, seed: int = 0):
    return build_target(name, seed=seed)


def mtp_checkpoint(name: str, folder: Path, seed: int = 0):
    """``name``'s seeded target with one MTP layer, saved with its ``mtp.`` weights to ``folder``, loaded back."""
    return generate_mode.mtp_checkpoint(name, folder, seed)


def greedy(model, ids, new_tokens: int = NEW_TOKENS, **kwargs) -> list[int]:
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


# Scripted drafts (shared with ``verify --generate``): right with probability RIGHT
Script, scripted_assistant, scripted_mtp, RIGHT = (generate_mode.Script, generate_mode.scripted_assistant,
                                                   generate_mode.scripted_mtp, generate_mode.RIGHT)


def assistant(seed: int = 0):
    """A tiny full-attention model with the presets' vocabulary (no state of its own)."""
    return build_target("tiny-qwen3", seed=seed + 100)
