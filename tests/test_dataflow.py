"""Roles by data flow and anchors that follow calls, through the engine on small trees.

The fixtures (tests/fixtures/) test each codemod on one file; these test what only a tree
shows: a site in a helper that the anchor calls (in the same file or imported from another)
answers for the anchor, another anchor of the step does not, and a fact about a class in
another file (a drafter that builds its own masks) reaches the step through the tree scan.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from patcher.engine.pipeline import run_recipe
from patcher.engine.recipe import load_recipe

RECIPE = load_recipe("qwen3_6-gdn")

DECODER = '''
from transformers import DynamicCache


def dflash_generate(model, target, input_ids, start, max_length):
    target_cache = DynamicCache()
    draft_cache = DynamicCache()
    out = target(input_ids, past_key_values=target_cache, output_hidden_states=True)
    return _rounds(model, target, input_ids, target_cache, draft_cache, out.hidden_states, start, max_length)


def _rounds(drafter, verifier, ids, cache, draft_cache, hidden, start, max_length):
    while start < max_length:
        noise = verifier.model.embed_tokens(ids)
        drafter(noise_embedding=noise, target_hidden=hidden, past_key_values=draft_cache)
        out = verifier(ids, past_key_values=cache, output_hidden_states=True)
        start += 1
        cache.crop(start)
        draft_cache.crop(start)
    return out
'''


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "tree"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def _anchors(report, step: str) -> dict[str, tuple[str, str]]:
    result = next(s for s in report.steps if s.spec.id == step)
    return {a.function: (a.status, a.message) for a in result.anchors}


def test_a_decode_loop_moved_into_a_helper_answers_for_the_anchor(tmp_path):
    report = run_recipe(RECIPE, _tree(tmp_path, {"dflash/model.py": DECODER}), upstream="dflash")
    for step in ("target-cache-config", "input-embeddings", "crop-compat", "verify-forward", "draft-sliding-window"):
        status, message = _anchors(report, step)["dflash_generate"]
        assert status == "applied", f"{step}: {status} {message}"
    new = next(f for f in report.files if f.path == "dflash/model.py").patched
    assert "verify_forward(verifier, ids, past_key_values=cache" in new
    assert "draft_forward(drafter, noise_embedding=noise" in new
    assert "target_cache = DynamicCache(config=target.config)" in new and "draft_cache = DynamicCache()\n" in new


def test_roles_come_from_data_flow_not_names(tmp_path):
    # the target is called `model` and the drafter `draft`
    renamed = (DECODER.replace("dflash_generate(model, target,", "dflash_generate(draft, model,")
               .replace("out = target(input_ids", "out = model(input_ids")
               .replace("_rounds(model, target,", "_rounds(draft, model,"))
    report = run_recipe(RECIPE, _tree(tmp_path, {"dflash/model.py": renamed}), upstream="dflash")
    new = next(f for f in report.files if f.path == "dflash/model.py").patched
    assert "target_cache = DynamicCache(config=model.config)" in new
    assert "verify_forward(verifier, ids" in new and "draft_forward(drafter, noise_embedding" in new
    assert "verify_forward(model" not in new and "draft_forward(model" not in new


HELPERS = '''
import torch


def _embed(target, ids):
    return target.get_input_embeddings()(ids)


def _trim(cache, length):
    remove = cache.get_seq_length() - length
    cache.crop(-remove)
'''

NATIVE = '''
from transformers import DynamicCache

from .helpers import _embed, _trim


def dflash_generate(model, target, input_ids, start, max_length):
    target_cache = DynamicCache(config=target.config)
    draft_cache = DynamicCache()
    out = target(input_ids, past_key_values=target_cache, output_hidden_states=True)
    while start < max_length:
        model(noise_embedding=_embed(target, input_ids), target_hidden=out.hidden_states, past_key_values=draft_cache)
        out = target(input_ids, past_key_values=target_cache, output_hidden_states=True)
        start += 1
        _trim(target_cache, start)
        draft_cache.crop(start - draft_cache.get_seq_length())
'''


def test_helpers_in_another_file_give_fixed_upstream_not_no_match(tmp_path):
    root = _tree(tmp_path, {"dflash/__init__.py": "", "dflash/helpers.py": HELPERS, "dflash/model.py": NATIVE})
    report = run_recipe(RECIPE, root, upstream="dflash")
    status, message = _anchors(report, "input-embeddings")["dflash_generate"]
    assert status == "fixed-upstream" and "_embed" in message, message
    status, message = _anchors(report, "crop-compat")["dflash_generate"]
    assert status == "fixed-upstream", message
    crop_sites = [s for s in report.files if s.path == "dflash/helpers.py"][0].sites
    assert [s.status for s in crop_sites if s.step == "crop-compat"] == ["fixed-upstream"]
    assert _anchors(report, "target-cache-config")["dflash_generate"][0] == "fixed-upstream"
    model = next(f for f in report.files if f.path == "dflash/model.py").patched
    assert "draft_cache.crop(start - draft_cache.get_seq_length())" in model, "a 5.x count keeps its meaning"


@pytest.mark.parametrize("annotated", [True, False])
def test_a_4x_crop_helper_in_another_file(tmp_path, annotated):
    # in its own file a helper's parameter is a cache only by its annotation (its callers are
    # elsewhere); without one the step cannot tell `cache.crop(n)` from `image.crop(box)`,
    # and says no-match rather than guess
    signature = "def _trim(cache: DynamicCache, length):" if annotated else "def _trim(cache, length):"
    helpers = ("from transformers import DynamicCache\n" + HELPERS).replace("def _trim(cache, length):", signature)
    helpers = helpers.replace("    remove = cache.get_seq_length() - length\n    cache.crop(-remove)\n", "    cache.crop(length)\n")
    native = NATIVE.replace("        draft_cache.crop(start - draft_cache.get_seq_length())\n", "        _trim(draft_cache, start)\n")
    root = _tree(tmp_path, {"dflash/__init__.py": "", "dflash/helpers.py": helpers, "dflash/model.py": native})
    report = run_recipe(RECIPE, root, upstream="dflash")
    status, message = _anchors(report, "crop-compat")["dflash_generate"]
    if annotated:
        assert status == "applied" and "_trim" in message, message
        assert "crop_cache(cache, length)" in next(f for f in report.files if f.path == "dflash/helpers.py").patched
    else:
        assert status == "no-match", message


def test_another_anchor_of_the_step_does_not_answer_for_the_anchor(tmp_path):
    # ddtree_generate calls dflash_generate; its own verify is gone, and dflash_generate's
    # wrapped verify must not make it look applied
    tree = '''
    from transformers import DynamicCache

    from dflash import dflash_generate


    def ddtree_generate(model, target, input_ids, block_size):
        if block_size <= 1:
            return dflash_generate(model, target, input_ids, 0, 8)
        return None
    '''
    root = _tree(tmp_path, {"dflash.py": DECODER, "ddtree.py": tree})
    report = run_recipe(RECIPE, root, upstream="ddtree")
    anchors = _anchors(report, "verify-forward")
    assert anchors["dflash_generate"][0] == "applied"
    assert anchors["ddtree_generate"][0] == "no-match"


DRAFT_CLASS = '''
import torch


class DFlashDraftModel(torch.nn.Module):
    def _layer_masks(self, position_ids):
        window = getattr(self.config, "sliding_window", None)
        return {"full_attention": None, "sliding_attention": window}

    def forward(self, position_ids, noise_embedding=None, target_hidden=None, past_key_values=None):
        masks = self._layer_masks(position_ids)
        for layer in self.layers:
            noise_embedding = layer(noise_embedding, attention_mask=masks[layer.attention_type])
        return noise_embedding
'''


@pytest.mark.parametrize("masks_itself", [True, False])
def test_a_drafter_that_builds_its_own_masks_in_another_file_is_not_wrapped(tmp_path, masks_itself):
    draft = DRAFT_CLASS if masks_itself else DRAFT_CLASS.replace("masks[layer.attention_type]", "None")
    root = _tree(tmp_path, {"dflash/__init__.py": "", "dflash/draft.py": draft, "dflash/model.py": DECODER})
    report = run_recipe(RECIPE, root, upstream="dflash")
    status, message = _anchors(report, "draft-sliding-window")["dflash_generate"]
    new = next(f for f in report.files if f.path == "dflash/model.py").patched
    if masks_itself:
        assert status == "fixed-upstream" and "attention_type" in message, message
        assert "draft_forward" not in new
    else:
        assert status == "applied" and "draft_forward(drafter," in new


def test_a_target_cache_from_a_factory_in_another_file_is_laid_out_by_the_runtime(tmp_path):
    """What another file's factory builds cannot be read here; the runtime checks the object itself
    (tests/test_adopt.py): the target's calls go through it, and the factory is left alone."""
    factory = "from transformers import DynamicCache\n\n\ndef make_cache(model):\n    return DynamicCache()\n"
    decoder = DECODER.replace("from transformers import DynamicCache\n", "from transformers import DynamicCache\n\nfrom .caches import make_cache\n")
    decoder = decoder.replace("    target_cache = DynamicCache()\n", "    target_cache = make_cache(target)\n")
    root = _tree(tmp_path, {"dflash/__init__.py": "", "dflash/caches.py": factory, "dflash/model.py": decoder})
    report = run_recipe(RECIPE, root, upstream="dflash")
    status, message = _anchors(report, "target-cache-config")["dflash_generate"]
    assert status == "applied" and "adopt_forward" in message, message
    new = next(f for f in report.files if f.path == "dflash/model.py").patched
    assert "out = _ddpatch_runtime.adopt_forward(target, input_ids, past_key_values=target_cache" in new
    assert not any(f.path == "dflash/caches.py" and f.patched for f in report.files)


