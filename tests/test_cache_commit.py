"""The commit belongs to the cache: every way of cutting a recorded cache back is exact, or raises.

After ``verify_forward`` has recorded a verify on a hybrid target's cache, the cache's own
``crop`` commits the record. So a native 5.x count (``cache.crop(-n)``,
``cache.crop(n - cache.get_seq_length())``, ``crop(0)``), the 4.x-meaning helper
``crop_cache``, a helper that crops the layers one by one, ``compact_cache`` and
``@tree_commit`` all leave exactly the state of a from-scratch run of "prompt + kept tokens",
with and without ``activate_past_recording()``. What cannot be made exact (a cache shortened
behind the runtime's back, a tree crop without its accepted path) raises.

Every check compares all cache tensors and the next logits with a from-scratch run; the
presets draw the Gated DeltaNet decay so that a state that keeps a rejected token changes the
logits (``test_a_lossy_cut_is_detected`` shows the comparison fails on one).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from runtime_support import ATOL, RTOL, depths, model, one_thread, prefill, tree_mask  # noqa: F401 (fixture)
from runtime_support import VOCAB_DRAW as VOCAB

from patcher import runtime as rt

PRESETS = ["tiny-qwen3_5", "tiny-qwen3_5-vlm", "tiny-qwen3-next"]


def state(cache):
    """Every tensor the next forward reads; a recording conv state counts by its last kernel columns."""
    out = []
    for i, layer in enumerate(cache.layers):
        if hasattr(layer, "recurrent_states"):
            kernel = layer.conv_kernel_size[0]
            out.append((f"L{i}.conv", layer.conv_states[0][..., -kernel:]))
            if layer.recurrent_states[0] is not None:  # a short-conv layer (LFM2) has none
                out.append((f"L{i}.recurrent", layer.recurrent_states[0]))
        else:
            out += [(f"L{i}.keys", layer.keys), (f"L{i}.values", layer.values)]
    return out


def next_logits(m, cache, token=5):
    return m(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]


def assert_lossless(m, cache, prompt, kept):
    ref = prefill(m, torch.cat([prompt, kept], dim=1))
    assert cache.get_seq_length() == ref.get_seq_length()
    for (name, a), (_, b) in zip(state(cache), state(ref), strict=True):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda msg, name=name: f"{name}: {msg}")
    torch.testing.assert_close(next_logits(m, cache), next_logits(m, ref), atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------------
# chain: each way of cutting back, with the number of kept verify tokens
# ------------------------------------------------------------------------------------------


def native_count(cache, new_len):
    cache.crop(-(cache.get_seq_length() - new_len))


def native_inline(cache, new_len):
    cache.crop(new_len - cache.get_seq_length())


def helper_remove(cache, new_len):
    # DFlash's newer style: the helper computes the count itself
    remove = cache.get_seq_length() - new_len
    cache.crop(-remove)


def legacy_length(cache, new_len):
    rt.crop_cache(cache, new_len)


def legacy_negative(cache, new_len):
    drop = cache.get_seq_length() - new_len
    rt.crop_cache(cache, -drop if drop else new_len)  # crop_cache(cache, 0) would keep nothing


def layer_by_layer(cache, new_len):
    # a helper of another shape: it crops every layer itself
    remove = cache.get_seq_length() - new_len
    for layer in cache.layers:
        layer.crop(-remove)


CUTS = [native_count, native_inline, helper_remove, legacy_length, legacy_negative, layer_by_layer]


def run_chain(name, cut, keep, record_past, prompt_len=6, block_size=5, seed=0):
    m = model(name)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=gen)
    block = torch.randint(0, VOCAB, (1, block_size), generator=gen)
    cache = prefill(m, prompt, record_past)
    pos = torch.arange(prompt_len, prompt_len + block_size)[None]
    rt.verify_forward(m, block, position_ids=pos, past_key_values=cache, use_cache=True)
    cut(cache, prompt_len + keep)
    return m, cache, prompt, block[:, :keep]


MATRIX = [("tiny-qwen3_5", cut, rp) for cut in CUTS for rp in (False, True)] + [
    (name, cut, rp)
    for name in ("tiny-qwen3_5-vlm", "tiny-qwen3-next")
    for cut, rp in ((helper_remove, True), (legacy_length, False), (layer_by_layer, True))
] + [
    # the mechanism is the cache's, not Gated DeltaNet's: a Mamba2 and a short-conv target too
    (name, native_count, True) for name in ("tiny-nemotron-h", "tiny-lfm2")
]


@pytest.mark.parametrize(
    "name, cut, record_past",
    MATRIX,
    ids=[f"{n}-{c.__name__}-{'recording' if r else 'plain'}" for n, c, r in MATRIX],
)
def test_every_chain_cut_commits_exactly(name, cut, record_past):
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for keep in (2, 5, 1):  # partial, everything (a count of 0), only the first token
            m, cache, prompt, kept = run_chain(name, cut, keep, record_past, seed=keep)
            assert rt._get_record(cache).settled == prompt.shape[1] + keep
            assert_lossless(m, cache, prompt, kept)


def test_two_rounds_of_native_crops_compose():
    m = model("tiny-qwen3_5")
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=gen)
    b1 = torch.randint(0, VOCAB, (1, 4), generator=gen)
    b2 = torch.randint(0, VOCAB, (1, 4), generator=gen)
    with torch.inference_mode():
        cache = prefill(m, prompt, record_past=True)
        rt.verify_forward(m, b1, position_ids=torch.arange(5, 9)[None], past_key_values=cache, use_cache=True)
        cache.crop(-2)
        rt.verify_forward(m, b2, position_ids=torch.arange(7, 11)[None], past_key_values=cache, use_cache=True)
        cache.crop(0)  # everything kept: drops nothing
        rt.verify_forward(m, b1, position_ids=torch.arange(11, 15)[None], past_key_values=cache, use_cache=True)
        cache.crop(-3)
        # a recording conv state does not grow round after round
        layer = cache.layers[rt.hybrid_linear_modules(m)[0][0]]
        assert layer.conv_states[0].shape[-1] == layer.conv_kernel_size[0]
        assert_lossless(m, cache, prompt, torch.cat([b1[:, :2], b2, b1[:, :1]], 1))


def test_uncommitted_chain_then_verify_means_all_kept():
    """A verify that is never cut back kept every token: the next verify builds on all of them."""
    m = model("tiny-qwen3_5")
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, VOCAB, (1, 4), generator=gen)
    b1 = torch.randint(0, VOCAB, (1, 3), generator=gen)
    b2 = torch.randint(0, VOCAB, (1, 3), generator=gen)
    with torch.inference_mode():
        cache = prefill(m, prompt)
        rt.verify_forward(m, b1, position_ids=torch.arange(4, 7)[None], past_key_values=cache, use_cache=True)
        rt.verify_forward(m, b2, position_ids=torch.arange(7, 10)[None], past_key_values=cache, use_cache=True)
        cache.crop(-1)
        assert_lossless(m, cache, prompt, torch.cat([b1, b2[:, :2]], 1))


def test_a_lossy_cut_is_detected():
    """The comparison can fail: restoring nothing (what transformers' own crop does to the
    recurrent state) is caught by assert_lossless on this preset."""
    m = model("tiny-qwen3_5")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=gen)
    block = torch.randint(0, VOCAB, (1, 5), generator=gen)
    with torch.inference_mode():
        cache = prefill(m, prompt, record_past=True)
        m(block, position_ids=torch.arange(6, 11)[None], past_key_values=cache, use_cache=True)
        # what transformers' own crop does on 5.23: conv rolled back, recurrent state keeps the rejected tokens
        for layer in cache.layers:
            if hasattr(layer, "recurrent_states"):
                kernel = layer.conv_kernel_size[0]
                layer.conv_states[0] = layer.conv_states[0][..., -3 - kernel : -3]
                if hasattr(layer, "cumulative_length_linear"):  # 5.25+: linear layers count tokens
                    layer.cumulative_length_linear.sub_(3)
            else:
                type(layer).crop(layer, -3)
        with pytest.raises(AssertionError):
            assert_lossless(m, cache, prompt, block[:, :2])


# ------------------------------------------------------------------------------------------
# crop_cache's own meaning (4.x lengths), on a pure attention cache and a hybrid one
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3_5"])
@pytest.mark.parametrize(
    "arg, expected",
    [(0, 0), (3, 3), (9, 9), (50, 9), (-2, 7), (-9, 0), (-50, 0)],
    ids=["zero-keeps-nothing", "positive", "exact-length", "past-the-end", "negative", "negative-all", "negative-past"],
)
def test_crop_cache_meaning(name, arg, expected):
    m = model(name)
    prompt = torch.arange(1, 7)[None]
    block = torch.tensor([[7, 8, 9]])
    with torch.inference_mode():
        cache = prefill(m, prompt)
        rt.verify_forward(m, block, position_ids=torch.arange(6, 9)[None], past_key_values=cache, use_cache=True)
        if name == "tiny-qwen3_5" and expected < 6:
            with pytest.raises(RuntimeError, match="below the start of the recorded verify"):
                rt.crop_cache(cache, arg)
            return
        rt.crop_cache(cache, arg)
        assert cache.get_seq_length() == expected
        if expected >= 6:
            assert_lossless(m, cache, prompt, block[:, : expected - 6])


def test_native_positive_crop_still_refused():
    m = model("tiny-qwen3_5")
    with torch.inference_mode():
        cache = prefill(m, torch.tensor([[1, 2, 3]]))
        rt.verify_forward(m, torch.tensor([[4, 5]]), past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="positive"):
            cache.crop(4)


# ------------------------------------------------------------------------------------------
# tree
# ------------------------------------------------------------------------------------------


def tree_verify(m, cache, prompt_len, parents, tokens):
    rt.verify_forward(
        m,
        tokens,
        position_ids=(prompt_len + torch.tensor(depths(parents)))[None],
        attention_mask=tree_mask(parents, prompt_len),
        past_key_values=cache,
        use_cache=True,
    )


def compact_by_hand(cache, past, keep):
    """A compaction helper of DDTree's shape: moves kept K/V rows, then crops natively."""
    index = torch.tensor(keep)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.dim() < 2:
            continue
        for t in (layer.keys, layer.values):
            tail = t.narrow(-2, past, t.shape[-2] - past).index_select(-2, index)
            t.narrow(-2, past, len(keep)).copy_(tail)
    cache.crop(past + len(keep) - cache.get_seq_length())


