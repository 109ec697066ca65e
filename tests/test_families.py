"""Every target family a DFlash drafter exists for, and every stateful family transformers 5.23
ships: lossless, or refused in one line.

Fast tests run the runtime directly (discovery, indexer compaction, refusals, and a scripted
chain/tree decode on every served preset); the slow ones run ``ddpatch verify`` on patched
copies of ``vendored/ddtree`` and ``vendored/dflash``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from patcher import runtime
from patcher.env import release
from patcher.verify.models.presets import PRESETS, build_target

ROOT = Path(__file__).resolve().parent.parent
_TRANSFORMERS = release(transformers.__version__)

#: Presets whose cache holds a state a crop cannot roll back (linear attention, Mamba2, short conv).
STATEFUL = ["tiny-olmo-hybrid", "tiny-kimi-linear", "tiny-nemotron-h", "tiny-granitemoehybrid", "tiny-falcon-h1", "tiny-lfm2"]
#: Families whose cache holds per-token keys only: full, sliding-window (+ sinks), MLA, indexed attention.
KEYED = ["tiny-llama", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-glm-moe-dsa"]
SERVED = STATEFUL + KEYED
#: Served by the runtime's rollback (tested below) but refused for a DFlash draft, and refused outright.
REFUSED = ["tiny-qwen4-exp", "tiny-glm5-next"]
SHAPE_ONLY = "verify-forward,tree-commit"

#: The mixer's attribute name in its decoder layer, and the keyword it takes the cache under on
#: transformers 5.21-5.23; from 5.24 every one of them takes ``cache=`` (docs/transformers.md).
MIXERS = {
    "tiny-olmo-hybrid": ("linear_attn", "cache_params"),
    "tiny-kimi-linear": ("self_attn", "cache_params"),
    "tiny-nemotron-h": ("mixer", "cache_params"),
    "tiny-granitemoehybrid": ("mamba", "cache_params"),
    "tiny-falcon-h1": ("mamba", "cache_params"),
    "tiny-lfm2": ("conv", "past_key_values"),
    "tiny-qwen4-exp": ("linear_attn", "cache_params"),
}


def test_every_family_preset_exists_with_its_model_type():
    expected = {
        "tiny-llama": "llama", "tiny-gpt-oss": "gpt_oss", "tiny-deepseek-v3": "deepseek_v3",
        "tiny-glm-moe-dsa": "glm_moe_dsa", "tiny-olmo-hybrid": "olmo_hybrid", "tiny-kimi-linear": "kimi_linear",
        "tiny-nemotron-h": "nemotron_h", "tiny-granitemoehybrid": "granitemoehybrid", "tiny-falcon-h1": "falcon_h1",
        "tiny-lfm2": "lfm2", "tiny-qwen4-exp": "qwen4_exp_text", "tiny-glm5-next": "glm5_next_text",
    }
    for name, model_type in expected.items():
        model = build_target(name)
        assert model.config.get_text_config(decoder=True).model_type == model_type, name
        assert PRESETS[name].hybrid == (name in STATEFUL or name in REFUSED), name


# ----------------------------------------------------------------------------- discovery
@pytest.mark.parametrize("name", sorted(MIXERS))
def test_discovery_finds_each_family_mixer_from_the_cache_and_config(name):
    model = build_target(name)
    found = runtime.hybrid_linear_modules(model)
    attr, keyword = MIXERS[name]
    kinds = model.config.get_text_config(decoder=True).layer_types
    assert [i for i, _ in found] == [i for i, k in enumerate(kinds) if k in ("linear_attention", "conv", "hybrid")]
    for _, mixer in found:
        owners = [m for m in model.modules() if getattr(m, attr, None) is mixer]
        assert owners, f"{name}: the mixer is not the `{attr}` of its layer"
        assert runtime._cache_kwargs(mixer, "C") == {keyword if _TRANSFORMERS < (5, 24) else "cache": "C"}


@pytest.mark.parametrize("name", KEYED)
def test_keyed_families_have_no_stateful_layers(name):
    assert runtime.hybrid_linear_modules(build_target(name)) == ()


def test_an_unknown_cache_layer_type_is_one_clear_error():
    model = build_target("tiny-olmo-hybrid")
    model.config.layer_types = ["linear_attention", "made_up_attention"] * 2
    with pytest.raises(runtime.UnsupportedModelError, match=r"olmo_hybrid layer 1 uses layer type 'made_up_attention'"):
        runtime.hybrid_linear_modules(model)


def test_a_stateful_layer_without_an_owner_is_one_clear_error():
    model = build_target("tiny-nemotron-h")
    types = list(model.config.layer_types)
    types[3] = "linear_attention"  # an attention layer claimed stateful: two owners, neither takes cache_params
    model.config.layer_types = types
    with pytest.raises(runtime.UnsupportedModelError, match=r"nemotron_h layer 3 keeps a recurrent/conv state"):
        runtime.hybrid_linear_modules(model)


def test_a_layer_whose_state_several_modules_update_is_one_clear_error():
    # Qwen4-Exp with per-layer n-gram embeddings: the GDN mixer and the PLE modules share layer 0's state slots
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    from patcher.verify.models import presets

    fields = dict(presets._text_fields(["linear_attention", "indexed_attention"] * 2), eos_token_id=62)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(
        **fields, **presets._gdn_fields(), **presets._moe_fields(), indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=1, ple_layer_ids=[1], ple_embed_dim=64,
        heads_per_ngram=4, ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=8,
    ))
    with pytest.raises(runtime.UnsupportedModelError, match=r"qwen4_exp_text layer 0 .* more than one module"):
        runtime.hybrid_linear_modules(model)


# ----------------------------------------------------------------------------- a scripted decode on the runtime
def _reference(model, prompt, n):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(prompt, past_key_values=cache)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def _scripted_decode(model, prompt, n, mode, seed, paths: list | None = None):
    """DFlash-style chain (crop) or DDTree-style tree (compact_cache) rounds with a draft that is
    right, second-best or wrong at random: exercises partial acceptances and accepted siblings.
    ``paths``, when given, receives every tree round's accepted path (node 2 is the sibling)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    truth = _reference(model, prompt, n + 8)
    cache = DynamicCache(config=model.config)
    out = model(prompt, past_key_values=cache)
    tokens = [int(out.logits[0, -1].argmax())]
    start = prompt.shape[1]
    accepted = []
    wrong = lambda t: (t + 1 + int(torch.randint(0, 50, (1,), generator=gen))) % 60  # noqa: E731
    while len(tokens) < n:
        k = len(tokens)
        if mode == "chain":
            guess = [truth[k + j] if torch.rand(1, generator=gen) < 0.7 else wrong(truth[k + j]) for j in range(3)]
            ids = torch.tensor([[tokens[-1], *guess]])
            out = runtime.verify_forward(model, ids, past_key_values=cache,
                                         position_ids=torch.arange(start, start + 4)[None])
            post = out.logits[0].argmax(-1).tolist()
            keep = 1
            while keep < 4 and guess[keep - 1] == post[keep - 1]:
                keep += 1
            cache.crop(-(4 - keep))  # the native 5.x count
            new = guess[: keep - 1] + [post[keep - 1]]
        else:
            # root -> a (right or wrong), root -> b (sibling), a -> c
            a = truth[k] if torch.rand(1, generator=gen) < 0.6 else wrong(truth[k])
            b = truth[k] if a != truth[k] and torch.rand(1, generator=gen) < 0.7 else wrong(truth[k])
            c = truth[k + 1] if torch.rand(1, generator=gen) < 0.7 else wrong(truth[k + 1])
            parents = [-1, 0, 0, 1]
            ids = torch.tensor([[tokens[-1], a, b, c]])
            pos = torch.tensor([[start, start + 1, start + 1, start + 2]])
            vis = torch.eye(4, dtype=torch.bool)
            for i in range(1, 4):
                vis[i] |= vis[parents[i]]
            mask = torch.zeros(1, 1, 4, start + 4)
            mask[..., start:] = torch.where(vis, 0.0, torch.finfo(torch.float32).min)
            out = runtime.verify_forward(model, ids, past_key_values=cache, position_ids=pos, attention_mask=mask)
            post = out.logits[0].argmax(-1).tolist()
            path = [0]
            children = {0: {a: 1, b: 2}, 1: {c: 3}, 2: {}, 3: {}}
            while post[path[-1]] in children[path[-1]]:
                path.append(children[path[-1]][post[path[-1]]])
            runtime.compact_cache(cache, start, path)
            if paths is not None:
                paths.append(path)
            keep = len(path)
            new = [int(ids[0, i]) for i in path[1:]] + [post[path[-1]]]
        accepted.append(keep)
        tokens += new
        start += keep
    return tokens[:n], truth[:n], accepted


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("name", STATEFUL + ["tiny-gpt-oss", "tiny-glm-moe-dsa", "tiny-qwen4-exp"])
def test_runtime_rollback_is_exact_on_every_family(name, mode):
    model = build_target(name, seed=1)
    prompt = torch.randint(0, 60, (1, 9), generator=torch.Generator().manual_seed(3))
    paths = []
    with torch.no_grad():
        got, truth, accepted = _scripted_decode(model, prompt, 14, mode, seed=5, paths=paths)
    assert got == truth, f"{name} {mode}: {got} != {truth}"
    assert len(set(accepted)) > 1, f"{name} {mode}: acceptance never varied ({accepted})"
    # the exactness above is only worth something where blocks were accepted in part
    if mode == "chain":
        assert any(1 < a < 4 for a in accepted), f"{name}: no round kept part of its block ({accepted})"
    else:
        assert any(p[:2] == [0, 2] for p in paths), f"{name}: the sibling branch was never accepted ({paths})"
        assert any(p[:2] == [0, 1] for p in paths), f"{name}: the first child was never accepted ({paths})"