# ---------------------------------------------------------------- caches whose owner the code does not say (issue 22)


def test_a_cache_the_code_does_not_attribute_is_laid_out_by_the_runtime_on_every_target_call(tmp_path):
    """The caches live in a namespace and the loop is in a helper: no name says which cache is the
    target's, so every call of the target with one (the prefill here, the verify in the helper, found
    through the parameter the caller binds) goes through a runtime helper that lays it out."""
    spaced = (DECODER.replace("from transformers import DynamicCache\n", "from types import SimpleNamespace\n\nfrom transformers import DynamicCache\n")
              .replace("    target_cache = DynamicCache()\n    draft_cache = DynamicCache()\n",
                       "    caches = SimpleNamespace(target=DynamicCache(), draft=DynamicCache())\n")
              .replace("past_key_values=target_cache", "past_key_values=caches.target")
              .replace("input_ids, target_cache, draft_cache,", "input_ids, caches.target, caches.draft,"))
    root = _tree(tmp_path, {"dflash/model.py": spaced})
    report = run_recipe(RECIPE, root, upstream="dflash")
    status, message = _anchors(report, "target-cache-config")["dflash_generate"]
    assert status == "applied", message
    new = next(f for f in report.files if f.path == "dflash/model.py").patched
    assert "out = _ddpatch_runtime.adopt_forward(target, input_ids, past_key_values=caches.target" in new
    assert "out = _ddpatch_runtime.verify_forward(verifier, ids, past_key_values=cache," in new
    assert "DynamicCache(config=" not in new, "no name says whose cache it is: nothing is given a config by guess"
    (root / "dflash" / "model.py").write_text(new)
    again = run_recipe(RECIPE, root, upstream="dflash")
    assert _anchors(again, "target-cache-config")["dflash_generate"][0] in ("already-applied", "patched")
    assert next(f for f in again.files if f.path == "dflash/model.py").patched in (None, new)