PARENTS = [-1, 0, 0, 1, 2, 4]  # node 2 is a sibling of node 1


@pytest.mark.parametrize("strategy", ["node", "path"])
@pytest.mark.parametrize("name", PRESETS)
def test_tree_commits(name, strategy, monkeypatch):
    monkeypatch.setattr(rt, "TREE_STRATEGY", strategy)
    m = model(name)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=gen)
    tokens = torch.randint(0, VOCAB, (1, len(PARENTS)), generator=gen)
    decorated = rt.tree_commit("cache", "past", "keep")(compact_by_hand)
    with torch.inference_mode():
        for keep, commit in (
            ([0, 2, 4, 5], lambda c, k: rt.compact_cache(c, 5, k)),
            ([0, 1, 3], lambda c, k: decorated(c, 5, k)),
            ([0], lambda c, k: c.crop(-(len(PARENTS) - 1))),  # the root alone needs no path
        ):
            cache = prefill(m, prompt, record_past=True)
            tree_verify(m, cache, 5, PARENTS, tokens)
            commit(cache, keep)
            assert_lossless(m, cache, prompt, tokens[:, keep])


def test_tree_cut_without_its_path_raises():
    """Nodes [0, 1] are a path here, but the accepted one may be [0, 2]: never guess."""
    m = model("tiny-qwen3_5")
    prompt = torch.tensor([[1, 2, 3, 4]])
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.inference_mode():
        cache = prefill(m, prompt)
        tree_verify(m, cache, 4, PARENTS, tokens)
        with pytest.raises(RuntimeError, match="without its accepted path"):
            compact_by_hand(cache, 4, [0, 2])
        cache = prefill(m, prompt)
        tree_verify(m, cache, 4, PARENTS, tokens)
        with pytest.raises(RuntimeError, match="without its accepted path"):
            rt.crop_cache(cache, 6)


