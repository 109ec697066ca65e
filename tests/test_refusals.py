"""Refuse only what cannot be made exact (issue 42, item 7): fork-shaped trees written here, each once as the
fork writes it and, where it matters, once in the form that must still be refused.

Each tree is a small DFlash-layout checkout (its decoder is ``dflash_generate``); the shapes are our own,
read from public forks: a benchmark helper that is gone, a cache built by a helper in another file, an
embedding helper that falls back to attributes, a tree decoder that moves ``start`` by ``+=``, a legacy-cache
round trip that clones the cache.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from patcher.cli import main

RECIPE = ["--recipe", "qwen3_6-gdn", "-j", "1"]

DECODER = '''
import torch
from transformers import DynamicCache


def dflash_generate(model, target, input_ids, max_new_tokens, block_size):
    target_cache = DynamicCache()
    draft_cache = DynamicCache()
    out = target(input_ids, past_key_values=target_cache, output_hidden_states=True)
    start = input_ids.shape[1]
    while start < max_new_tokens:
        block = input_ids[:, -block_size:]
        hidden = model(target_hidden=out.hidden_states[-1], noise_embedding=target.get_input_embeddings()(block),
                       past_key_values=draft_cache)
        draft_cache.crop(start)
        out = target(block, past_key_values=target_cache, output_hidden_states=True)
        start += 1
        target_cache.crop(start)
    return hidden
'''


pytestmark = pytest.mark.usefixtures("journal_home")  # DDPATCH_HOME in the test's tmp_path (tests/conftest.py)


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def check(root: Path, *extra) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["check", str(root), *RECIPE, "--format", "json", *extra], catch_exceptions=False)
    return result.exit_code, json.loads(result.stdout)


def step(payload: dict, sid: str) -> dict:
    return next(s for s in payload["steps"] if s["id"] == sid)


# ----------------------------------------------------------------------------- a benchmark's helper gone from the tree
def test_a_benchmark_helper_gone_from_the_tree_leaves_its_step_nothing_to_do(tmp_path):
    """The layout's decoder is there; `_cuda_time`, `_get_transformers_attn_impl`, `_prepare_dataset` are not, and no
    file has what their steps change: fixed-upstream, never no-match."""
    _code, payload = check(tree(tmp_path / "fork", {"dflash.py": DECODER}))
    for sid in ("cpu-safe-timing", "attn-fallback", "lazy-datasets"):
        found = step(payload, sid)
        assert found["status"] == "fixed-upstream", found
        assert all(a["status"] == "fixed-upstream" and "nothing to do" in a["message"] for a in found["anchors"]), found


def test_a_benchmark_helper_renamed_answers_through_the_sites_found_elsewhere(tmp_path):
    """`_cuda_time` renamed `_timer` still calls synchronize; the datasets import already sits in the loader
    (renamed too): the step speaks for the sites it found, the gone anchor says nothing."""
    root = tree(tmp_path / "fork", {
        "dflash.py": DECODER,
        "timing.py": "import time\nimport torch\n\n\ndef _timer():\n    torch.cuda.synchronize()\n    return time.perf_counter()\n",
        "data.py": "def _load(name):\n    from datasets import load_dataset\n    return load_dataset(name)\n",
        "run.py": "def load(path, flash):\n    return dict(attn_implementation=\"flash_attention_2\" if flash else \"sdpa\")\n",
    })
    _code, payload = check(root)
    timing, lazy, attn = step(payload, "cpu-safe-timing"), step(payload, "lazy-datasets"), step(payload, "attn-fallback")
    assert timing["status"] == "pending" and timing["anchors"] == [] and [s["path"] for s in timing["sites"]] == ["timing.py"]
    assert lazy["status"] == "fixed-upstream" and lazy["anchors"] == [] and [s["path"] for s in lazy["sites"]] == ["data.py"]
    assert attn["status"] == "fixed-upstream" and attn["anchors"] == [] and [s["path"] for s in attn["sites"]] == ["run.py"]


def test_a_gone_helper_whose_form_is_still_in_the_tree_unmatched_stays_no_match(tmp_path):
    """A module-level `datasets` import that module-level code uses is not something the step can move: the gone
    anchor stays no-match and names the file, with the way forward."""
    root = tree(tmp_path / "fork", {
        "dflash.py": DECODER,
        "data.py": "from datasets import load_dataset\n\nTRAIN = load_dataset('x')\n",
    })
    code, payload = check(root)
    lazy = step(payload, "lazy-datasets")
    assert code == 1 and lazy["status"] == "no-match"
    [anchor] = lazy["anchors"]
    assert "data.py has an import of datasets at module level" in anchor["message"] and "--exclude" in anchor["message"]


# ----------------------------------------------------------------------------- a cache built by a helper of another file
FACTORY = '''
from transformers import DynamicCache


def create_generation_cache(config):
    text = getattr(config, "text_config", config)
    cache = DynamicCache(config=text)
    return cache
'''


def with_factory(decoder_caches: str) -> str:
    """The decoder with its caches built by ``create_generation_cache`` of ``generation_cache.py``."""
    return DECODER.replace("from transformers import DynamicCache\n", "from generation_cache import create_generation_cache\n").replace(
        "    target_cache = DynamicCache()\n    draft_cache = DynamicCache()\n", decoder_caches)


def test_a_cache_built_from_the_targets_config_by_a_helper_of_another_file_is_fixed_upstream(tmp_path):
    root = tree(tmp_path / "fork", {"generation_cache.py": FACTORY, "dflash.py": with_factory(
        "    target_cache = create_generation_cache(target.config)\n    draft_cache = create_generation_cache(model.config)\n")})
    _code, payload = check(root)
    found = step(payload, "target-cache-config")
    assert found["status"] == "fixed-upstream", found
    [site] = [s for s in found["sites"] if s["status"] == "fixed-upstream"]
    assert site["path"] == "dflash.py" and "generation_cache.py:4" in site["message"]


@pytest.mark.parametrize("caches,why", [
    ("    target_cache = create_generation_cache(model.config)\n    draft_cache = create_generation_cache(model.config)\n",
     "not the target's config"),
    ("    target_cache = create_generation_cache(target.config)\n    draft_cache = create_generation_cache(target.config)\n",
     "the drafter's cache is built from the target's config"),
])
def test_a_helper_given_the_wrong_models_config_is_refused_with_the_edit(tmp_path, caches, why):
    root = tree(tmp_path / "fork", {"generation_cache.py": FACTORY, "dflash.py": with_factory(caches)})
    code, payload = check(root)
    found = step(payload, "target-cache-config")
    assert code == 1 and found["status"] == "no-match"
    assert any(why in s["message"] and "give it" in s["message"] for s in found["sites"] if s["status"] == "no-match")


def test_a_helper_of_the_same_name_defined_otherwise_elsewhere_is_no_factory(tmp_path):
    """Two `create_generation_cache` in the tree: the call could reach the bare one, so nothing rests on the other. The
    refusal names the call and the edit."""
    root = tree(tmp_path / "fork", {"generation_cache.py": FACTORY, "other.py": "def create_generation_cache(config):\n    return None\n",
                                    "dflash.py": with_factory("    target_cache = create_generation_cache(target.config)\n"
                                                              "    draft_cache = create_generation_cache(model.config)\n")})
    _code, payload = check(root)
    found = step(payload, "target-cache-config")
    [anchor] = found["anchors"]
    assert found["status"] == "no-match" and "`create_generation_cache(...)` (line 6)" in anchor["message"], found
    assert "build the target's cache with `DynamicCache(config=<target>.config)`" in anchor["message"]


def test_a_text_config_cache_lays_out_the_layers_the_targets_own_config_does():
    """What the fixed-upstream above rests on: `getattr(config, "text_config", config)` gives a nested hybrid (the
    VLM layout) the same cache layers as its own config, linear-attention layers included."""
    from transformers import DynamicCache

    from patcher.verify.models.presets import build_target

    for preset in ("tiny-qwen3_5-vlm", "tiny-qwen3_5"):
        config = build_target(preset, seed=0).config
        own = [type(layer).__name__ for layer in DynamicCache(config=config).layers]
        text = [type(layer).__name__ for layer in DynamicCache(config=getattr(config, "text_config", config)).layers]
        assert own == text and "LinearAttentionLayer" in own, (preset, own, text)


# ----------------------------------------------------------------------------- embeddings: the accessor first, attributes after
EMBEDS = '''
def input_embeddings(model):
    get = getattr(model, "get_input_embeddings", None)
    embed = get() if callable(get) else None
    if embed is None:
        embed = getattr(model, "embed_tokens", None)
    return embed
'''


def test_an_embedding_helper_that_asks_the_accessor_first_is_fixed_upstream(tmp_path):
    decoder = DECODER.replace("from transformers import DynamicCache\n", "from transformers import DynamicCache\nfrom embeds import input_embeddings\n")
    decoder = decoder.replace("target.get_input_embeddings()(block)", "input_embeddings(target)(block)")
    _code, payload = check(tree(tmp_path / "fork", {"embeds.py": EMBEDS, "dflash.py": decoder}))
    found = step(payload, "input-embeddings")
    assert found["status"] == "fixed-upstream", found
    assert [a["status"] for a in found["anchors"]] == ["fixed-upstream"] and "embeds.py" == found["anchors"][0]["path"]


# ----------------------------------------------------------------------------- the legacy round trip that copies the cache
def test_the_round_trip_becomes_a_deepcopy_that_copies_a_hybrid_cache_exactly():
    """What `removed-cache-api`'s rewrite rests on, on the installed release: `copy.deepcopy` of a hybrid cache (linear-
    attention layers included) continues exactly as a cache rebuilt from the same tokens does, and leaves the original
    as it was; on a pure-attention cache it holds the keys and values the 4.x round trip (the runtime's own
    `to_legacy_cache` / `from_legacy_cache`) rebuilds."""
    import copy

    import torch
    from transformers import DynamicCache

    from patcher.runtime import from_legacy_cache, to_legacy_cache
    from patcher.verify.models.presets import build_target

    prompt, more = torch.tensor([[3, 14, 15, 9, 26, 5]]), torch.tensor([[35, 8]])
    m = build_target("tiny-qwen3_5", seed=0)
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        m(prompt, past_key_values=cache, use_cache=True)
        before = [t.clone() for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        twin = copy.deepcopy(cache)
        copied = m(more, past_key_values=twin, use_cache=True).logits
        fresh = m(torch.cat([prompt, more], dim=1), past_key_values=DynamicCache(config=m.config), use_cache=True).logits[:, -2:]
        after = [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    assert any(type(layer).__name__ == "LinearAttentionLayer" for layer in cache.layers)
    torch.testing.assert_close(copied, fresh, rtol=1e-4, atol=1e-5)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)), "the copy's forward reached the original"

    attention = build_target("tiny-qwen3", seed=0)
    with torch.no_grad():
        cache = DynamicCache(config=attention.config)
        attention(prompt, past_key_values=cache, use_cache=True)
    rebuilt = from_legacy_cache(tuple((k.clone(), v.clone()) for k, v in to_legacy_cache(cache)))
    for a, b in zip(to_legacy_cache(copy.deepcopy(cache)), to_legacy_cache(rebuilt)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_legacy_round_trip_that_clones_every_tensor_is_pending_not_refused(tmp_path):
    decoder = DECODER.replace("    start = input_ids.shape[1]\n", "    prompt_cache = _snapshot(target_cache)\n    start = input_ids.shape[1]\n")
    decoder += ('\n\ndef _snapshot(cache):\n    legacy = cache.to_legacy_cache()\n'
                '    return DynamicCache.from_legacy_cache(tuple((k.clone(), v.clone()) for k, v in legacy))\n')
    code, payload = check(tree(tmp_path / "fork", {"dflash.py": decoder}))
    found = step(payload, "removed-cache-api")
    assert found["status"] == "pending" and "copy.deepcopy(cache)" in found["sites"][0]["message"], found


# ----------------------------------------------------------------------------- what a refusal prints
CHAINED = '''
from transformers import DynamicCache


def dflash_generate(model, target, input_ids, max_new_tokens, block_size):
    target_cache = DynamicCache()
    draft_cache = DynamicCache()
    out = target(input_ids, past_key_values=target_cache, output_hidden_states=True)
    model(target_hidden=out.hidden_states[-1], noise_embedding=target.get_input_embeddings()(input_ids), past_key_values=draft_cache)
    a0 = target_cache.get_seq_length() + 1
{links}
{crops}
'''


def test_a_refusal_is_a_short_line_per_site_that_says_its_chain_once_and_the_way_forward(tmp_path):
    """Twelve crops read the same ambiguous value through a chain of thirty names: twelve lines, each under 1,000
    characters; the chain is given by the first, the others point at it; each names a way forward."""
    links = "\n".join(f"    a{i} = a{i - 1} * 2 + {i}" for i in range(1, 31))
    crops = "\n".join(f"    {'target' if i % 2 else 'draft'}_cache.crop(a30)" for i in range(12))
    root = tree(tmp_path / "fork", {"dflash.py": CHAINED.format(links=links, crops=crops)})
    result = CliRunner().invoke(main, ["check", str(root), *RECIPE], catch_exceptions=False)
    lines = [line for line in result.stderr.splitlines() if "no-match crop-compat" in line]
    assert result.exit_code == 1 and len(lines) == 12
    assert max(len(line) for line in lines) < 1000
    assert sum("a0 = " in line or "`a0` is assigned" in line for line in lines) == 1, "the chain is said once"
    assert all("as at dflash.py:" in line for line in lines[1:])
    assert "crop_cache(cache, length)" in lines[0] and all("--allow-partial" in line for line in lines)


def test_a_refusal_of_a_lossless_step_does_not_offer_allow_partial(tmp_path):
    """Without verify-forward a patched tree decodes lossy: its refusal asks for the edit, never for --allow-partial."""
    decoder = DECODER.replace("target(block, past_key_values=target_cache, output_hidden_states=True)", "_run(target, block, target_cache)")
    decoder = decoder.replace("target(input_ids, past_key_values=target_cache, output_hidden_states=True)", "_run(target, input_ids, target_cache)")
    decoder += "\n\ndef _run(target, ids, cache):\n    return target(ids, past_key_values=cache, output_hidden_states=True)\n"
    result = CliRunner().invoke(main, ["check", str(tree(tmp_path / "fork", {"dflash.py": decoder})), *RECIPE], catch_exceptions=False)
    lines = [line for line in result.stderr.splitlines() if "no-match verify-forward" in line]
    assert lines and all("--allow-partial" not in line and "make the edit by hand" in line for line in lines), lines


def test_a_refusal_quoting_code_split_over_lines_is_still_one_line(tmp_path):
    """A reason may quote a call written one argument per line: the refusal stays one line of stderr."""
    decoder = DECODER.replace("    target_cache = DynamicCache()\n",
                              "    target_cache = DynamicCache(\n        config=model.config,\n    )\n")
    result = CliRunner().invoke(main, ["check", str(tree(tmp_path / "fork", {"dflash.py": decoder})), *RECIPE], catch_exceptions=False)
    refusals = [line for line in result.stderr.splitlines() if "target-cache-config" in line]
    assert result.exit_code == 1 and refusals and all(line.startswith("ddpatch: error: no-match target-cache-config: ") for line in refusals)
    assert any("DynamicCache( config=model.config, )" in line for line in refusals), refusals
