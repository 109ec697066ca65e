"""The cache goes in under the keyword the installed transformers takes.

transformers 5.24+ model forwards take ``cache=``; 5.25 warns that ``past_key_values=`` is
deprecated (FutureWarning, "will be removed in version 5.40.0"). Upstream code keeps calling
``_ddpatch_runtime.verify_forward(target, ids, past_key_values=cache, ...)``, so the runtime
renames the keyword for a model whose forward takes ``cache``, and the verifier's own reference
decodes pass whichever keyword the target takes. A forward that takes only ``past_key_values``
(5.21-5.23, or a drafter module written that way) keeps it.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from transformers import DynamicCache, Qwen3_5ForCausalLM

from runtime_support import VOCAB_DRAW

from patcher import runtime as rt
from patcher.runtime import discovery
from patcher.verify.judge import calibration
from patcher.verify.models import context, load as models
from patcher.verify.models.presets import build_target

TAKES_CACHE = "cache" in inspect.signature(Qwen3_5ForCausalLM.forward).parameters  # transformers 5.24+


@pytest.fixture(scope="module")
def target():
    return build_target("tiny-qwen3_5", seed=0)


def deprecations(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning) and "past_key_values" in str(w.message)]


class Recording:
    """Records the keyword arguments its ``forward`` gets."""

    calls: list

    def __init__(self):
        super().__init__()
        self.calls = []


class LegacyModule(Recording, torch.nn.Module):
    """A forward of 5.21-5.23's shape, or a custom DFlash drafter's: ``past_key_values`` only."""

    def forward(self, input_ids, past_key_values=None, use_cache=None):
        self.calls.append({"past_key_values": past_key_values, "use_cache": use_cache})
        return input_ids


class NewModule(Recording, torch.nn.Module):
    """A forward of 5.24+'s shape: ``cache``."""

    def forward(self, input_ids, cache: DynamicCache | None = None, use_cache=None):
        self.calls.append({"cache": cache, "use_cache": use_cache})
        return input_ids


class FlagModule(Recording, torch.nn.Module):
    """A ``cache`` parameter that is not a cache (a flag): nothing is renamed into it."""

    def forward(self, input_ids, cache: bool = False, past_key_values=None):
        self.calls.append({"cache": cache, "past_key_values": past_key_values})
        return input_ids


# ------------------------------------------------------------------------------------------
# no deprecation warning from ddpatch's own calls on the real model
# ------------------------------------------------------------------------------------------


def test_reference_decodes_raise_no_deprecation(target):
    prompt = torch.randint(0, VOCAB_DRAW, (1, 6), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cached = models.greedy(target, prompt, 5)
        same, _ = models.multi_token_consistent(target, prompt, cached[:3])
        full, steps = calibration.two_ways(target, prompt, cached[:3])
    assert deprecations(caught) == []
    # the cache really went in: the cached reference equals the cacheless one, and both ways agree
    assert cached == models.greedy(target, prompt, 5, use_cache=False)
    assert same
    torch.testing.assert_close(full, steps, atol=1e-4, rtol=1e-4)


def test_verify_and_crop_raise_no_deprecation(target):
    prompt = torch.randint(0, VOCAB_DRAW, (1, 6), generator=torch.Generator().manual_seed(4))
    block = torch.randint(0, VOCAB_DRAW, (1, 4), generator=torch.Generator().manual_seed(5))
    cache = DynamicCache()  # built without a config: adopt_forward lays it out for the target
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        rt.adopt_forward(target, prompt, past_key_values=cache, use_cache=True)
        out = rt.verify_forward(target, block, past_key_values=cache, use_cache=True)
        rt.crop_cache(cache, 8)  # keep two of the four verified tokens
        after = target(block[:, 2:3], **context.with_cache(target, cache), use_cache=True).logits[0, -1]
    assert deprecations(caught) == []
    assert rt._get_record(cache).settled == 8
    assert cache.get_seq_length() == 9
    with torch.no_grad():  # the cache took the verify, and the commit is exact
        ref = target(torch.cat([prompt, block], dim=1), use_cache=False).logits[0]
    torch.testing.assert_close(out.logits[0], ref[6:10], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, ref[8], atol=1e-4, rtol=1e-4)  # block[2] again, after a cut to 8 tokens


@pytest.mark.skipif(not TAKES_CACHE, reason="this transformers' forwards take past_key_values= only")
def test_the_runtime_passes_cache_where_transformers_takes_it(target):
    cache = DynamicCache(config=target.config)
    given = {"past_key_values": cache, "use_cache": True}
    assert discovery._call_kwargs(target, given) == {"cache": cache, "use_cache": True}
    assert given == {"past_key_values": cache, "use_cache": True}  # the caller's dict is left as it was
    assert context.cache_keyword(target) == "cache"
    assert discovery._TAKES_CACHE[type(target)] is True  # decided once per class


# ------------------------------------------------------------------------------------------
# a forward without ``cache`` (5.21-5.23, a custom drafter) keeps past_key_values
# ------------------------------------------------------------------------------------------


def test_a_forward_with_only_past_key_values_keeps_it():
    module, cache = LegacyModule(), DynamicCache()
    given = {"past_key_values": cache, "use_cache": True}
    assert discovery._call_kwargs(module, given) is given
    assert context.cache_keyword(module) == "past_key_values"
    assert context.with_cache(module, cache) == {"past_key_values": cache}
    ids = torch.tensor([[1, 2]])
    rt.verify_forward(module, ids, past_key_values=cache, use_cache=True)
    rt.adopt_forward(module, ids, past_key_values=cache, use_cache=True)
    assert module.calls == [{"past_key_values": cache, "use_cache": True}] * 2
    assert discovery._TAKES_CACHE[LegacyModule] is False


def test_a_cache_forward_gets_cache_from_verify_forward():
    module, cache = NewModule(), DynamicCache()
    ids = torch.tensor([[1, 2]])
    rt.verify_forward(module, ids, past_key_values=cache, use_cache=True)
    rt.adopt_forward(module, ids, past_key_values=cache, use_cache=True)
    rt.verify_forward(module, ids, cache=cache, use_cache=True)  # already the new keyword: as given
    assert module.calls == [{"cache": cache, "use_cache": True}] * 3


def test_a_cache_flag_is_not_a_cache_keyword():
    module, cache = FlagModule(), DynamicCache()
    given = {"past_key_values": cache}
    assert discovery._call_kwargs(module, given) is given
    rt.verify_forward(module, torch.tensor([[1]]), past_key_values=cache)
    assert module.calls == [{"cache": False, "past_key_values": cache}]


def test_the_verifier_reads_the_cache_under_either_keyword():
    cache = DynamicCache()
    assert context.passed_cache({"past_key_values": cache}) is cache
    assert context.passed_cache({"cache": cache}) is cache
    assert context.passed_cache({"use_cache": False}) is None
    assert discovery._cache_of({"cache": cache}) == ("cache", cache)
    assert discovery._cache_of({"past_key_values": cache}) == ("past_key_values", cache)
