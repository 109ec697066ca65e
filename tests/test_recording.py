"""record_past: transformers' own past recording called the way the installed release takes it.

Code written against 5.23 calls ``cache.activate_past_recording()`` bare; 5.25's Gated DeltaNet
forward then fails on ``min(None, seq_len)``. Code written against 5.25 passes a count, which 5.21 to
5.24 do not take. crop-compat rewrites both forms to ``_ddpatch_runtime.record_past(cache, ...)``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache

from patcher.runtime import record_past
from patcher.runtime.caches import _is_linear_layer, _takes_a_count
from patcher.verify.models.presets import build_target


@pytest.fixture(scope="module")
def target():
    return build_target("tiny-qwen3_5", seed=0)


def _release_takes_a_count(cache) -> bool:
    layer = next(l for l in cache.layers if _is_linear_layer(l))
    return "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters


def _prefill(model, cache):
    with torch.no_grad():
        return model(torch.tensor([[3, 1, 4, 1, 5, 9]]), past_key_values=cache, use_cache=True).logits


def test_a_bare_recording_through_the_runtime_runs_where_the_native_bare_call_breaks(target):
    cache = DynamicCache(config=target.config)
    record_past(cache)
    assert all(cache.is_recording_past(i) for i, l in enumerate(cache.layers) if _is_linear_layer(l))
    logits = _prefill(target, cache)
    plain = _prefill(target, DynamicCache(config=target.config))
    assert torch.allclose(logits, plain, atol=1e-6), "recording must not change what the forward computes"
    native = DynamicCache(config=target.config)
    native.activate_past_recording()
    if _release_takes_a_count(native):  # 5.25+: the bare native call is the bug record_past works around
        with pytest.raises(TypeError, match="NoneType"):
            _prefill(target, native)


@pytest.mark.parametrize("form", ["keyword", "positional"])
def test_a_count_is_passed_where_the_release_takes_one_and_dropped_where_not(target, form):
    cache = DynamicCache(config=target.config)
    if form == "keyword":
        record_past(cache, recurrent_states_to_keep=5)
    else:
        record_past(cache, 5)
    linear = [l for l in cache.layers if _is_linear_layer(l)]
    assert _takes_a_count(cache) == _release_takes_a_count(cache)
    if _takes_a_count(cache):
        assert [l.recurrent_states_to_keep for l in linear] == [5] * len(linear)
    else:
        assert all(l.record_past for l in linear)
    _prefill(target, cache)  # runs on every release


def test_a_bare_call_keeps_no_recurrent_states_on_a_release_that_counts(target):
    cache = DynamicCache(config=target.config)
    record_past(cache)
    linear = [l for l in cache.layers if _is_linear_layer(l)]
    if not _takes_a_count(cache):
        pytest.skip("this transformers takes no count (5.21-5.24): a bare call is all there is; runs on 5.25 in the matrix")
    assert [l.recurrent_states_to_keep for l in linear] == [0] * len(linear)


def test_a_warm_up_that_fails_inside_transformers_names_the_release_and_the_api(target):
    from importlib.metadata import version

    from patcher.verify.plumbing.events import error_summary

    native = DynamicCache(config=target.config)
    native.activate_past_recording()
    if not _release_takes_a_count(native):
        pytest.skip("the bare call runs on 5.21-5.24; the failure it explains is 5.25's (the matrix runs 5.25)")
    try:
        _prefill(target, native)
    except TypeError as exc:
        summary = error_summary(exc)
    else:
        pytest.fail("5.25's GDN forward ran after a bare activate_past_recording()")
    assert "activate_past_recording" in summary["hint"] and "recurrent_states_to_keep" in summary["hint"]
    assert summary["inside"].startswith(f"inside transformers {version('transformers')}: models/qwen3_5/modeling_qwen3_5.py:")
    assert "test_recording.py" in summary["inside"], "the frame of the caller outside transformers is named"
