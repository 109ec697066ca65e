"""``lossless`` decides by behaviour (the probe), serves stateful assistants, and commits the shapes that broke.

* The probe (``patcher.generation.probe``): a model whose multi-token forward on a non-empty cache is not exact,
  or whose cache the runtime cannot commit exactly, is refused on entry in one line; a correct model in bfloat16
  is not; the verdict is kept per class, configuration, dtype, device and release; the probe leaves no trace.
* ``lossless(target, assistant)`` with a stateful assistant: transformers cuts the assistant's cache back
  across several of its drafting forwards; its recording spans them, and an error names the assistant.
* A cache whose first layer holds nothing (NemotronH's MLP / MoE blocks), and Zaya's sliding hybrid layers:
  past recording no longer grows the conv state during plain greedy, and the replay calls a mixer that takes
  no ``attention_mask``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

import generate_support as gs
from patcher import runtime as rt
from patcher.generation import forwards, probe as probe_module
from patcher.lossless import lossless, probe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import lossless_families as lf  # noqa: E402
import lossless_matrix as lm  # noqa: E402


@pytest.fixture
def cold_probe(monkeypatch):
    """No verdict kept yet: every model is probed again."""
    monkeypatch.setattr(probe_module, "VERDICTS", {})


@contextlib.contextmanager
def stale_state_on_multi_token_forwards(model):
    """Break the model the way FalconMamba is broken on 5.25: a multi-token forward on a non-empty cache ignores the
    recurrent state (reads zeros); one-token forwards and forwards from an empty cache are untouched."""
    handles = []
    for layer_idx, module in rt.hybrid_linear_modules(model):
        def hook(module, args, kwargs, layer_idx=layer_idx):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cache = next((v for k, v in kwargs.items() if k in ("cache", "cache_params", "past_key_values")), None)
            layer = cache.layers[layer_idx] if cache is not None else None
            if hidden.shape[1] > 1 and layer is not None and layer.has_previous_state.get(0, False):
                layer.recurrent_states[0] = torch.zeros_like(layer.recurrent_states[0])
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def test_a_model_whose_multi_token_cached_forward_is_not_exact_is_refused_on_entry(cold_probe):
    model = gs.build_target("tiny-qwen3_5", seed=5)
    assert probe(model).reason is None
    probe_module.VERDICTS.clear()
    with stale_state_on_multi_token_forwards(model):
        verdict = probe(model)
        with pytest.raises(rt.UnsupportedModelError) as err:
            with lossless(model):
                pass
    line = str(err.value)
    assert line == verdict.reason and "\n" not in line
    assert line.startswith("ddpatch: qwen3_5_text: ") and "a multi-token step of generate() on a non-empty cache" in line
    assert verdict.error > 100 * verdict.floor and "forward" not in vars(model)


@contextlib.contextmanager
def rounding_noise_on_multi_token_forwards(model, scale: float = 1e-3):
    """What low precision does (docs: ~4e-3 in bf16 on small models): a multi-token forward rounds differently from a
    one-token one, with or without a cache. Seeded noise of ``scale`` on the logits of every multi-token forward."""
    gen = torch.Generator().manual_seed(11)

    def hook(module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > 1:
            output.logits += scale * torch.randn(output.logits.shape, generator=gen)
        return output

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def test_rounding_between_kernel_shapes_is_not_refused_and_a_stale_state_still_is(cold_probe):
    """The tolerance is a multiple of the noise floor measured in the same probe (a multi-token forward from scratch
    against token-by-token decoding): noise every multi-token forward has is not refused; a stale state is."""
    model = gs.build_target("tiny-qwen3_5", seed=5)
    with rounding_noise_on_multi_token_forwards(model):
        served = probe(model)
        assert served.reason is None and served.floor > 1e-3, served  # the noise was seen, and is not refused
        probe_module.VERDICTS.clear()
        with stale_state_on_multi_token_forwards(model):
            assert "is not exact" in (probe(model).reason or "")
    probe_module.VERDICTS.clear()
    bf16 = probe(gs.build_target("tiny-qwen3_5", seed=5, dtype="bfloat16"))
    assert bf16.reason is None, bf16  # a correct model in bfloat16 is served


def test_a_commit_the_runtime_cannot_make_exact_is_refused(cold_probe, monkeypatch):
    from patcher.runtime import commit

    real = commit._commit

    def nudged(cache, record, keep):
        real(cache, record, keep)
        for layer in cache.layers:
            for state in getattr(layer, "recurrent_states", {}).values():
                if state is not None:
                    state.add_(1e-2)

    monkeypatch.setattr(commit, "_commit", nudged)
    reason = probe(gs.build_target("tiny-qwen3_5", seed=5)).reason or ""
    assert reason.startswith("ddpatch: qwen3_5_text: the runtime's commit of its cache is not exact"), reason


def test_the_verdict_is_kept_per_configuration_and_dtype_and_the_probe_leaves_no_trace(cold_probe, monkeypatch):
    calls = []
    real = probe_module._judge
    monkeypatch.setattr(probe_module, "_judge", lambda model: calls.append(model) or real(model))
    first, second = gs.build_target("tiny-qwen3_5", seed=5), gs.build_target("tiny-qwen3_5", seed=6)
    first.train()
    before = (vars(first).keys() - {"training"}, torch.get_rng_state())
    assert probe(first).reason is None and probe(second).reason is None
    assert len(calls) == 1, "a second instance of the same class and configuration was probed again"
    assert first.training and (vars(first).keys() - {"training"}, torch.get_rng_state().tolist()) == (before[0], before[1].tolist())
    probe(second.to(torch.bfloat16))
    assert len(calls) == 2, "another dtype shares the verdict"
    assert probe(first).seconds > 0


# ----------------------------------------------------------------------------- a stateful assistant
def assisted(target, helper, ids, reference):
    with lm.scripted(helper, ids[0].tolist() + reference, seed=1) as script, lossless(target, helper):
        got = gs.greedy(target, ids, assistant_model=helper)
    return got, script


def test_a_stateful_assistant_is_committed_by_its_own_recording():
    """NemotronH target, Qwen3.5 assistant drafting 5 tokens a round (scripted, right ~65%): transformers cuts the
    assistant's cache back across its drafting forwards; exact, with partial acceptances."""
    target, helper = gs.target("tiny-nemotron-h"), gs.build_target("tiny-qwen3_5", seed=3)
    ids = gs.prompt(0)
    reference = gs.greedy(target, ids)
    probe(helper)  # before the scripted hook is on it
    got, script = assisted(target, helper, ids, reference)
    assert got == reference
    assert any(0 < a < n for a, n in script.blocks), script.blocks


