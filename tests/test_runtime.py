"""Tests for patcher/runtime.py: lossless verify/commit on hybrid Gated DeltaNet targets.

Every check compares against a fresh cache that ran "prompt + accepted tokens" from scratch:
every GDN layer's conv and recurrent state, every attention layer's K/V, and the next-step
logits. Hypothesis draws prompts, blocks, tree shapes and accepted paths (few examples, no
deadline, derandomized so CI failures reproduce).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime_support import ATOL, RTOL, VOCAB_DRAW, depths, model, path_to, prefill, tree_mask

from patcher import runtime as rt

transformers = pytest.importorskip("transformers")
DynamicCache = transformers.DynamicCache

HYBRID_MAIN = ["tiny-qwen3_5", "tiny-qwen3_5-vlm"]
HYBRID_MORE = ["tiny-qwen3_5-moe", "tiny-qwen3-next"]


def _settings(n):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def cache_tensors(cache):
    out = []
    for i, layer in enumerate(cache.layers):
        if hasattr(layer, "recurrent_states"):
            out += [(f"L{i}.conv", layer.conv_states[0]), (f"L{i}.recurrent", layer.recurrent_states[0])]
        else:
            out += [(f"L{i}.keys", layer.keys), (f"L{i}.values", layer.values)]
    return out


def assert_same_cache(got, want):
    for (name, a), (_, b) in zip(cache_tensors(got), cache_tensors(want), strict=True):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, name=name: f"{name}: {m}")


def next_logits(m, cache, token=5):
    return m(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]


def assert_lossless(m, cache, prompt, accepted):
    """``cache`` must equal a from-scratch run of prompt + accepted, and predict the same next token."""
    ref = prefill(m, torch.cat([prompt, accepted], dim=1))
    assert cache.get_seq_length() == ref.get_seq_length()
    assert_same_cache(cache, ref)
    torch.testing.assert_close(next_logits(m, cache), next_logits(m, ref), atol=ATOL, rtol=RTOL)


@rt.tree_commit("past_key_values", "past_length", "keep_current_indices")
def compact_dynamic_cache(past_key_values, past_length, keep_current_indices):
    """Upstream DDTree's compaction, as patched: compact layers with `.keys`, then crop."""
    if len(keep_current_indices) == 0:
        rt.crop_cache(past_key_values, past_length)
        return
    keep = torch.tensor(keep_current_indices, dtype=torch.long)
    for layer in past_key_values.layers:
        if not hasattr(layer, "keys"):
            continue  # upstream skips linear layers
        for t in (layer.keys, layer.values):
            tail = t.narrow(-2, past_length, t.shape[-2] - past_length).index_select(-2, keep)
            t.narrow(-2, past_length, len(keep)).copy_(tail)
    rt.crop_cache(past_key_values, past_length + len(keep_current_indices))


@st.composite
def trees(draw, max_nodes=8):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    accepted = draw(st.integers(0, n - 1))
    return parents, accepted


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP spinning
    makes them several times slower; restore the setting for other test modules."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def _default_strategy():
    saved = rt.TREE_STRATEGY
    yield
    rt.TREE_STRATEGY = saved


# ------------------------------------------------------------------------------------------
# chain
# ------------------------------------------------------------------------------------------


def check_chain(name, prompt_len, block_size, k, seed):
    m = model(name)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB_DRAW, (1, prompt_len), generator=gen)
    block = torch.randint(0, VOCAB_DRAW, (1, block_size), generator=gen)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        cache = prefill(m, prompt)
        pos = torch.arange(prompt_len, prompt_len + block_size)[None]
        out = rt.verify_forward(
            m, block, position_ids=pos, past_key_values=cache, use_cache=True, output_hidden_states=True
        )
        plain = m(torch.cat([prompt, block], 1)).logits[:, prompt_len:]
        torch.testing.assert_close(out.logits, plain, atol=ATOL, rtol=RTOL)
        start = prompt_len + k + 1  # keep the k accepted draft tokens and block[0]
        rt.crop_cache(cache, start)
        assert rt._get_record(cache).settled == start
        assert_lossless(m, cache, prompt, block[:, : k + 1])


