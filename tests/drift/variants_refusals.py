"""Drift variants of the shapes issue 42 found refused without need ("refuse only what cannot be made exact").

Each is a small transformation of ``vendored/dflash`` in our own words (no fork's code is copied): the caches
built by a helper of another file, an embedding helper that asks the accessor first, drafted tokens kept in a
local that the accepted count is read from, a legacy-cache round trip that clones every tensor, and a decoder
that times its prefill with CUDA events and the peak-memory counters. Each must apply and verify lossless.
"""

from __future__ import annotations

from pathlib import Path

from . import transforms as t
from .variants import BY_NAME, LOSSLESS, VARIANTS, Variant, _read

FL = "dflash/model.py"
DECODING = "# ---------------------------------------------------------------- decoding\n"
CACHES = "    target_cache = DynamicCache()\n    draft_cache = DynamicCache()\n"


# ---------------------------------------------------------------- the caches come from a helper of another file
GENERATION_CACHE = '''"""The caches a decode needs, each laid out from its own model's config."""

from transformers import DynamicCache


def create_generation_cache(config):
    # a multimodal target nests its text model's config; the cache is the text model's
    text = getattr(config, "text_config", config)
    cache = DynamicCache(config=text)
    cache.activate_past_recording()  # a sliding layer can be cropped back only while it records
    return cache
'''


def build_cache_helper_file(root: Path) -> None:
    (root / "dflash" / "generation_cache.py").write_text(GENERATION_CACHE, encoding="utf-8")
    t.edit(root, FL, ("from transformers import DynamicCache, Qwen3Config\n",
                      "from transformers import DynamicCache, Qwen3Config\n\nfrom .generation_cache import create_generation_cache\n"),
           (CACHES, "    target_cache = create_generation_cache(target.config)\n    draft_cache = create_generation_cache(model.config)\n"))


def claims_cache_helper_file(root: Path, original: Path) -> None:
    decoder = _read(root, FL).split("def dflash_generate(")[1].split("\n\n\n")[0]
    assert "DynamicCache(" not in decoder and "create_generation_cache(target.config)" in decoder
    assert 'getattr(config, "text_config", config)' in _read(root, "dflash/generation_cache.py")


# ---------------------------------------------------------------- embeddings: the accessor first, the attribute only when it gives nothing
ACCESSOR_FIRST = '''def _input_embeddings(target):
    get = getattr(target, "get_input_embeddings", None)
    embed = get() if callable(get) else None
    if embed is None:  # a model without the accessor: reach into it
        embed = target.model.embed_tokens
    return embed


'''


def build_embed_accessor_first(root: Path) -> None:
    t.insert_before(root, FL, DECODING, ACCESSOR_FIRST)
    t.edit(root, FL, ("noise_embedding=target.model.embed_tokens(block),", "noise_embedding=_input_embeddings(target)(block),"))