# ----------------------------------------------------------------------------- indexed attention
def test_compaction_moves_the_indexer_keys():
    from transformers import DynamicCache

    model = build_target("tiny-glm-moe-dsa")
    prompt = torch.randint(0, 60, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, past_key_values=cache)
        vis = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, two children
        mask = torch.zeros(1, 1, 3, 9)
        mask[..., 6:] = torch.where(vis, 0.0, torch.finfo(torch.float32).min)
        runtime.verify_forward(model, torch.tensor([[5, 7, 9]]), past_key_values=cache,
                               position_ids=torch.tensor([[6, 7, 7]]), attention_mask=mask)
        runtime.compact_cache(cache, 6, [0, 2])
        reference = DynamicCache(config=model.config)
        model(torch.cat([prompt, torch.tensor([[5, 9]])], 1), past_key_values=reference)
    for layer, ref in zip(cache.layers, reference.layers):
        assert layer.indexer_keys.shape == ref.indexer_keys.shape
        torch.testing.assert_close(layer.indexer_keys, ref.indexer_keys)
        torch.testing.assert_close(layer.keys, ref.keys)


# ----------------------------------------------------------------------------- refusals, by probing
def test_a_model_that_ignores_the_tree_mask_is_refused_in_one_line():
    from transformers import DynamicCache

    model = build_target("tiny-glm5-next")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]), past_key_values=cache)
        mask = torch.zeros(1, 1, 2, 6)
        mask[0, 0, 0, 5] = torch.finfo(torch.float32).min
        with pytest.raises(runtime.UnsupportedModelError) as caught:
            runtime.verify_forward(model, torch.tensor([[5, 6]]), past_key_values=cache, attention_mask=mask,
                                   position_ids=torch.tensor([[4, 5]]))
    message = str(caught.value)
    assert "\n" not in message and "glm5_next_text ignores a custom 4D attention mask" in message