@pytest.mark.parametrize("name", HYBRID_MAIN)
@_settings(15)
@given(
    prompt_len=st.integers(1, 10),
    block_size=st.integers(4, 6),
    k=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_chain_commit_matches_from_scratch(name, prompt_len, block_size, k, seed):
    check_chain(name, prompt_len, block_size, min(k, block_size - 1), seed)


@pytest.mark.parametrize("name", HYBRID_MORE)
@_settings(4)
@given(prompt_len=st.integers(1, 8), k=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_chain_commit_more_presets(name, prompt_len, k, seed):
    check_chain(name, prompt_len, 4, k, seed)


def test_chain_negative_crop_and_no_grad():
    """A negative crop drops tokens; the helper also works under plain no_grad."""
    m = model("tiny-qwen3_5")
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB_DRAW, (1, 6), generator=gen)
    block = torch.randint(0, VOCAB_DRAW, (1, 5), generator=gen)
    with torch.no_grad():
        cache = prefill(m, prompt)
        rt.verify_forward(m, block, position_ids=torch.arange(6, 11)[None], past_key_values=cache, use_cache=True)
        rt.crop_cache(cache, -3)
        assert_lossless(m, cache, prompt, block[:, :2])


def test_chain_two_rounds():
    """Commits compose: two verify/commit rounds equal one from-scratch run."""
    m = model("tiny-qwen3_5-vlm")
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, VOCAB_DRAW, (1, 5), generator=gen)
    b1 = torch.randint(0, VOCAB_DRAW, (1, 4), generator=gen)
    b2 = torch.randint(0, VOCAB_DRAW, (1, 4), generator=gen)
    with torch.inference_mode():
        cache = prefill(m, prompt)
        rt.verify_forward(m, b1, position_ids=torch.arange(5, 9)[None], past_key_values=cache, use_cache=True)
        rt.crop_cache(cache, 7)
        rt.verify_forward(m, b2, position_ids=torch.arange(7, 11)[None], past_key_values=cache, use_cache=True)
        rt.crop_cache(cache, 8)
        assert_lossless(m, cache, prompt, torch.cat([b1[:, :2], b2[:, :1]], 1))


# ------------------------------------------------------------------------------------------
# tree
# ------------------------------------------------------------------------------------------


def check_tree(name, strategy, prompt_len, parents, accepted, seed, via):
    rt.TREE_STRATEGY = strategy
    m = model(name)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB_DRAW, (1, prompt_len), generator=gen)
    tokens = torch.randint(0, VOCAB_DRAW, (1, len(parents)), generator=gen)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        cache = prefill(m, prompt)
        gdn = [mod for _, mod in rt.hybrid_linear_modules(m)]
        out = rt.verify_forward(
            m,
            tokens,
            position_ids=(prompt_len + torch.tensor(depths(parents)))[None],
            attention_mask=tree_mask(parents, prompt_len),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        assert all("forward" not in mod.__dict__ for mod in gdn), "GDN forward not restored"
        # The real fix for sibling mixing: every node's logits are those of its own path.
        for node in range(len(parents)):
            ids = torch.cat([prompt, tokens[:, path_to(parents, node)]], 1)
            ref = m(ids).logits[0, -1]
            torch.testing.assert_close(out.logits[0, node], ref, atol=ATOL, rtol=RTOL)
        keep = path_to(parents, accepted)
        if via == "compact_cache":
            rt.compact_cache(cache, prompt_len, keep)
        else:
            compact_dynamic_cache(cache, prompt_len, keep)
        assert rt._get_record(cache).settled == prompt_len + len(keep)
        assert_lossless(m, cache, prompt, tokens[:, keep])


@pytest.mark.parametrize("strategy", ["node", "path"])
@pytest.mark.parametrize("name", HYBRID_MAIN)
@_settings(12)
@given(
    prompt_len=st.integers(1, 8),
    tree=trees(),
    seed=st.integers(0, 2**16),
    via=st.sampled_from(["compact_cache", "tree_commit"]),
)
def test_tree_verify_and_commit_match_from_scratch(name, strategy, prompt_len, tree, seed, via):
    check_tree(name, strategy, prompt_len, *tree, seed, via)


@pytest.mark.parametrize("strategy", ["node", "path", "auto"])
@pytest.mark.parametrize("name", HYBRID_MORE)
@_settings(3)
@given(prompt_len=st.integers(1, 6), tree=trees(max_nodes=6), seed=st.integers(0, 2**16))
def test_tree_more_presets(name, strategy, prompt_len, tree, seed):
    check_tree(name, strategy, prompt_len, *tree, seed, "tree_commit")


def test_tree_then_chain_round():
    """A tree commit leaves a cache that a chain round continues losslessly."""
    m = model("tiny-qwen3_5")
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB_DRAW, (1, 4), generator=gen)
    tokens = torch.randint(0, VOCAB_DRAW, (1, 5), generator=gen)
    block = torch.randint(0, VOCAB_DRAW, (1, 4), generator=gen)
    parents = [-1, 0, 0, 2, 2]
    with torch.inference_mode():
        cache = prefill(m, prompt)
        rt.verify_forward(
            m,
            tokens,
            position_ids=(4 + torch.tensor(depths(parents)))[None],
            attention_mask=tree_mask(parents, 4),
            past_key_values=cache,
            use_cache=True,
        )
        compact_dynamic_cache(cache, 4, [0, 2, 4])
        rt.verify_forward(m, block, position_ids=torch.arange(7, 11)[None], past_key_values=cache, use_cache=True)
        rt.crop_cache(cache, 9)
        assert_lossless(m, cache, prompt, torch.cat([tokens[:, [0, 2, 4]], block[:, :2]], 1))