def test_chain_shaped_tree_can_be_cropped():
    m = model("tiny-qwen3_5")
    prompt = torch.tensor([[1, 2, 3, 4]])
    tokens = torch.tensor([[5, 6, 7, 8]])
    parents = [-1, 0, 1, 2]
    with torch.inference_mode():
        cache = prefill(m, prompt)
        tree_verify(m, cache, 4, parents, tokens)
        cache.crop(-1)
        assert_lossless(m, cache, prompt, tokens[:, :3])


# ------------------------------------------------------------------------------------------
# what cannot be exact raises
# ------------------------------------------------------------------------------------------


def test_cut_behind_the_runtimes_back_raises_at_next_verify():
    m = model("tiny-qwen3_5")
    with torch.inference_mode():
        cache = prefill(m, torch.tensor([[1, 2, 3, 4]]))
        rt.verify_forward(m, torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
        for layer in cache.layers:  # shortened by slicing, not by a crop
            if getattr(layer, "keys", None) is not None and layer.keys.dim() >= 2:
                layer.keys, layer.values = layer.keys[..., :-2, :], layer.values[..., :-2, :]
        with pytest.raises(RuntimeError, match="without committing the recorded verify"):
            rt.verify_forward(m, torch.tensor([[8, 9]]), past_key_values=cache, use_cache=True)


def test_tree_never_cut_back_raises_at_next_verify():
    m = model("tiny-qwen3_5")
    with torch.inference_mode():
        cache = prefill(m, torch.tensor([[1, 2, 3, 4]]))
        tree_verify(m, cache, 4, PARENTS, torch.tensor([[5, 6, 7, 8, 9, 10]]))
        with pytest.raises(RuntimeError, match="without its accepted path"):
            rt.verify_forward(m, torch.tensor([[8, 9]]), past_key_values=cache, use_cache=True)


def test_second_cut_below_a_commit_raises():
    m = model("tiny-qwen3_5")
    with torch.inference_mode():
        cache = prefill(m, torch.tensor([[1, 2, 3, 4]]))
        rt.verify_forward(m, torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
        cache.crop(-1)
        cache.crop(0)  # dropping nothing more is fine
        with pytest.raises(RuntimeError, match="committed for 6"):
            cache.crop(-1)


def test_never_recorded_hybrid_cache_warns_and_draft_cache_is_untouched():
    """Without verify_forward there is no record: a lossy crop warns (the code-shape-only world),
    and a cache verify_forward never saw keeps transformers' own crop."""
    m = model("tiny-qwen3_5")
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = prefill(m, torch.tensor([[1, 2, 3]]))
        m(torch.tensor([[4, 5]]), past_key_values=cache, use_cache=True)
        rt.crop_cache(cache, 4)
        assert "crop" not in cache.__dict__
    ours = [w for w in caught if "ddpatch" in str(w.message)]  # 5.25 adds its own deprecation warnings
    assert [issubclass(w.category, RuntimeWarning) for w in ours] == [True]