def test_an_assistant_cut_back_beyond_its_recording_raises_naming_the_assistant(monkeypatch):
    """The same run with the assistant's recording limited to one forward (what every model had before): the cut
    across its forwards cannot be exact, and the error says whose cache it was."""
    monkeypatch.setattr(forwards, "DRAFTER_SPAN", 1)
    target, helper = gs.target("tiny-nemotron-h"), gs.build_target("tiny-qwen3_5", seed=3)
    ids = gs.prompt(0)
    probe(helper)
    with pytest.raises(RuntimeError, match=r"^ddpatch: the assistant \(qwen3_5_text\) cache was cut back"):
        assisted(target, helper, ids, gs.greedy(target, ids))


# ----------------------------------------------------------------------------- the shapes that broke
def test_a_cache_whose_first_layers_hold_nothing_is_measured_by_its_attention_layer():
    """NemotronH's own default pattern: a MoE block (a cache layer that holds nothing) ahead of the first attention layer."""
    from patcher.runtime.caches import _cache_length

    model = lf.build("nemotron_h")
    out = model.generate(gs.prompt(0), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    moe = cache.layers[1]  # 5.23+: a DummyLayer; 5.21: a linear-attention layer nothing writes
    assert type(moe).__name__ == "DummyLayer" or not any(moe.has_previous_state.values()), type(moe)
    assert _cache_length(cache) == gs.prompt(0).shape[1] + 2
    reference = gs.greedy(model, gs.prompt(0))
    with lossless(model):
        assert gs.greedy(model, gs.prompt(0)) == reference


def zaya_sliding():
    """Zaya with a sliding hybrid layer (window 4) ahead of a full one."""
    from patcher.verify.models.presets import MASK_TOKEN_ID, make_state_matter
    from transformers import ZayaForCausalLM

    config = lf.default_config("zaya", layer_types=["hybrid_sliding", "hybrid"], sliding_window=4, num_hidden_layers=2)
    torch.manual_seed(0)
    model = ZayaForCausalLM(config)
    make_state_matter(model, 0)
    with torch.no_grad():
        model.get_output_embeddings().weight[MASK_TOKEN_ID].zero_()
    return model.eval()


@pytest.mark.skipif(not lf.shipped("zaya"), reason="this transformers ships no Zaya")
def test_zaya_past_recording_does_not_grow_the_conv_state_and_its_replay_runs():
    model = zaya_sliding()
    ids, repeated = gs.prompt(0), gs.repeated_prompt(0)
    reference, reference_repeated = gs.greedy(model, ids, 32), gs.greedy(model, repeated, 32)
    def widths(out):
        cache = getattr(out, "cache", None) or out.past_key_values
        return [max(c.shape[-1] for c in layer.conv_states.values()) for layer in cache.layers], cache.layers[0].keys.shape[-2]

    def run(new):
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True)

    native = widths(run(32))
    with lossless(model):
        out = run(32)
        assert out.sequences[0, ids.shape[1]:].tolist() == reference
        # past recording keeps the last forward's inputs at most, however long the decode (34 entries before the fix)
        assert widths(out) == widths(run(8)), (widths(out), widths(run(8)))
        assert all(c <= 2 * n for c, n in zip(widths(out)[0], native[0])), (widths(out), native)
        assert widths(out)[1] <= max(native[1], model.config.sliding_window) + 1, (widths(out), native)
        assert gs.greedy(model, repeated, 32, prompt_lookup_num_tokens=3) == reference_repeated