def test_tree_mask_parents_and_validation():
    parents = [-1, 0, 0, 1, 2, 4]
    assert rt.tree_parents_from_mask(tree_mask(parents, 3)) == parents
    assert rt.tree_parents_from_mask(tree_mask(parents, 3) == 0) == parents  # bool mask, True = visible
    bad = tree_mask(parents, 3)
    bad[0, 0, 2, 3 + 1] = 0  # node 2 also sees its sibling 1
    with pytest.raises(ValueError):
        rt.tree_parents_from_mask(bad)


def test_tree_forward_restored_on_error():
    m = model("tiny-qwen3_5")
    gdn = [mod for _, mod in rt.hybrid_linear_modules(m)]
    with torch.inference_mode():
        cache = prefill(m, torch.tensor([[1, 2, 3]]))
        with pytest.raises(Exception):  # noqa: B017  (any failure inside the model: what follows is the point)
            rt.verify_forward(
                m,
                torch.tensor([[4, 5]]),
                position_ids=torch.tensor([[3, 4, 5, 6, 7]]),  # wrong length: fails inside the model
                attention_mask=tree_mask([-1, 0], 3),
                past_key_values=cache,
                use_cache=True,
            )
    assert all("forward" not in mod.__dict__ for mod in gdn)
    # a failed verify leaves a record still in flight: no commit can be exact on that cache any more
    assert rt._get_record(cache).inflight
    with pytest.raises(RuntimeError, match="raised before it returned"):
        cache.crop(-1)


def test_discovery_cross_checks_config():
    for name in HYBRID_MAIN + HYBRID_MORE:
        m = model(name)
        found = [i for i, _ in rt.hybrid_linear_modules(m)]
        types = m.config.get_text_config(decoder=True).layer_types
        assert found == [i for i, t in enumerate(types) if t == "linear_attention"]
    assert rt.hybrid_linear_modules(model("tiny-qwen3")) == ()


# ------------------------------------------------------------------------------------------
# negative controls: the bug is real and detectable
# ------------------------------------------------------------------------------------------


def naive_crop(cache, length):
    """What upstream effectively does today: crop attention layers, skip the linear ones."""
    drop = cache.get_seq_length() - length
    for layer in cache.layers:
        if hasattr(layer, "keys"):
            layer.crop(-drop)


@pytest.mark.parametrize("name", HYBRID_MAIN)
def test_naive_chain_rollback_is_detectably_wrong(name):
    m = model(name)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB_DRAW, (1, 6), generator=gen)
    block = torch.randint(0, VOCAB_DRAW, (1, 5), generator=gen)
    with torch.inference_mode():
        cache = prefill(m, prompt)
        m(block, position_ids=torch.arange(6, 11)[None], past_key_values=cache, use_cache=True)
        naive_crop(cache, 8)
        ref = prefill(m, torch.cat([prompt, block[:, :2]], 1))
        diff = (next_logits(m, cache) - next_logits(m, ref)).abs().max().item()
    assert diff > 1e-2, f"the naive rollback looked lossless (max diff {diff}); the preset cannot expose the bug"


