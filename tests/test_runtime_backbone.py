"""The runtime handed a backbone instead of a full model (issue 42 item 5).

Forks often run the decoder stack themselves and apply the LM head to the rows they want::

    out = target.model(ids, past_key_values=cache, attention_mask=tree_mask, position_ids=pos)
    logits = target.lm_head(out.last_hidden_state[:, rows])

The verify-forward step rewrites that call into ``verify_forward(target.model, ...)``. A backbone
returns hidden states and no logits, so every runtime entry point must work on one (``target.model``,
``target.model.language_model`` of a ``ForConditionalGeneration``, a ``get_decoder()`` result) and give
back the backbone's own output. Here a fork-shaped decoder, written for this file, does exactly that on
the tiny hybrid presets; each tree node must equal a from-scratch forward of its own path, each commit a
from-scratch cache, and the decode the target's own greedy tokens. The unpatched call is the control: the
same masked backbone forward mixes sibling branches in the Gated DeltaNet layers.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import patcher.runtime as rt
from runtime_support import ATOL, RTOL, VOCAB_DRAW, depths, model, one_thread, path_to, prefill, tree_mask  # noqa: F401

#: how each backbone is reached from the full model, per preset
BACKBONES = {
    "tiny-qwen3_5": {"model": lambda m: m.model, "get_decoder": lambda m: m.get_decoder()},
    "tiny-qwen3_5-vlm": {
        "model": lambda m: m.model,  # the multimodal backbone (vision tower + text stack)
        "language_model": lambda m: m.model.language_model,
        "get_decoder": lambda m: m.get_decoder(),
    },
}
CASES = [(name, how) for name, ways in BACKBONES.items() for how in ways]
IDS = [f"{name}-{how}" for name, how in CASES]

#: trees with siblings at several depths; node i's parent is parents[i]
TREES = [[-1, 0, 0, 1, 1, 2, 5, 3], [-1, 0, 1, 2, 0, 4, 0], [-1, 0, 0, 0, 2, 2, 4, 6]]


def _backbone(name, how):
    m = model(name)
    return m, BACKBONES[name][how](m)


def _path_logits(m, prompt, tokens, parents, node):
    return m(torch.cat([prompt, tokens[:, path_to(parents, node)]], 1)).logits[0, -1]


def _node_error(m, prompt, tokens, parents, logits) -> float:
    """The largest |logit difference| of any tree node against a from-scratch forward of its own path."""
    return max(float((logits[0, n] - _path_logits(m, prompt, tokens, parents, n)).abs().max()) for n in range(len(parents)))


def _tree_call(backbone, tokens, parents, past, cache, verify: bool):
    kwargs = dict(position_ids=(past + torch.tensor(depths(parents)))[None], attention_mask=tree_mask(parents, past),
                  past_key_values=cache, use_cache=True, output_hidden_states=True)
    return rt.verify_forward(backbone, tokens, **kwargs) if verify else backbone(tokens, **kwargs)


def _assert_cache_is_from_scratch(m, backbone, cache, sequence):
    """``cache`` predicts what a fresh cache over ``sequence`` predicts, through the backbone and the head."""
    ref = prefill(m, sequence)
    assert cache.get_seq_length() == ref.get_seq_length() == sequence.shape[1]
    probe = torch.tensor([[7, 11]])
    pos = torch.arange(sequence.shape[1], sequence.shape[1] + 2)[None]
    got = m.lm_head(backbone(probe, past_key_values=cache, position_ids=pos).last_hidden_state)
    want = m(probe, past_key_values=ref, position_ids=pos).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("strategy", ["auto", "node", "path"])
@pytest.mark.parametrize("name,how", CASES, ids=IDS)
def test_each_tree_node_through_a_backbone_equals_its_own_path(name, how, strategy, monkeypatch):
    monkeypatch.setattr(rt.options, "TREE_STRATEGY", strategy)
    m, backbone = _backbone(name, how)
    gen = torch.Generator().manual_seed(len(name) + len(how))
    for i, parents in enumerate(TREES):
        prompt = torch.randint(0, VOCAB_DRAW, (1, 3 + 2 * i), generator=gen)
        tokens = torch.randint(0, VOCAB_DRAW, (1, len(parents)), generator=gen)
        past = prompt.shape[1]
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            cache = prefill(m, prompt)
            out = _tree_call(backbone, tokens, parents, past, cache, verify=True)
            # the caller gets the backbone's own output: hidden states for every node, in the mask's order
            assert not hasattr(out, "logits") and type(out).__name__.endswith("ModelOutputWithPast")
            assert tuple(out.last_hidden_state.shape) == (1, len(parents), m.config.get_text_config().hidden_size)
            rows = torch.arange(len(parents))
            assert _node_error(m, prompt, tokens, parents, m.lm_head(out.last_hidden_state[:, rows])) <= ATOL
            keep = path_to(parents, len(parents) - 1)
            rt.compact_cache(cache, past, keep)
            _assert_cache_is_from_scratch(m, backbone, cache, torch.cat([prompt, tokens[:, keep]], 1))


@pytest.mark.parametrize("name,how", CASES, ids=IDS)
def test_the_unpatched_backbone_call_mixes_siblings(name, how):
    """The control: the fork's own masked call, not rewritten, is far from every node's own path, so the
    test above can tell a tree verify through the runtime from one that is not."""
    m, backbone = _backbone(name, how)
    gen = torch.Generator().manual_seed(len(name) + len(how))
    parents = TREES[0]
    prompt = torch.randint(0, VOCAB_DRAW, (1, 3), generator=gen)
    tokens = torch.randint(0, VOCAB_DRAW, (1, len(parents)), generator=gen)
    with torch.inference_mode():
        out = _tree_call(backbone, tokens, parents, 3, prefill(m, prompt), verify=False)
        assert _node_error(m, prompt, tokens, parents, m.lm_head(out.last_hidden_state)) > 1e-2


# ------------------------------------------------------------------ a fork's decoder on the backbone
@rt.tree_commit("cache", "past", "path")
def _pack_path(cache, past, path):
    """The fork's own compaction, as the tree-commit step leaves it: move the kept rows of every key/value
    layer into place, then cut back with the 4.x length through the runtime."""
    rows = torch.tensor(path) + past
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        for store in (layer.keys, layer.values):
            store[..., past : past + len(path), :] = store.index_select(-2, rows)
    rt.crop_cache(cache, past + len(path))


#: root -> a, root -> b (a's sibling), a -> c, b -> d, c -> e
FORK_TREE = [-1, 0, 0, 1, 2, 3]


def _greedy(m, prompt, n):
    from transformers import DynamicCache

    cache = DynamicCache(config=m.config)
    out = m(prompt, past_key_values=cache)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        tokens.append(int(m(torch.tensor([[tokens[-1]]]), past_key_values=cache).logits[0, -1].argmax()))
    return tokens


def fork_decode(target, backbone, prompt, n, mode, truth, seed):
    """A fork-shaped speculative decoder: the target's backbone, then its own ``lm_head`` on the rows it wants.

    The draft is a stand-in that proposes the true next token or a wrong one at random, so that rounds
    accept none, part or all of what they verify, and tree rounds accept the sibling branch too. Returns the
    new tokens and each round's accepted path.
    """
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    guess = lambda k: truth[k] if torch.rand(1, generator=gen) < 0.65 else (truth[k] + 1) % VOCAB_DRAW  # noqa: E731
    cache = DynamicCache()  # built without the config: adopt_forward lays it out for the target
    out = rt.adopt_forward(backbone, prompt, past_key_values=cache, use_cache=True)
    tokens = [int(target.lm_head(out.last_hidden_state[:, -1]).argmax(-1))]
    start, paths = prompt.shape[1], []
    while len(tokens) < n:
        k = len(tokens)
        if mode == "chain":
            ids = torch.tensor([[tokens[-1], guess(k), guess(k + 1), guess(k + 2)]])
            out = rt.verify_forward(backbone, ids, past_key_values=cache, use_cache=True,
                                    position_ids=torch.arange(start, start + 4)[None])
            choice = target.lm_head(out.last_hidden_state[0]).argmax(-1).tolist()
            path = [0]
            while len(path) < 4 and int(ids[0, len(path)]) == choice[len(path) - 1]:
                path.append(len(path))
            cache.crop(-(4 - len(path)))  # the native 5.x count, committed by the cache's own crop
        else:
            a, b = guess(k), guess(k)
            b = b if b != a else (a + 2) % VOCAB_DRAW  # siblings differ
            ids = torch.tensor([[tokens[-1], a, b, guess(k + 1), guess(k + 1), guess(k + 2)]])
            out = rt.verify_forward(backbone, ids, past_key_values=cache, use_cache=True,
                                    attention_mask=tree_mask(FORK_TREE, start),
                                    position_ids=(start + torch.tensor(depths(FORK_TREE)))[None])
            rows = torch.arange(ids.shape[1])
            choice = target.lm_head(out.last_hidden_state[:, rows])[0].argmax(-1).tolist()
            path = [0]
            while True:
                child = [c for c in range(1, len(FORK_TREE)) if FORK_TREE[c] == path[-1] and int(ids[0, c]) == choice[path[-1]]]
                if not child:
                    break
                path.append(child[0])
            _pack_path(cache, start, path)
        paths.append(path)
        tokens += [int(ids[0, i]) for i in path[1:]] + [choice[path[-1]]]
        start += len(path)
    return tokens[:n], paths


@pytest.mark.parametrize("mode", ["tree", "chain"])
@pytest.mark.parametrize("name,how", CASES, ids=IDS)
def test_a_fork_decoding_through_the_backbone_gives_the_targets_greedy_tokens(name, how, mode):
    m, backbone = _backbone(name, how)
    prompt = torch.randint(0, VOCAB_DRAW, (1, 7), generator=torch.Generator().manual_seed(4))
    n = 20
    with torch.inference_mode():
        truth = _greedy(m, prompt, n + 4)
        got, paths = fork_decode(m, backbone, prompt, n, mode, truth, seed=9)
    assert got == truth[:n]
    sizes = [len(p) for p in paths]
    assert any(1 < s < max(sizes) for s in sizes), f"no round kept its block in part: {paths}"
    if mode == "tree":
        assert any(p[:2] == [0, 2] for p in paths), f"the sibling branch was never accepted: {paths}"


def test_a_backbone_that_ignores_the_tree_mask_is_refused_in_one_line():
    """The mask probe reads a backbone's last hidden state: a model that ignores a 4D mask is still refused."""
    m = model("tiny-glm5-next")
    parents = [-1, 0, 0]
    with torch.inference_mode():
        cache = prefill(m, torch.tensor([[3, 4, 5]]))
        with pytest.raises(rt.UnsupportedModelError, match="ignores a custom 4D attention mask"):
            _tree_call(m.get_decoder(), torch.tensor([[6, 7, 8]]), parents, 3, cache, verify=True)