def test_the_mask_probe_passes_models_that_honour_the_mask():
    for name in ("tiny-gpt-oss", "tiny-olmo-hybrid", "tiny-lfm2"):
        runtime._check_mask_honoured(build_target(name), torch.zeros(1, 1, 2, 2))


def test_the_mask_probe_ignores_suppressed_vocabulary_entries():
    """A logit pinned at the dtype's minimum (a suppressed token) must not make a model that
    honours the mask look as if it ignored it."""
    model = build_target("tiny-qwen3_5")

    def suppress(module, args, output):
        output = output.clone()
        output[..., 0] = torch.finfo(output.dtype).min
        return output

    handle = model.lm_head.register_forward_hook(suppress)
    try:
        runtime._MASK_PROBED.pop(model, None)
        runtime._check_mask_honoured(model, torch.zeros(1, 1, 2, 2))
    finally:
        handle.remove()


def test_hidden_states_a_draft_cannot_read_are_refused_in_one_line():
    from transformers import DynamicCache

    model = build_target("tiny-glm5-next")
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), pytest.raises(runtime.UnsupportedModelError, match="hyper-connection"):
        runtime.verify_forward(model, torch.tensor([[1, 2, 3]]), past_key_values=cache, output_hidden_states=True)


# ----------------------------------------------------------------------------- end to end on the vendored trees
def ddpatch(*args, timeout=1200):
    return subprocess.run([sys.executable, "-m", "patcher.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def patched(tmp_path: Path, upstream: str, ignore: str | None = None) -> Path:
    out = tmp_path / f"{upstream}-patched"
    args = ["apply", ROOT / "vendored" / upstream, "--recipe", "qwen3_6-gdn", "--out", out]
    if ignore:
        args += ["--ignore", ignore, "--allow-lossy"]  # a deliberately lossy tree: a control
    proc = ddpatch(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def verify_json(tree: Path, presets, *args: str, tokens: int = 24) -> tuple[int, dict]:
    flags = [a for p in presets for a in ("--preset", p)]
    proc = ddpatch("verify", tree, "--format", "json", "--greedy-only", "--prompts", "1", "--max-new-tokens", tokens, *flags, *args)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def checks_of(payload: dict) -> dict[tuple[str, str], dict]:
    return {(m["model"], c["check"]): c for m in payload["models"] for c in m["checks"]}


@pytest.mark.heavy
def test_ddtree_and_dflash_are_lossless_on_every_family(tmp_path):
    code, payload = verify_json(patched(tmp_path, "ddtree"), SERVED, "--seeds", "0,1", "--tree-budgets", "4,8")
    failed = [(k, c["evidence"]) for k, c in checks_of(payload).items() if not c["passed"]]
    assert code == 0 and not failed, failed
    assert {m["model"] for m in payload["models"]} == set(SERVED)
    for model in payload["models"]:
        assert model["partial_acceptances"] > 0, f"{model['model']}: rollback never exercised"
        methods = {m["method"] for m in model["methods"]}
        assert {"dflash", "ddtree_tb4", "ddtree_tb8"} <= methods
        for method in model["methods"]:
            hist = {int(k): v for k, v in method["acceptance_histogram"].items()}
            assert len(hist) > 1, f"{model['model']} {method['method']}: acceptance never varied"


@pytest.mark.heavy
def test_dflash_layout_is_lossless_on_sliding_mamba_and_conv_targets(tmp_path):
    presets = ["tiny-gpt-oss", "tiny-nemotron-h", "tiny-lfm2"]
    code, payload = verify_json(patched(tmp_path, "dflash"), presets, "--seeds", "0,1")
    failed = [(k, c["evidence"]) for k, c in checks_of(payload).items() if not c["passed"]]
    assert code == 0 and not failed, failed


@pytest.mark.heavy
def test_control_code_shape_only_fails_on_every_stateful_family(tmp_path):
    code, payload = verify_json(patched(tmp_path, "ddtree", ignore=SHAPE_ONLY), STATEFUL, "--seeds", "0", tokens=12)
    assert code == 1
    checks = checks_of(payload)
    for preset in STATEFUL:
        assert checks[(preset, "warms up")]["passed"], f"{preset}: the code-shape steps alone must make it run"
        for method in ("dflash", "ddtree_tb4", "ddtree_tb8"):
            check = checks[(preset, f"lossless: {method}")]
            assert not check["passed"], f"{preset}/{method} must expose the missing rollback"
            assert "diverges at new token" in check["evidence"]


@pytest.mark.heavy
def test_verify_refuses_what_cannot_be_served_in_one_line(tmp_path):
    code, payload = verify_json(patched(tmp_path, "ddtree"), REFUSED, "--seeds", "0", tokens=4)
    assert code == 1
    checks = checks_of(payload)
    for preset in REFUSED:
        evidence = checks[(preset, "warms up")]["evidence"]
        assert not checks[(preset, "warms up")]["passed"]
        assert "UnsupportedModelError" in evidence and PRESETS[preset].refusal in evidence, evidence


# ----------------------------------------------------------------------------- recipes name what they are verified on
def test_the_recipe_names_each_verified_and_refused_model_type_with_its_preset():
    from patcher.engine.recipe import load_recipe

    recipe = load_recipe("qwen3_6-gdn")
    assert set(SERVED) <= set(recipe.verified.values()) and set(REFUSED) == set(recipe.refused.values())
    for table in (recipe.verified, recipe.refused):
        for model_type, preset in table.items():
            assert build_target(preset).config.model_type == model_type, (model_type, preset)
    for preset in recipe.refused.values():
        assert PRESETS[preset].refusal, preset
    listed = ddpatch("recipes", "list", "--format", "json")
    assert json.loads(listed.stdout)["recipes"][0]["verified"] == recipe.verified
    shown = ddpatch("recipes", "show", "qwen3_6-gdn").stdout
    assert "gpt_oss            tiny-gpt-oss" in shown and "glm5_next          tiny-glm5-next" in shown


# ----------------------------------------------------------------------------- the presets can fail
def _naive_greedy(model, prompt, n, junk):
    """Greedy decoding where every step also feeds a junk token and then "rolls it back" the
    naive way: keys cropped, recurrent/conv state left as it is (what a bare crop does)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(prompt, past_key_values=cache)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        if junk is None:
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache)
        else:
            out = model(torch.tensor([[tokens[-1], (7 * tokens[-1] + junk) % 60]]), past_key_values=cache)
            for layer in cache.layers:
                keys = getattr(layer, "keys", None)
                if isinstance(keys, torch.Tensor) and keys.dim() >= 2 and keys.shape[-2] > 0:
                    layer.keys, layer.values = keys[..., :-1, :], layer.values[..., :-1, :]
        tokens.append(int(out.logits[0, 0].argmax()))
    return tokens


@pytest.mark.parametrize("name", STATEFUL + ["tiny-qwen4-exp"])
def test_a_naive_rollback_changes_the_greedy_output_of_every_stateful_preset(name):
    for seed in (0, 1):
        model = build_target(name, seed=seed)
        prompt = torch.randint(0, 60, (1, 10), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert _naive_greedy(model, prompt, 12, None) != _naive_greedy(model, prompt, 12, 3), (name, seed)


def test_a_tree_verify_on_chunked_attention_is_refused_in_one_line():
    from transformers import DynamicCache

    model = build_target("tiny-gpt-oss")
    model.config.attention_chunk_size = 8
    model.config.layer_types = ["chunked_attention", "full_attention"] * 2  # same cache layer, chunk-shaped mask
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), pytest.raises(runtime.UnsupportedModelError, match=r"gpt_oss layer 0 uses chunked attention"):
        runtime.verify_forward(model, torch.tensor([[4, 5]]), past_key_values=cache,
                               attention_mask=torch.zeros(1, 1, 2, 2), position_ids=torch.tensor([[0, 1]]))