def test_naive_flat_tree_mixes_siblings():
    m = model("tiny-qwen3_5")
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB_DRAW, (1, 5), generator=gen)
    tokens = torch.randint(0, VOCAB_DRAW, (1, 4), generator=gen)
    parents = [-1, 0, 0, 0]
    with torch.inference_mode():
        cache = prefill(m, prompt)
        out = m(
            tokens,
            position_ids=(5 + torch.tensor(depths(parents)))[None],
            attention_mask=tree_mask(parents, 5),
            past_key_values=cache,
            use_cache=True,
        )
        ref = m(torch.cat([prompt, tokens[:, [0, 3]]], 1)).logits[0, -1]
    assert (out.logits[0, 3] - ref).abs().max().item() > 1e-2


def test_crop_without_record_warns_once():
    m = model("tiny-qwen3_5")
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = prefill(m, torch.tensor([[1, 2, 3, 4]]))
        m(torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
        rt.crop_cache(cache, 5)  # must not raise on linear layers
        assert cache.get_seq_length() == 5
        m(torch.tensor([[8, 9]]), past_key_values=cache, use_cache=True)
        rt.crop_cache(cache, -1)
        assert cache.get_seq_length() == 6
        rt.crop_cache(cache, 6)  # nothing dropped
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1, [str(w.message) for w in runtime]
    assert "Gated DeltaNet" in str(runtime[0].message)


# ------------------------------------------------------------------------------------------
# full-attention control
# ------------------------------------------------------------------------------------------


def test_full_attention_verify_is_a_plain_call(monkeypatch):
    m = model("tiny-qwen3")

    def no_hooks(*a, **k):
        raise AssertionError("verify_forward registered a hook on a full-attention model")

    monkeypatch.setattr(torch.nn.Module, "register_forward_pre_hook", no_hooks)
    block = torch.tensor([[7, 8, 9, 10]])
    with torch.inference_mode():
        c1 = prefill(m, torch.tensor([[1, 2, 3]]))
        c2 = prefill(m, torch.tensor([[1, 2, 3]]))
        got = rt.verify_forward(m, block, position_ids=torch.arange(3, 7)[None], past_key_values=c1, use_cache=True)
        want = m(block, position_ids=torch.arange(3, 7)[None], past_key_values=c2, use_cache=True)
        assert torch.equal(got.logits, want.logits)
        assert rt._get_record(c1) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rt.crop_cache(c1, 5)
        c2.crop(-2)
    for (_, a), (_, b) in zip(cache_tensors(c1), cache_tensors(c2), strict=True):
        assert torch.equal(a, b)


def test_full_attention_tree_and_compaction():
    m = model("tiny-qwen3")
    parents = [-1, 0, 0, 1]
    prompt = torch.tensor([[1, 2, 3]])
    tokens = torch.tensor([[4, 5, 6, 7]])
    with torch.inference_mode():
        cache = prefill(m, prompt)
        out = rt.verify_forward(
            m,
            tokens,
            position_ids=(3 + torch.tensor(depths(parents)))[None],
            attention_mask=tree_mask(parents, 3),
            past_key_values=cache,
            use_cache=True,
        )
        for node in range(4):
            ref = m(torch.cat([prompt, tokens[:, path_to(parents, node)]], 1)).logits[0, -1]
            torch.testing.assert_close(out.logits[0, node], ref, atol=ATOL, rtol=RTOL)
        compact_dynamic_cache(cache, 3, [0, 1, 3])
        assert_lossless(m, cache, prompt, tokens[:, [0, 1, 3]])


def test_crop_cache_legacy_fallback():
    """Caches without `.layers` (transformers 4.x) get the legacy crop call as is."""

    class Legacy:
        def __init__(self):
            self.calls = []

        def crop(self, n):
            self.calls.append(n)

    legacy = Legacy()
    rt.crop_cache(legacy, 7)
    rt.crop_cache(legacy, -2)
    assert legacy.calls == [7, -2]


def test_stale_record_is_not_committed():
    """A record that no longer describes the cache (another forward ran after the verify) cannot
    be committed exactly any more: the crop that follows raises instead of going on lossy."""
    m = model("tiny-qwen3_5")
    with torch.inference_mode():
        cache = prefill(m, torch.tensor([[1, 2, 3]]))
        rt.verify_forward(m, torch.tensor([[4, 5, 6]]), past_key_values=cache, use_cache=True)
        m(torch.tensor([[7]]), past_key_values=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="without committing the recorded verify"):
            rt.crop_cache(cache, 4)
    assert rt._get_record(cache) is None