@pytest.mark.parametrize("name,how", [("tiny-qwen3_5", "model"), ("tiny-qwen3_5-vlm", "language_model")])
def test_the_verifier_sees_the_forks_backbone_calls_once_each(name, how):
    """``ddpatch verify``'s logits oracle records a decoding forward the fork runs on the backbone, with the logits
    its own head gives, once per call (not again from inside the full model's forward), and judges them exact."""
    from patcher.verify.judge import logits as oracle

    m, backbone = _backbone(name, how)
    prompt = torch.randint(0, VOCAB_DRAW, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        truth = _greedy(m, prompt, 16)
        with oracle.LogitsRecorder(m) as recorder:
            got, paths = fork_decode(m, backbone, prompt, 12, "tree", truth, seed=9)
        assert len(recorder.calls) == 1 + len(paths)  # the prefill and one verify per round
        assert [len(c["ids"]) for c in recorder.calls[1:]] == [len(FORK_TREE)] * len(paths)
        final = prompt[0].tolist() + got
        verdict = oracle.judge_logits(recorder.calls, final, oracle.reference_logits(m, final), prompt.shape[1], 3e-5)
        assert verdict.passed and verdict.positions >= len(got), verdict.describe()
        from transformers import DynamicCache

        with oracle.LogitsRecorder(m) as recorder:
            m(prompt, past_key_values=DynamicCache(config=m.config))  # the full model calls its backbone inside
        assert len(recorder.calls) == 1