def claims_embed_accessor_first(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "noise_embedding=_input_embeddings(target)(block)," in text and text.count("target.model.embed_tokens") == 1


# ---------------------------------------------------------------- drafted tokens in a local: the accepted count reads the draft's output
def build_draft_tokens_local(root: Path) -> None:
    t.edit(root, FL, ("                block[:, 1:] = sample(draft_logits, temperature)\n",
                      "                drafted = sample(draft_logits, temperature)\n"
                      "                block = torch.cat([block[:, :1], drafted], dim=1)\n"))


def claims_draft_tokens_local(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "block = torch.cat([block[:, :1], drafted], dim=1)" in text and "start += run + 1" in text
    assert "positions[:, draft_cache.get_seq_length() : start + block_size]" in text, "the draft is given positions read from its cache"


# ---------------------------------------------------------------- the legacy round trip that copies the cache
SNAPSHOT = '''def _snapshot(cache):
    """The prompt's cache, kept for a re-run from the prompt."""
    legacy = cache.to_legacy_cache()
    copied = tuple((k.detach().clone(), v.detach().clone()) for k, v in legacy)
    return DynamicCache.from_legacy_cache(copied)


'''


def build_legacy_copy(root: Path) -> None:
    t.insert_before(root, FL, DECODING, SNAPSHOT)
    t.edit(root, FL, ("    acceptance_lengths = []\n    start = prompt_len\n",
                      "    prompt_cache = _snapshot(target_cache)\n    acceptance_lengths = []\n    start = prompt_len\n"))


def claims_legacy_copy(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "cache.to_legacy_cache()" in text and "DynamicCache.from_legacy_cache(copied)" in text
    assert "prompt_cache = _snapshot(target_cache)" in text


# ---------------------------------------------------------------- CUDA events and memory statistics for the prefill's timing
def build_cuda_events(root: Path) -> None:
    t.edit(root, FL,
           ("    prefill_start = _cuda_time() if return_stats else None\n    first = target(\n",
            "    prefill_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))\n"
            "    torch.cuda.reset_peak_memory_stats()\n"
            "    prefill_events[0].record()\n    first = target(\n"),
           ("    time_to_first_token = _cuda_time() - prefill_start if return_stats else None\n",
            "    prefill_events[1].record()\n    torch.cuda.synchronize()\n"
            "    time_to_first_token = prefill_events[0].elapsed_time(prefill_events[1]) / 1000 if return_stats else None\n"
            "    prefill_memory = torch.cuda.max_memory_allocated()\n"))


def claims_cuda_events(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "torch.cuda.Event(enable_timing=True)" in text and "torch.cuda.reset_peak_memory_stats()" in text
    assert "prefill_events[0].elapsed_time(prefill_events[1])" in text and "prefill_start" not in text


REFUSALS = [
    Variant(
        "cache-helper-file", "refused without need", "dflash", build_cache_helper_file, claims_cache_helper_file,
        statuses={"target-cache-config": "fixed-upstream", "crop-compat": "applied"},
        summary="both caches from `create_generation_cache(<model>.config)` of `dflash/generation_cache.py`, which returns "
                "`DynamicCache(config=getattr(config, \"text_config\", config))` after `activate_past_recording()`",
    ),
    Variant(
        "embed-accessor-first", "refused without need", "dflash", build_embed_accessor_first, claims_embed_accessor_first,
        statuses={"input-embeddings": "fixed-upstream"},
        summary="`_input_embeddings(target)`: `getattr(target, \"get_input_embeddings\", None)` called first, "
                "`target.model.embed_tokens` only when it gives nothing",
    ),
    Variant(
        "draft-tokens-local", "refused without need", "dflash", build_draft_tokens_local, claims_draft_tokens_local,
        statuses={"crop-compat": "applied"},
        summary="the drafted tokens kept in a local (`block = torch.cat([block[:, :1], drafted], dim=1)`), so the accepted count "
                "`run` (and `start += run + 1`, both crops' argument) is read from the draft's output",
    ),
    Variant(
        "legacy-cache-copy", "refused without need", "dflash", build_legacy_copy, claims_legacy_copy,
        statuses={"removed-cache-api": "applied"},
        summary="`_snapshot(cache)`: `to_legacy_cache()`, every tensor cloned, `DynamicCache.from_legacy_cache(...)`, on the "
                "target's cache after the prefill",
    ),
    Variant(
        "cuda-events", "refused without need", "dflash", build_cuda_events, claims_cuda_events,
        statuses={"cpu-safe-timing": "applied"},
        summary="the prefill timed with `torch.cuda.Event(enable_timing=True)` (record, elapsed_time) after "
                "`torch.cuda.reset_peak_memory_stats()`, its peak read with `max_memory_allocated()`",
    ),
]

assert all(v.expected == LOSSLESS for v in REFUSALS)
VARIANTS.extend(REFUSALS)
BY_NAME.update({v.name: v for v in REFUSALS})
