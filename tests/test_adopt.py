"""adopt_cache / adopt_forward: a bare cache handed to a hybrid target is laid out for it at its first use.

The codemod ``target-cache-config`` routes the target's calls through the runtime where the
code does not say which cache is the target's (one factory for both caches, caches in a dict
or a namespace, ``DynamicCache() if ... else ...``). Its ``applied`` rests on what these tests
hold: a cache built without a config decodes exactly like ``DynamicCache(config=...)``, and a
cache that another model already used, or that is laid out for another model, is refused in
one line rather than decoded.
"""

from __future__ import annotations

import pytest
import torch

from patcher import runtime as rt
from runtime_support import model, one_thread  # noqa: F401  (one_thread: an autouse fixture)

PROMPT = torch.tensor([[5, 9, 2, 14, 7, 3]])
ROUNDS = [(torch.tensor([[11, 4, 8, 1]]), 2), (torch.tensor([[6, 6, 13, 2]]), 4), (torch.tensor([[3, 10, 5, 9]]), 0)]


def _decode(m, cache, first):
    """Prefill through ``first`` (plain call, adopt_forward or verify_forward), then verify/commit rounds; every logit."""
    logits = []
    with torch.inference_mode():
        out = first(m, PROMPT, cache)
        logits.append(out.logits)
        length = PROMPT.shape[1]
        for block, kept in ROUNDS:
            out = rt.verify_forward(m, block, past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            length += kept + 1
            rt.crop_cache(cache, length)
    return logits


def _plain(m, ids, cache):
    return m(ids, past_key_values=cache, use_cache=True)


def _adopting(m, ids, cache):
    return rt.adopt_forward(m, ids, past_key_values=cache, use_cache=True)


def _verifying(m, ids, cache):
    return rt.verify_forward(m, ids, past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("name", ["tiny-qwen3_5", "tiny-qwen3_5-vlm"])
@pytest.mark.parametrize("first", [_adopting, _verifying], ids=["adopt_forward", "verify_forward"])
def test_a_bare_cache_decodes_exactly_like_a_config_built_one(name, first):
    from transformers import DynamicCache

    m = model(name)
    expected = _decode(m, DynamicCache(config=m.config), _plain)
    bare = DynamicCache()
    got = _decode(m, bare, first)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert [type(layer) for layer in bare.layers] == [type(layer) for layer in DynamicCache(config=m.config).layers]


def test_a_bare_cache_fails_on_a_hybrid_target_without_adoption():
    """The control: the plain call is what the unpatched code does, and it cannot run."""
    from transformers import DynamicCache

    with pytest.raises(IndexError):
        _decode(model("tiny-qwen3_5"), DynamicCache(), _plain)


def test_a_cache_another_model_already_used_is_refused_in_one_line():
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        model("tiny-qwen3")(PROMPT, past_key_values=cache, use_cache=True)  # e.g. the draft wrote into it first
        with pytest.raises(rt.UnsupportedModelError) as err:
            rt.verify_forward(model("tiny-qwen3_5"), ROUNDS[0][0], past_key_values=cache, use_cache=True)
    message = str(err.value)
    assert "\n" not in message and message.startswith("ddpatch: ") and "another model" in message
    assert cache.get_seq_length() == PROMPT.shape[1], "the refused cache is left as it was"


def test_a_cache_laid_out_for_another_model_is_refused_in_one_line():
    from transformers import DynamicCache

    cache = DynamicCache(config=model("tiny-llama").config)
    with torch.inference_mode(), pytest.raises(rt.UnsupportedModelError) as err:
        rt.adopt_forward(model("tiny-qwen3_5"), PROMPT, past_key_values=cache, use_cache=True)
    assert "\n" not in str(err.value) and "another model" in str(err.value)


def test_a_model_without_recurrent_state_keeps_its_bare_cache():
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    with torch.inference_mode():
        rt.adopt_forward(model("tiny-qwen3"), PROMPT, past_key_values=cache, use_cache=True)
    assert cache.layer_class_to_replicate is DynamicLayer and cache.get_seq_length() == PROMPT.shape[1]