def test_one_cache_given_to_both_models_stays_a_no_match(tmp_path):
    shared = (DECODER.replace("    target_cache = DynamicCache()\n    draft_cache = DynamicCache()\n",
                              "    caches = SimpleNamespace(shared=DynamicCache())\n")
              .replace("from transformers import DynamicCache\n", "from types import SimpleNamespace\n\nfrom transformers import DynamicCache\n")
              .replace("past_key_values=target_cache", "past_key_values=caches.shared")
              .replace("input_ids, target_cache, draft_cache,", "input_ids, caches.shared, caches.shared,"))
    report = run_recipe(RECIPE, _tree(tmp_path, {"dflash/model.py": shared}), upstream="dflash")
    status, message = _anchors(report, "target-cache-config")["dflash_generate"]
    assert status == "no-match" and "both" in message, message


@pytest.mark.parametrize("case,needs", [("basic", False), ("caches_namespace", True), ("adopted_by_ddpatch", True)])
def test_target_cache_config_needs_the_runtime_only_where_a_target_call_goes_through_it(case, needs):
    """A config rewrite imports nothing; a call routed through ``adopt_forward`` (new or already there)
    needs the runtime copied beside the file, even with verify-forward ignored."""
    from fixture_support import run_codemod

    text = (Path(__file__).parent / "fixtures" / "target-cache-config" / f"{case}.py").read_text()
    _after, _sites, needs_runtime = run_codemod("target-cache-config", text)
    assert needs_runtime is needs
