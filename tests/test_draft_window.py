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

from patcher.verify.models.presets import build_target, draft_config
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


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_config_built_draft_cache_is_windowed_like_a_bare_one(draft_cls, impl):
    """A draft cache built from the drafter's config (DFlash's newest ``_make_cache(model.config)``) has sliding
    layers that keep ``window - 1`` keys and hand attention those plus the new ones: that trims, it does not
    window a query of several tokens. ``draft_forward`` masks exactly the keys such a layer holds, so round
    after round past the window the draft equals the same draft over a bare cache."""
    from transformers import DynamicCache

    from patcher.runtime import record_past

    draft = make_draft(draft_cls, impl)
    bare, built = DynamicCache(), DynamicCache(config=draft.config)
    record_past(built)
    width = len(draft.target_layer_ids) * draft.config.hidden_size
    gen = torch.Generator().manual_seed(2)
    draft_from, start, trimmed = 0, 6, False
    with torch.inference_mode():
        for accepted in (1, 4, 2, 3, 4, 1):
            context = torch.randn(1, start - draft_from, width, generator=gen)
            noise = torch.randn(1, BLOCK, draft.config.hidden_size, generator=gen)
            kw = dict(target_hidden=context, noise_embedding=noise, position_ids=torch.arange(draft_from, start + BLOCK)[None], use_cache=True)
            trimmed |= built.get_seq_length() > WINDOW - 1
            want = draft_forward(draft, past_key_values=bare, **kw)
            got = draft_forward(draft, past_key_values=built, **kw)
            assert torch.allclose(got, want, atol=1e-5), f"round at {start}: a sliding cache layer's keys are masked wrongly"
            bare.crop(-BLOCK)
            built.crop(-BLOCK)
            draft_from, start = start, start + accepted
    assert built.layers[0].is_sliding and trimmed, "the sliding layer never held a full window: the test cannot fail"


# ---------------------------------------------------------------- drafters that mask themselves (issue 22)


def _draft_class_of(root: Path):
    sys.path.insert(0, str(root))
    try:
        from dflash.model import DFlashDraftModel
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n == "dflash" or n.startswith("dflash.")]:
            del sys.modules[name]
    return DFlashDraftModel


@pytest.fixture(scope="module", params=["draft-masks-itself", "native-5x"])
def self_masking_cls(request, tmp_path_factory):
    """DFlash drafters that mask themselves: the attention builds a causal sliding mask when given
    none (``draft-masks-itself``, DFlash's newest style), or the model hands each layer its
    type's mask (``native-5x``)."""
    from drift.variants import BY_NAME

    variant = BY_NAME[request.param]
    return _draft_class_of(variant.make(tmp_path_factory.mktemp(request.param) / "src"))


def _two_layer_draft(cls, impl: str):
    torch.manual_seed(0)
    target = build_target("tiny-qwen3", seed=0)
    cfg = draft_config(target, cls.config_class, num_layers=2, block_size=BLOCK, sliding_window=WINDOW)
    cfg.layer_types = ["sliding_attention", "full_attention"]
    return cls._from_config(cfg, attn_implementation=impl).eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("cached", [0, 6])
def test_draft_forward_never_replaces_a_mask_the_drafter_builds_itself(self_masking_cls, impl, cached):
    """Bit for bit: through ``draft_forward`` a self-masking drafter computes exactly what it computes alone."""
    draft = _two_layer_draft(self_masking_cls, impl)
    context, noise = inputs(draft)
    alone = call(plain, draft, context, noise, cached)
    assert torch.equal(call(draft_forward, draft, context, noise, cached), alone)
    assert all("forward" not in m.__dict__ for m in draft.modules())


def _hand_layers_a_causal_mask(draft):
    """Make the vendored drafter hand each layer a mask of its own (causal over the keys), as a
    drafter that builds its masks in its model-level forward does."""

    def hook(module, args, kwargs):
        hidden = args[0]
        context = kwargs["target_hidden"] if "target_hidden" in kwargs else args[1]  # by keyword, as the real DFlash calls
        cache = kwargs.get("past_key_values")
        past = cache.get_seq_length(module.self_attn.layer_idx) if cache is not None else 0
        q, k = hidden.shape[1], past + context.shape[1] + hidden.shape[1]
        q_pos = torch.arange(k - q, k)[:, None]
        hidden_keys = torch.arange(k)[None, :] > q_pos
        mask = torch.zeros(q, k, dtype=hidden.dtype).masked_fill(hidden_keys, torch.finfo(hidden.dtype).min)
        return args, {**kwargs, "attention_mask": mask[None, None]}

    for layer in draft.layers:
        layer.register_forward_pre_hook(hook, with_kwargs=True)
    return draft


@pytest.mark.parametrize("cached", [0, 6])
def test_draft_forward_keeps_the_mask_a_drafter_hands_its_layers(draft_cls, cached):
    draft = _hand_layers_a_causal_mask(make_draft(draft_cls, "sdpa"))
    context, noise = inputs(draft)
    assert torch.equal(call(draft_forward, draft, context, noise, cached), call(plain, draft, context, noise, cached))


def test_the_patched_self_masking_draft_computes_what_the_unpatched_one_does(tmp_path):
    """``draft-masks-itself`` patched: draft-sliding-window says fixed-upstream, the draft call is not
    wrapped, and the patched tree's drafter gives the unpatched one's outputs bit for bit."""
    from drift import outcome
    from drift.variants import BY_NAME

    src = BY_NAME["draft-masks-itself"].make(tmp_path / "src")
    report = outcome.apply(src, tmp_path / "out", tmp_path / "home")
    assert report.exit_code == 0 and report.statuses["draft-sliding-window"] == "fixed-upstream", report.raw[-2000:]
    patched = (tmp_path / "out" / "dflash" / "model.py").read_text()
    assert "draft_forward(" not in patched and "verify_forward(" in patched
    outputs = []
    for root in (src, tmp_path / "out"):
        draft = _two_layer_draft(_draft_class_of(root), "sdpa")
        context, noise = inputs(draft)
        outputs.append(call(plain, draft, context, noise, 6))
    assert torch.equal(*outputs)


def test_a_draft_forward_nested_in_the_drafters_own_layer_calls_is_a_plain_call(draft_cls):
    """A tree patched by hand (or by an older recipe) routes both the decode loop's drafter call and
    each layer call inside the drafter's forward through ``draft_forward``. The nested call must be a
    plain call: routing the same attention modules twice made each route call itself (RecursionError
    on the real DFlash HEAD). The result equals the single, outer call's."""
    draft = make_draft(draft_cls, "sdpa")
    context, noise = inputs(draft)
    expected = call(draft_forward, draft, context, noise)
    calls = []

    class Routed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            calls.append(kwargs.get("position_ids") is not None)
            return draft_forward(self.inner, *args, **kwargs)

    layers = draft.layers
    draft.layers = torch.nn.ModuleList([Routed(layer) for layer in layers])
    try:
        nested = call(draft_forward, draft, context, noise)
    finally:
        draft.layers = layers
    assert calls and all(calls), "the layers were not called through the nested helper with their positions"
    assert torch.allclose(nested, expected, atol=1e-6)
