"""draft_forward: a DFlash draft's sliding-window layers must stay windowed without flash-attn.

Upstream's draft hands ``sliding_window=`` to the attention function and passes no mask;
sdpa and eager ignore that argument. These tests show the plain call attends to the whole
context (the bug) and that ``draft_forward`` makes context outside the window irrelevant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from patcher.verify.presets import build_target, draft_config
from patcher.runtime import draft_forward

VENDORED_DFLASH = Path(__file__).resolve().parent.parent / "vendored" / "dflash"
WINDOW = 4
CONTEXT = 12
BLOCK = 4


@pytest.fixture(scope="module")
def draft_cls():
    sys.path.insert(0, str(VENDORED_DFLASH))
    try:
        from dflash.model import DFlashDraftModel
    finally:
        sys.path.remove(str(VENDORED_DFLASH))
        for name in [n for n in sys.modules if n == "dflash" or n.startswith("dflash.")]:
            del sys.modules[name]
    return DFlashDraftModel


def make_draft(cls, impl: str, window: int = WINDOW):
    torch.manual_seed(0)
    target = build_target("tiny-qwen3", seed=0)
    cfg = draft_config(target, cls.config_class, num_layers=1, block_size=BLOCK, sliding_window=window)
    cfg.layer_types = ["sliding_attention"]
    draft = cls._from_config(cfg, attn_implementation=impl).eval()
    return draft


def call(fn, draft, context, noise, cached: int = 0):
    from transformers import DynamicCache

    cache = DynamicCache()
    positions = torch.arange(CONTEXT + BLOCK)[None]
    with torch.inference_mode():
        if cached:  # a previous round left `cached` context positions in the draft cache
            fn(draft, target_hidden=context[:, :cached], noise_embedding=noise, position_ids=positions[:, : cached + BLOCK],
               past_key_values=cache, use_cache=True)
            cache.crop(-BLOCK)
        return fn(draft, target_hidden=context[:, cached:], noise_embedding=noise, position_ids=positions[:, cached:],
                  past_key_values=cache, use_cache=True)


def plain(model, **kwargs):
    return model(**kwargs)


def inputs(draft, seed=1):
    gen = torch.Generator().manual_seed(seed)
    width = len(draft.target_layer_ids) * draft.config.hidden_size
    return torch.randn(1, CONTEXT, width, generator=gen), torch.randn(1, BLOCK, draft.config.hidden_size, generator=gen)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("cached", [0, 6])
def test_context_outside_the_window_has_no_influence(draft_cls, impl, cached):
    draft = make_draft(draft_cls, impl)
    context, noise = inputs(draft)
    changed = context.clone()
    # the first block query sits at position CONTEXT; keys at <= CONTEXT - WINDOW are outside every window
    changed[:, : CONTEXT - WINDOW + 1] += 5.0
    assert torch.allclose(call(draft_forward, draft, context, noise, cached), call(draft_forward, draft, changed, noise, cached), atol=1e-5)
    assert not torch.allclose(call(plain, draft, context, noise, cached), call(plain, draft, changed, noise, cached), atol=1e-3), (
        "without the mask the draft attends beyond its window: the bug this step fixes"
    )


def test_inside_the_window_still_matters(draft_cls):
    draft = make_draft(draft_cls, "sdpa")
    context, noise = inputs(draft)
    changed = context.clone()
    changed[:, -1] += 5.0
    assert not torch.allclose(call(draft_forward, draft, context, noise), call(draft_forward, draft, changed, noise), atol=1e-3)


def test_sdpa_and_eager_agree_and_a_wide_window_is_a_plain_call(draft_cls):
    sdpa, eager = make_draft(draft_cls, "sdpa"), make_draft(draft_cls, "eager")
    context, noise = inputs(sdpa)
    assert torch.allclose(call(draft_forward, sdpa, context, noise), call(draft_forward, eager, context, noise), atol=1e-5)
    wide = make_draft(draft_cls, "sdpa", window=10_000)
    assert torch.allclose(call(draft_forward, wide, context, noise), call(plain, wide, context, noise), atol=1e-6)


def test_forward_is_restored(draft_cls):
    draft = make_draft(draft_cls, "sdpa")
    context, noise = inputs(draft)
    call(draft_forward, draft, context, noise)
    assert all("forward" not in m.__dict__ for m in draft.modules())


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_window_edge_is_exact(draft_cls, impl):
    """A query at position q sees a key at k exactly when q - k < window (transformers' sliding
    convention): the key at distance window is out, the one at window - 1 is in."""
    draft = make_draft(draft_cls, impl)
    context, noise = inputs(draft)
    first_query = CONTEXT  # the block's first position
    base = call(draft_forward, draft, context, noise)

    at_window = context.clone()
    at_window[:, first_query - WINDOW] += 5.0  # distance exactly WINDOW from the first query, more from the rest
    assert torch.allclose(base, call(draft_forward, draft, at_window, noise), atol=1e-5)

    inside = context.clone()
    inside[:, first_query - WINDOW + 1] += 5.0  # distance WINDOW - 1: only the first query sees it
    moved = (call(draft_forward, draft, inside, noise) - base).abs().amax(dim=-1)[0]
    assert moved[0] > 1e-3, "the key just inside the window must count"
    assert torch.all(moved[1:] < 1e-5), "later queries are further than the window from it"
