"""The drifted forks of ``vendored/``: how each is made, what it claims to be, and what ddpatch must do with it.

A variant copies ``vendored/ddtree`` or ``vendored/dflash`` and runs its ``build`` on the copy.
``claims`` then checks, on the unpatched copy, that the variant really is the drift it is named
after (the helper exists and is called, the names really are renamed, a pure reformatting keeps
the AST...). ``expected`` is the outcome the recipe must reach, listed in README.md:

* ``LOSSLESS``: ``apply`` exits 0 and ``verify`` passes on tiny-qwen3_5 and tiny-qwen3_5-vlm;
* ``(NoMatch(step, file, function), ...)``: ``apply`` and ``check`` exit 1, and their no-match
  sites are exactly these: each names its ``step``, ``file`` (``None``: an anchor function that
  is gone from the tree, which no file can name) and ``function``, no site is missing and none
  is extra.

Each variant has exactly one expected outcome, decided by running it (``python3
tests/drift/table.py VARIANT``), so a change of outcome in either direction fails the suite:
a new false no-match, or a no-match that turned silent (lossless or not). ``Variant`` refuses
a list of alternatives.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import transforms as t

VENDORED = Path(__file__).resolve().parents[2] / "vendored"

LOSSLESS = "lossless"
#: ``check``, ``diff`` and ``apply`` refuse the tree in one line (exit 2): it holds no DDTree/DFlash decoder
NOT_A_DECODER = "not a decoder"


@dataclass(frozen=True)
class NoMatch:
    step: str
    file: str | None  # None: the anchor function is gone from the tree, so no file names it
    function: str

    def __post_init__(self) -> None:
        if self.file == "" or not self.function or not isinstance(self.function, str):
            raise ValueError(f"NoMatch({self.step!r}, {self.file!r}, {self.function!r}): a file (or None) and one function")

    def __str__(self) -> str:
        return f"no-match of {self.step} at {self.file or '(gone)'}:{self.function}"


@dataclass
class Variant:
    name: str
    drift: str  # the issue's class of drift
    base: str  # "ddtree" or "dflash": the vendored folder it starts from
    build: Callable[[Path], None]
    claims: Callable[[Path, Path], None]  # (variant root, original root)
    expected: object = LOSSLESS  # LOSSLESS, or the exact tuple of NoMatch sites
    statuses: dict[str, str] = field(default_factory=dict)  # step id -> required status (after apply)
    summary: str = ""
    #: The first transformers release the variant runs on, patched or not (None: every release in the range):
    #: code written with ``cache=`` needs 5.24+, where model forwards take that keyword.
    min_transformers: str | None = None
    #: The first transformers release the *unpatched* code runs on (None: every release in the range):
    #: code written for 5.25's counted past recording raises TypeError before it. The patched tree
    #: runs on every release (record_past), so only test_unpatched_variant_still_decodes_on_full_attention skips.
    unpatched_min_transformers: str | None = None
    #: The methods whose lossless checks a pass must contain (None: the layout's, ``outcome.required_lossless``).
    methods: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.expected, NoMatch):
            self.expected = (self.expected,)
        exact = self.expected in (LOSSLESS, NOT_A_DECODER) or (
            isinstance(self.expected, tuple) and self.expected and all(isinstance(e, NoMatch) for e in self.expected)
        )
        if not exact:
            raise ValueError(f"{self.name}: expected must be LOSSLESS, NOT_A_DECODER or a tuple of NoMatch (one outcome), got {self.expected!r}")
        if self.statuses and self.expected != LOSSLESS:
            raise ValueError(f"{self.name}: required statuses only apply to a lossless variant")

    @property
    def lossless(self) -> bool:
        return self.expected == LOSSLESS

    def describe_expected(self) -> str:
        return self.expected if isinstance(self.expected, str) else " + ".join(str(e) for e in self.expected)

    def make(self, dest: Path) -> Path:
        shutil.copytree(VENDORED / self.base, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        self.build(dest)
        return dest

    @property
    def original(self) -> Path:
        return VENDORED / self.base


def _read(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8")


def all_parse(root: Path) -> None:
    import ast

    for path in root.rglob("*.py"):
        ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


DD = "dflash.py"  # the DDTree tree's copy of DFlash's decoder
TREE = "ddtree.py"
DRAFT = "model/dflash.py"
FL = "dflash/model.py"  # the DFlash tree's decoder and draft model


# ---------------------------------------------------------------- reformatting


def build_reformat(files: tuple[str, ...]) -> Callable[[Path], None]:
    def build(root: Path) -> None:
        for rel in files:
            t.transform(root, rel, t.ExplodeArguments, min_changes=5)
            t.transform(root, rel, t.SingleQuotes)

    return build


def claims_reformat(files: tuple[str, ...]) -> Callable[[Path, Path], None]:
    def claims(root: Path, original: Path) -> None:
        for rel in files:
            new, old = _read(root, rel), _read(original, rel)
            assert new != old, f"{rel} was not reformatted"
            assert t.same_ast(new, old), f"{rel}: reformatting changed the code, not only its layout"
            assert ",\n" in new and "'" in new
        text = _read(root, files[0])
        assert "DynamicCache()" in text, "the bare caches are still there to patch"

    return claims


def build_split_chains(root: Path) -> None:
    t.edit(
        root, TREE,
        ("        noise_embedding = target.model.embed_tokens(block_output_ids)\n",
         "        noise_embedding = (\n            target\n            .model\n            .embed_tokens(block_output_ids)\n        )\n"),
        ("        past_key_values_draft.crop(start)\n",
         "        (\n            past_key_values_draft\n            .crop(start)\n        )\n"),
        ("        per_position_logits = target.lm_head(draft_hidden[0, 1:, :])\n",
         "        per_position_logits = (\n            target\n            .lm_head(draft_hidden[0, 1:, :])\n        )\n"),
        ("    past_key_values.crop(past_length + len(keep_current_indices))\n",
         "    (\n        past_key_values\n        .crop(past_length + len(keep_current_indices))\n    )\n"),
    )
    t.edit(
        root, DD,
        ("            noise_embedding = target.model.embed_tokens(block_output_ids)\n",
         "            noise_embedding = (target\n                               .model\n                               .embed_tokens(block_output_ids))\n"),
        ("            past_key_values_draft.crop(start)\n",
         "            (past_key_values_draft\n             .crop(start))\n"),
        ("        past_key_values_target.crop(start)\n",
         "        (past_key_values_target\n         .crop(start))\n"),
    )


def claims_split_chains(root: Path, original: Path) -> None:
    for rel in (TREE, DD):
        new, old = _read(root, rel), _read(original, rel)
        assert t.same_ast(new, old), f"{rel}: splitting the chains changed the code"
        assert "\n            .model\n" in new or "\n                               .model\n" in new
        assert ".model.embed_tokens" not in new, f"{rel}: an unsplit embedding chain is left"
        assert "_draft.crop(" not in new, f"{rel}: an unsplit crop is left"


# ---------------------------------------------------------------- renamed variables, parameters and models


def build_rename_models(root: Path) -> None:
    # the target is now called `model`, the drafter `draft` (a swap: done in one pass)
    swap = {"target": "model", "model": "draft"}
    t.rename(root, DD, ["dflash_generate"], swap)
    t.rename(root, TREE, ["ddtree_generate"], swap)


def claims_rename_models(root: Path, original: Path) -> None:
    for rel, fn in ((DD, "dflash_generate"), (TREE, "ddtree_generate")):
        assert t.function_params(root, rel, fn)[:2] == ["draft", "model"]
        assert "target" not in t.names_in(root, rel, fn)
    text = _read(root, TREE)
    assert "model.model.embed_tokens(block_output_ids)" in text  # the target's embedding, under its new name
    assert "draft_hidden = draft(" in text and "verify = model(tree_ids" in text


def build_rename_caches(root: Path) -> None:
    # misleading names: the *draft's* cache is called target_kv; only data flow tells them apart
    names = {"past_key_values_target": "kv", "past_key_values_draft": "target_kv"}
    t.rename(root, DD, ["dflash_generate"], names)
    t.rename(root, TREE, ["ddtree_generate"], names)


def claims_rename_caches(root: Path, original: Path) -> None:
    for rel, fn in ((DD, "dflash_generate"), (TREE, "ddtree_generate")):
        found = t.names_in(root, rel, fn)
        assert {"kv", "target_kv"} <= found and not {"past_key_values_target", "past_key_values_draft"} & found
    assert "past_key_values=target_kv, use_cache=True" in _read(root, TREE)  # the draft call gets "target_kv"


def build_rename_params(root: Path) -> None:
    names = {
        "model": "drafter", "target": "verifier", "input_ids": "prompt_ids",
        "target_cache": "cache_a", "draft_cache": "cache_b",
    }
    t.rename(root, FL, ["dflash_generate"], names)


def claims_rename_params(root: Path, original: Path) -> None:
    assert t.function_params(root, FL, "dflash_generate")[:3] == ["drafter", "verifier", "prompt_ids"]
    found = t.names_in(root, FL, "dflash_generate")
    assert not {"model", "target", "input_ids", "target_cache", "draft_cache"} & found


# ---------------------------------------------------------------- aliased imports


def build_alias_dc(root: Path) -> None:
    for rel in (DD, TREE):
        t.edit(
            root, rel,
            ("from transformers import AutoModelForCausalLM, DynamicCache\n",
             "from transformers import AutoModelForCausalLM, DynamicCache as DC\n"),
            ("= DynamicCache()\n", "= DC()\n", 2),
        )
    t.edit(root, TREE, ("def compact_dynamic_cache(past_key_values: DynamicCache,", "def compact_dynamic_cache(past_key_values: DC,"))
    t.edit(
        root, DRAFT,
        ("from transformers import DynamicCache, Qwen3Config\n", "from transformers import DynamicCache as DC, Qwen3Config\n"),
        ("= DynamicCache()\n", "= DC()\n", 2),
    )


def claims_alias_dc(root: Path, original: Path) -> None:
    for rel in (DD, TREE, DRAFT):
        text = _read(root, rel)
        assert text.count("DynamicCache") == 1 and "DynamicCache as DC" in text and "DC()" in text


def build_alias_module(root: Path) -> None:
    for rel in (DD, TREE):
        t.edit(
            root, rel,
            ("from transformers import AutoModelForCausalLM, DynamicCache\n",
             "import transformers as tf\nfrom transformers import AutoModelForCausalLM\n"),
            ("= DynamicCache()\n", "= tf.DynamicCache()\n", 2),
        )
    t.edit(root, TREE, ("def compact_dynamic_cache(past_key_values: DynamicCache,", "def compact_dynamic_cache(past_key_values: tf.DynamicCache,"))


def claims_alias_module(root: Path, original: Path) -> None:
    for rel in (DD, TREE):
        text = _read(root, rel)
        assert "import transformers as tf" in text and text.count("tf.DynamicCache()") == 2
        assert "from transformers import AutoModelForCausalLM\n" in text


def build_alias_cache_utils(root: Path) -> None:
    t.edit(
        root, FL,
        ("from transformers import DynamicCache, Qwen3Config\nfrom transformers.cache_utils import Cache\n",
         "from transformers import Qwen3Config\nfrom transformers.cache_utils import Cache, DynamicCache as KVCache\n"),
        ("= DynamicCache()\n", "= KVCache()\n", 2),
    )


def claims_alias_cache_utils(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "from transformers.cache_utils import Cache, DynamicCache as KVCache" in text
    assert text.count("KVCache()") == 2 and "DynamicCache()" not in text


# ---------------------------------------------------------------- helpers


FACTORY = '''def _make_target_cache(target):
    return DynamicCache()


'''


def build_cache_factory(root: Path) -> None:
    t.insert_before(root, DD, "@torch.inference_mode()\ndef dflash_generate(", FACTORY)
    t.edit(root, DD, ("    past_key_values_target = DynamicCache()\n", "    past_key_values_target = _make_target_cache(target)\n"))
    t.insert_before(root, TREE, "@torch.inference_mode()\ndef ddtree_generate(", FACTORY)
    t.edit(root, TREE, ("    past_key_values_target = DynamicCache()\n", "    past_key_values_target = _make_target_cache(target)\n"))


def claims_cache_factory(root: Path, original: Path) -> None:
    for rel in (DD, TREE):
        text = _read(root, rel)
        assert "def _make_target_cache(target):\n    return DynamicCache()\n" in text
        assert "past_key_values_target = _make_target_cache(target)" in text
        assert "past_key_values_draft = DynamicCache()" in text


CROP_4X = '''def _rewind(cache, length):
    """Keep the first ``length`` tokens of ``cache`` (transformers 4.x crop meaning)."""
    cache.crop(length)


'''

CROP_5X = '''def _crop_to(cache, length):
    """Keep the first ``length`` tokens of ``cache``, with the native 5.x count."""
    remove = cache.get_seq_length() - length
    cache.crop(-remove)


'''


def build_crop_helper(helper: str, body: str) -> Callable[[Path], None]:
    def build(root: Path) -> None:
        t.insert_before(root, DD, "@torch.inference_mode()\ndef dflash_generate(", body)
        t.edit(
            root, DD,
            ("            past_key_values_draft.crop(start)\n", f"            {helper}(past_key_values_draft, start)\n"),
            ("        past_key_values_target.crop(start)\n", f"        {helper}(past_key_values_target, start)\n"),
        )
        t.edit(
            root, TREE,
            ("from dflash import dflash_generate, cuda_time, empty_stage_times\n",
             f"from dflash import dflash_generate, cuda_time, empty_stage_times, {helper}\n"),
            ("        past_key_values_draft.crop(start)\n", f"        {helper}(past_key_values_draft, start)\n"),
        )

    return build


def claims_crop_helper(helper: str) -> Callable[[Path, Path], None]:
    def claims(root: Path, original: Path) -> None:
        dd, tree = _read(root, DD), _read(root, TREE)
        assert f"def {helper}(cache, length):" in dd
        assert dd.count(f"{helper}(past_key_values_") == 2 and tree.count(f"{helper}(past_key_values_draft, start)") == 1
        assert "past_key_values_target.crop(" not in dd and "past_key_values_draft.crop(" not in dd + tree

    return claims


DECODE_PARAMS = [
    "model", "target", "output_ids", "position_ids", "past_key_values_target", "past_key_values_draft",
    "target_hidden", "prompt_len", "limit", "block_size", "uses_draft", "temperature", "stops", "stage_times", "decode_start",
]
TREE_PARAMS = [
    "model", "target", "output_ids", "position_ids", "past_key_values_target", "past_key_values_draft",
    "target_hidden", "prompt_len", "limit", "block_size", "budget", "mask_token_id", "device", "temperature", "stops",
    "stage_times", "decode_start",
]


def build_loop_helper(root: Path) -> None:
    # target_hidden exists only when drafting; the helper takes it either way
    t.edit(root, DD, ("    if uses_draft:\n        target_hidden = extract_context_feature(prefill",
                      "    target_hidden = None\n    if uses_draft:\n        target_hidden = extract_context_feature(prefill"))
    t.move_loop_into_helper(
        root, DD, "dflash_generate", "    acceptance_lengths: list[int] = []", "_decode_rounds",
        DECODE_PARAMS, ["acceptance_lengths", "round_timestamps"],
    )
    t.move_loop_into_helper(
        root, TREE, "ddtree_generate", "    acceptance_lengths: list[int] = []", "_tree_rounds",
        TREE_PARAMS, ["acceptance_lengths", "round_timestamps", "tree_sizes"],
    )


def claims_loop_helper(root: Path, original: Path) -> None:
    import ast

    for rel, fn, helper in ((DD, "dflash_generate", "_decode_rounds"), (TREE, "ddtree_generate", "_tree_rounds")):
        tree = ast.parse(_read(root, rel))
        funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert not any(isinstance(n, ast.While) for n in ast.walk(funcs[fn])), f"{fn} still has its loop"
        assert any(isinstance(n, ast.While) for n in ast.walk(funcs[helper]))
        calls = [n for n in ast.walk(funcs[fn]) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == helper]
        assert len(calls) == 1, f"{fn} does not call {helper}"
        assert "crop(start)" in ast.unparse(funcs[helper]) and "DynamicCache()" in ast.unparse(funcs[fn])


EMBED = '''def _embed(target, ids):
    return target.model.embed_tokens(ids)


'''


def build_embed_helper(root: Path) -> None:
    t.insert_before(root, DD, "@torch.inference_mode()\ndef dflash_generate(", EMBED)
    t.edit(root, DD, ("target.model.embed_tokens(block_output_ids)", "_embed(target, block_output_ids)"))
    t.edit(
        root, TREE,
        ("from dflash import dflash_generate, cuda_time, empty_stage_times\n",
         "from dflash import _embed, dflash_generate, cuda_time, empty_stage_times\n"),
        ("target.model.embed_tokens(block_output_ids)", "_embed(target, block_output_ids)"),
    )


def claims_embed_helper(root: Path, original: Path) -> None:
    dd, tree = _read(root, DD), _read(root, TREE)
    assert "return target.model.embed_tokens(ids)" in dd
    assert "_embed(target, block_output_ids)" in dd and "_embed(target, block_output_ids)" in tree
    assert "embed_tokens(block_output_ids)" not in dd + tree


RUN_TARGET = '''def _run_target(target, ids, positions, cache, **kwargs):
    return target(ids, position_ids=positions, past_key_values=cache, use_cache=True, **kwargs)


'''

OLD_PREFILL = '''    first = target(
        input_ids,
        position_ids=positions[:, :prompt_len],
        past_key_values=target_cache,
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=block_size > 1,
    )
'''

OLD_VERIFY = '''        out = target(
            block,
            position_ids=positions[:, start : start + block_size],
            past_key_values=target_cache,
            use_cache=True,
            output_hidden_states=block_size > 1,
        )
'''


def build_verify_helper(root: Path) -> None:
    # one helper runs the target for the prefill and for every verify
    t.insert_before(root, FL, "# ---------------------------------------------------------------- decoding\n", RUN_TARGET)
    t.edit(
        root, FL,
        (OLD_PREFILL, "    first = _run_target(\n        target, input_ids, positions[:, :prompt_len], target_cache, logits_to_keep=1,\n"
                      "        output_hidden_states=block_size > 1,\n    )\n"),
        (OLD_VERIFY, "        out = _run_target(\n            target, block, positions[:, start : start + block_size], target_cache,\n"
                     "            output_hidden_states=block_size > 1,\n        )\n"),
    )


def claims_verify_helper(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert text.count("_run_target(\n") == 2 and "= target(" not in text.split("def dflash_generate(")[1].split("class ")[0]


PROPOSE = '''def _propose(model, target, block, context, positions, cache):
    return model(
        position_ids=positions,
        noise_embedding=target.model.embed_tokens(block),
        target_hidden=context,
        past_key_values=cache,
        use_cache=True,
    )


'''

OLD_DRAFT_CALL = '''            hidden = model(
                position_ids=positions[:, draft_cache.get_seq_length() : start + block_size],
                noise_embedding=target.model.embed_tokens(block),
                target_hidden=context,
                past_key_values=draft_cache,
                use_cache=True,
            )
'''


def build_draft_helper(root: Path) -> None:
    # the draft call (and the target's embedding of the block) move into a helper
    t.insert_before(root, FL, "# ---------------------------------------------------------------- decoding\n", PROPOSE)
    t.edit(
        root, FL,
        (OLD_DRAFT_CALL, "            hidden = _propose(\n                model, target, block, context,\n"
                         "                positions[:, draft_cache.get_seq_length() : start + block_size], draft_cache,\n"
                         "            )\n"),
    )


def claims_draft_helper(root: Path, original: Path) -> None:
    text = _read(root, FL)
    body = text.split("def dflash_generate(")[1].split("class ")[0]
    assert "hidden = _propose(" in body and "model(" not in body and "embed_tokens" not in body
    assert "noise_embedding=target.model.embed_tokens(block)" in text.split("def _propose(")[1]


def build_tree_native_crop(root: Path) -> None:
    # DDTree's compaction already written for 5.x: both crops are counts from the cache's length
    t.edit(
        root, TREE,
        ("        past_key_values.crop(past_length)\n",
         "        past_key_values.crop(past_length - past_key_values.get_seq_length())\n"),
        ("    past_key_values.crop(past_length + len(keep_current_indices))\n",
         "    past_key_values.crop(past_length + kept - past_key_values.get_seq_length())\n"),
    )


def claims_tree_native_crop(root: Path, original: Path) -> None:
    text = _read(root, TREE)
    assert text.count("- past_key_values.get_seq_length())") == 2 and "past_key_values.crop(past_length)" not in text


def build_compact_renamed(root: Path) -> None:
    t.edit(
        root, TREE,
        ("def compact_dynamic_cache(", "def _pack_accepted(", 1),
        ("        compact_dynamic_cache(past_key_values_target, start, path)\n",
         "        _pack_accepted(past_key_values_target, start, path)\n"),
    )


def claims_compact_renamed(root: Path, original: Path) -> None:
    text = _read(root, TREE)
    assert "compact_dynamic_cache" not in text and text.count("_pack_accepted(") == 2


def build_caches_unpacked(root: Path) -> None:
    t.edit(
        root, FL,
        ("    target_cache = DynamicCache()\n    draft_cache = DynamicCache()\n",
         '    caches = {"target": DynamicCache(), "draft": DynamicCache()}\n'
         '    target_cache, draft_cache = caches["target"], caches["draft"]\n'),
    )


def claims_caches_unpacked(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert 'target_cache, draft_cache = caches["target"], caches["draft"]' in text and "    target_cache = " not in text


# ---------------------------------------------------------------- the seed's sed


SED = 'DynamicCache(config=target.config if hasattr(target, "config") else None)'


def build_seed_sed(root: Path) -> None:
    # `sed -i 's/DynamicCache()/DynamicCache(config=...)/g'` over the tree: the draft's caches get the target's config too
    for rel in (DD, TREE, DRAFT):
        t.edit(root, rel, ("DynamicCache()", SED, 2))


def claims_seed_sed(root: Path, original: Path) -> None:
    for rel in (DD, TREE, DRAFT):
        text = _read(root, rel)
        assert text.count(SED) == 2 and "DynamicCache()" not in text
    assert f"past_key_values_draft = {SED}" in _read(root, TREE)


def build_seed_sed_dflash(root: Path) -> None:
    t.edit(root, FL, ("DynamicCache()", SED, 2))


def claims_seed_sed_dflash(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert f"target_cache = {SED}" in text and f"draft_cache = {SED}" in text


def build_config_kwargs(root: Path) -> None:
    # one set of cache arguments for both caches: the target's config reaches the draft through **kwargs
    t.edit(
        root, FL,
        ("    target_cache = DynamicCache()\n    draft_cache = DynamicCache()\n",
         '    cache_kwargs = {"config": getattr(target, "config", None)}\n'
         "    target_cache = DynamicCache(**cache_kwargs)\n    draft_cache = DynamicCache(**cache_kwargs)\n"),
    )


def claims_config_kwargs(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert text.count("DynamicCache(**cache_kwargs)") == 2 and 'getattr(target, "config", None)' in text


SHARED_FACTORY = '''def _new_cache(model):
    return DynamicCache()


'''


def build_factory_shared(root: Path) -> None:
    t.insert_before(root, FL, "# ---------------------------------------------------------------- decoding\n", SHARED_FACTORY)
    t.edit(
        root, FL,
        ("    target_cache = DynamicCache()\n    draft_cache = DynamicCache()\n",
         "    target_cache = _new_cache(target)\n    draft_cache = _new_cache(model)\n"),
    )


def claims_factory_shared(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "def _new_cache(model):\n    return DynamicCache()\n" in text
    assert "target_cache = _new_cache(target)" in text and "draft_cache = _new_cache(model)" in text


# ---------------------------------------------------------------- type annotations


def build_annotations(root: Path) -> None:
    for rel, pad in ((DD, "            "), (TREE, "        ")):
        t.edit(
            root, rel,
            ("    past_key_values_target = DynamicCache()\n", "    past_key_values_target: DynamicCache = DynamicCache()\n"),
            ("    past_key_values_draft = DynamicCache()\n", "    past_key_values_draft: DynamicCache = DynamicCache()\n"),
            (f"{pad}noise_embedding = target.model", f"{pad}noise_embedding: torch.Tensor = target.model"),
            (f"{pad}draft_hidden = model(", f"{pad}draft_hidden: torch.Tensor = model("),
            ("        verify = target(", '        verify: "CausalLMOutputWithPast" = target('),
        )
    t.edit(root, DRAFT, ("        target_cache = DynamicCache()\n", "        target_cache: Cache = DynamicCache()\n"))


def claims_annotations(root: Path, original: Path) -> None:
    import ast

    for rel in (DD, TREE):
        tree = ast.parse(_read(root, rel))
        annotated = {n.target.id for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        assert {"past_key_values_target", "past_key_values_draft", "noise_embedding", "draft_hidden", "verify"} <= annotated


# ---------------------------------------------------------------- the 5.x-native style (DFlash's newer upstream)


_NATIVE_NEW_CACHE = '''def _new_cache(model) -> DynamicCache:
    """A cache laid out for ``model``'s own layer types that can roll back after a verify."""
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache
'''
NATIVE_HELPERS = _NATIVE_NEW_CACHE + '''


def _trim(cache, length: int) -> None:
    """Cut ``cache`` back to its first ``length`` tokens (transformers 5.x counts from the end)."""
    remove = cache.get_seq_length() - length
    cache.crop(-remove)


def _embed(model, ids: torch.Tensor) -> torch.Tensor:
    return model.get_input_embeddings()(ids)


'''

# The draft builds its own masks, one per layer type, over the key positions 0..last: every
# layer's keys are the trailing positions of that span (a sliding cache layer keeps fewer of
# them), so each attention takes the trailing columns it has keys for. A block query at q sees
# a key at k in a sliding layer when q - k < window (the block stays bidirectional); in a
# full-attention layer it sees everything, so that layer gets no mask and sdpa runs non-causal.
NATIVE_MASKS = '''    def _layer_masks(self, position_ids: torch.LongTensor, q_len: int, dtype: torch.dtype) -> dict:
        masks = {"full_attention": None}
        window = getattr(self.config, "sliding_window", None)
        if window:
            keys = torch.arange(int(position_ids[0, -1]) + 1, device=position_ids.device)
            queries = position_ids[0, -q_len:]
            outside = (queries[:, None] - keys[None, :]) >= window
            mask = torch.zeros(outside.shape, dtype=dtype, device=position_ids.device)
            masks["sliding_attention"] = mask.masked_fill(outside, torch.finfo(dtype).min)[None, None]
        return masks

    def forward(
        self, position_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
        noise_embedding: Optional[torch.Tensor] = None, target_hidden: Optional[torch.Tensor] = None,
        past_key_values: Optional[Cache] = None, use_cache: bool = False, **kwargs,
    ) -> torch.Tensor:
        context = self.hidden_norm(self.fc(target_hidden))
        rope = self.rotary_emb(noise_embedding, position_ids)
        cache = past_key_values if use_cache else None
        masks = self._layer_masks(position_ids, noise_embedding.shape[1], noise_embedding.dtype)
        out = noise_embedding
        for layer in self.layers:
            mask = masks[layer.self_attn.layer_type] if attention_mask is None else attention_mask
            out = layer(
                out, target_hidden=context, position_ids=position_ids, position_embeddings=rope,
                attention_mask=mask, past_key_values=cache, **kwargs,
            )
        return self.norm(out)
'''

OLD_DRAFT_FORWARD = '''    def forward(
        self, position_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
        noise_embedding: Optional[torch.Tensor] = None, target_hidden: Optional[torch.Tensor] = None,
        past_key_values: Optional[Cache] = None, use_cache: bool = False, **kwargs,
    ) -> torch.Tensor:
        context = self.hidden_norm(self.fc(target_hidden))
        rope = self.rotary_emb(noise_embedding, position_ids)
        cache = past_key_values if use_cache else None
        out = noise_embedding
        # each layer is called with the context by keyword, as upstream's drafter does: the call looks
        # like a drafter call (target_hidden=) inside the drafter's own forward, which a recipe must
        # leave alone (the decode loop's drafter call is the one to route)
        for layer in self.layers:
            out = layer(
                out,
                target_hidden=context,
                position_ids=position_ids,
                position_embeddings=rope,
                attention_mask=attention_mask,
                past_key_values=cache,
                **kwargs,
            )
        return self.norm(out)
'''


# The form of code written against transformers 5.25's own past recording: the target cache records
# a count of recurrent states (5.25 then rolls a chain back by itself), a cache is only armed once
# (`is_recording_past`), and the draft cache records its past bare.
NATIVE_COUNT_HELPERS = '''def _new_cache(model, keep: int = 0) -> DynamicCache:
    """A cache laid out for ``model``'s own layer types; ``keep`` recurrent states are recorded (5.25)."""
    cache = DynamicCache(config=model.config)
    if keep and not any(cache.is_recording_past(i) for i in range(len(cache.layers))):
        cache.activate_past_recording(recurrent_states_to_keep=keep)
    elif not keep:
        cache.activate_past_recording()
    return cache
'''


def build_native_count(root: Path) -> None:
    build_native("helper")(root)
    t.edit(
        root, FL,
        (_NATIVE_NEW_CACHE, NATIVE_COUNT_HELPERS),
        ("    target_cache = _new_cache(target)\n", "    target_cache = _new_cache(target, keep=2 * block_size)\n"),
    )


def claims_native_count(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "cache.activate_past_recording(recurrent_states_to_keep=keep)" in text and "is_recording_past(" in text
    assert "target_cache = _new_cache(target, keep=2 * block_size)" in text and "draft_cache = _new_cache(model)" in text
    assert "_trim(target_cache, start)" in text and "DynamicCache()" not in text


def build_native(target_crop: str) -> Callable[[Path], None]:
    """``target_crop``: "helper" (target through ``_trim``, draft inline) or "inline" (the other way round)."""
    inline = "{c}.crop(start - {c}.get_seq_length())"
    helper = "_trim({c}, start)"
    target_form, draft_form = (helper, inline) if target_crop == "helper" else (inline, helper)

    def build(root: Path) -> None:
        t.insert_before(root, FL, "# ---------------------------------------------------------------- decoding\n", NATIVE_HELPERS)
        t.edit(
            root, FL,
            ("    target_cache = DynamicCache()\n    draft_cache = DynamicCache()\n",
             "    target_cache = _new_cache(target)\n    draft_cache = _new_cache(model)\n"),
            ("noise_embedding=target.model.embed_tokens(block),", "noise_embedding=_embed(target, block),"),
            ("            draft_cache.crop(start)\n", f"            {draft_form.format(c='draft_cache')}\n"),
            ("        target_cache.crop(start)\n", f"        {target_form.format(c='target_cache')}\n"),
            # the attention keeps the layer type, and the trailing mask columns it has keys for
            ('        self.sliding_window = config.sliding_window if kinds[layer_idx] == "sliding_attention" else None\n',
             '        self.layer_type = kinds[layer_idx]\n'
             '        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None\n'),
            ("            k, v = past_key_values.update(k, v, self.layer_idx, {\"cos\": cos, \"sin\": sin})\n",
             "            k, v = past_key_values.update(k, v, self.layer_idx, {\"cos\": cos, \"sin\": sin})\n"
             "        if attention_mask is not None:\n"
             "            attention_mask = attention_mask[..., -k.shape[-2] :]\n"),
            (OLD_DRAFT_FORWARD, NATIVE_MASKS),
        )

    return build


def claims_native(target_crop: str) -> Callable[[Path, Path], None]:
    def claims(root: Path, original: Path) -> None:
        text = _read(root, FL)
        assert "DynamicCache(config=model.config)" in text and "cache.activate_past_recording()" in text
        assert "target_cache = _new_cache(target)" in text and "draft_cache = _new_cache(model)" in text
        assert "cache.crop(-remove)" in text and ".embed_tokens" not in text and "get_input_embeddings()" in text
        assert "DynamicCache()" not in text
        if target_crop == "helper":
            assert "_trim(target_cache, start)" in text and "draft_cache.crop(start - draft_cache.get_seq_length())" in text
        else:
            assert "_trim(draft_cache, start)" in text and "target_cache.crop(start - target_cache.get_seq_length())" in text
        assert "def _layer_masks(" in text

    return claims


NATIVE_STATUSES = {
    "target-cache-config": "fixed-upstream",
    "input-embeddings": "fixed-upstream",
    # the crops take 5.x counts (fixed-upstream), but `_new_cache`'s bare activate_past_recording()
    # breaks 5.25's GDN forward: it goes through record_past (applied)
    "crop-compat": "applied",
    "attn-fallback": "fixed-upstream",
    "lazy-datasets": "fixed-upstream",
    "verify-forward": "applied",
    "draft-sliding-window": "fixed-upstream",
}


# ---------------------------------------------------------------- the list


VARIANTS: list[Variant] = [
    Variant(
        "reformat-black", "reformatting", "ddtree",
        build_reformat((DD, TREE, DRAFT)), claims_reformat((DD, TREE, DRAFT)),
        summary="one argument per line with trailing commas, single quotes",
    ),
    Variant(
        "reformat-black-dflash", "reformatting", "dflash",
        build_reformat((FL,)), claims_reformat((FL,)),
        summary="the same on DFlash's model.py",
    ),
    Variant(
        "split-chains", "reformatting", "ddtree", build_split_chains, claims_split_chains,
        summary="parenthesised attribute chains split over lines (`target\\n.model\\n.embed_tokens(...)`, `cache\\n.crop(n)`)",
    ),
    Variant(
        "rename-models", "renamed models", "ddtree", build_rename_models, claims_rename_models,
        summary="the target is called `model`, the drafter `draft` (decoder parameters too)",
    ),
    Variant(
        "rename-caches", "renamed variables", "ddtree", build_rename_caches, claims_rename_caches,
        summary="target cache `kv`, draft cache `target_kv` (names that mislead)",
    ),
    Variant(
        "rename-params", "renamed parameters", "dflash", build_rename_params, claims_rename_params,
        summary="`dflash_generate(drafter, verifier, prompt_ids, ...)`, caches `cache_a` / `cache_b`",
    ),
    Variant(
        "caches-unpacked", "renamed variables", "dflash", build_caches_unpacked, claims_caches_unpacked,
        summary='both caches built in a dict and unpacked: `target_cache, draft_cache = caches["target"], caches["draft"]`',
    ),
    Variant(
        "compact-renamed", "renamed variables", "ddtree", build_compact_renamed, claims_compact_renamed,
        # file None: the anchor function is gone, so the no-match names it without a file; crop-compat
        # anchors its 4.x crop there too, so both steps say so; and the renamed compaction, no longer tree-commit's,
        # edits the target cache's layers by hand: cache-surgery names it
        expected=(NoMatch("crop-compat", None, "compact_dynamic_cache"), NoMatch("tree-commit", None, "compact_dynamic_cache"),
                  NoMatch("cache-surgery", "ddtree.py", "_pack_accepted")),
        summary="DDTree's `compact_dynamic_cache` renamed `_pack_accepted`",
    ),
    Variant(
        "alias-dc", "aliased imports", "ddtree", build_alias_dc, claims_alias_dc,
        summary="`from transformers import DynamicCache as DC`",
    ),
    Variant(
        "alias-module", "aliased imports", "ddtree", build_alias_module, claims_alias_module,
        summary="`import transformers as tf; tf.DynamicCache()`",
    ),
    Variant(
        "alias-cache-utils", "aliased imports", "dflash", build_alias_cache_utils, claims_alias_cache_utils,
        summary="`from transformers.cache_utils import DynamicCache as KVCache`",
    ),
    Variant(
        "cache-factory-bare", "helpers", "ddtree", build_cache_factory, claims_cache_factory,
        summary="`def _make_target_cache(target): return DynamicCache()` makes the target caches",
    ),
    Variant(
        "factory-shared-bare", "helpers", "dflash", build_factory_shared, claims_factory_shared,
        summary="one bare factory `_new_cache(model)` for both caches, called with the target and with the drafter",
    ),
    Variant(
        "crop-helper-4x", "helpers", "ddtree", build_crop_helper("_rewind", CROP_4X), claims_crop_helper("_rewind"),
        summary="`_rewind(cache, n)` = `cache.crop(n)` (4.x length), imported by ddtree.py",
    ),
    Variant(
        "crop-helper-5x", "helpers", "ddtree", build_crop_helper("_crop_to", CROP_5X), claims_crop_helper("_crop_to"),
        summary="`_crop_to(cache, n)`: `remove = cache.get_seq_length() - n; cache.crop(-remove)` (5.x count)",
    ),
    Variant(
        "tree-native-crop", "5.x-native", "ddtree", build_tree_native_crop, claims_tree_native_crop,
        summary="`compact_dynamic_cache` crops with 5.x counts: `crop(past_length + kept - cache.get_seq_length())`",
    ),
    Variant(
        "loop-helper", "helpers", "ddtree", build_loop_helper, claims_loop_helper,
        summary="both decode loops moved into `_decode_rounds` / `_tree_rounds`, called by the anchors",
    ),
    Variant(
        "verify-helper", "helpers", "dflash", build_verify_helper, claims_verify_helper,
        # the target's calls all go through `_run_target`, so `dflash_generate` (the anchor) has no site
        expected=NoMatch("verify-forward", FL, "dflash_generate"),
        summary="`_run_target(target, ids, positions, cache, **kw)` runs the target for the prefill and for every verify",
    ),
    Variant(
        "draft-helper", "helpers", "dflash", build_draft_helper, claims_draft_helper,
        statuses={"draft-sliding-window": "applied", "input-embeddings": "applied"},
        summary="`_propose(model, target, block, context, positions, cache)` makes the draft call and embeds the block",
    ),
    Variant(
        "embed-helper", "helpers", "ddtree", build_embed_helper, claims_embed_helper,
        summary="`_embed(target, ids)` = `target.model.embed_tokens(ids)`, imported by ddtree.py",
    ),
    Variant(
        "seed-sed", "the seed's sed", "ddtree", build_seed_sed, claims_seed_sed,
        summary='`DynamicCache(config=target.config if hasattr(target, "config") else None)` on every cache',
    ),
    Variant(
        "seed-sed-dflash", "the seed's sed", "dflash", build_seed_sed_dflash, claims_seed_sed_dflash,
        summary="the same sed on DFlash's model.py",
    ),
    Variant(
        "config-kwargs", "the seed's sed", "dflash", build_config_kwargs, claims_config_kwargs,
        summary='`cache_kwargs = {"config": getattr(target, "config", None)}` spread into both caches',
    ),
    Variant(
        "annotations", "type annotations", "ddtree", build_annotations, claims_annotations,
        summary="`past_key_values_target: DynamicCache = DynamicCache()`, annotated embeddings and verify outputs",
    ),
    Variant(
        "native-5x", "5.x-native", "dflash", build_native("helper"), claims_native("helper"),
        statuses=NATIVE_STATUSES,
        summary="`_new_cache(model)` with config + past recording, target crop via `_trim` (count), draft crop inline "
        "`crop(n - get_seq_length())`, `get_input_embeddings()` helper, draft builds its own per-layer-type masks",
    ),
    Variant(
        "native-5x-swapped", "5.x-native", "dflash", build_native("inline"), claims_native("inline"),
        statuses=NATIVE_STATUSES,
        summary="the same, target crop inline and draft crop via `_trim`",
    ),
    Variant(
        "native-5x-count", "5.x-native", "dflash", build_native_count, claims_native_count,
        statuses=NATIVE_STATUSES, unpatched_min_transformers="5.25",
        summary="as `native-5x`, written for 5.25's recording: the target cache records a count "
        "(`activate_past_recording(recurrent_states_to_keep=...)`, armed once through `is_recording_past`)",
    ),
]

BY_NAME = {v.name: v for v in VARIANTS}


# ---------------------------------------------------------------- a drafter that masks itself (DFlash's newest style)


SELF_MASK = '''def _attention_mask(query, key, *, is_causal, sliding_window):
    """Additive [1, 1, q, k] mask: the q queries sit at the last q key positions; a key is hidden when it
    lies ahead of its query (causal) or at least ``sliding_window`` positions behind it."""
    n_q, n_k = query.shape[-2], key.shape[-2]
    offset = (torch.arange(n_q, device=query.device) + (n_k - n_q)).unsqueeze(-1) - torch.arange(n_k, device=query.device)
    hidden = torch.zeros_like(offset, dtype=torch.bool)
    if is_causal:
        hidden = hidden | (offset < 0)
    if sliding_window is not None:
        hidden = hidden | (offset >= sliding_window)
    blocked = torch.full(hidden.shape, torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device)
    return torch.where(hidden, blocked, torch.zeros_like(blocked)).view(1, 1, n_q, n_k)


'''


def build_draft_masks_itself(root: Path) -> None:
    # the attention builds its own mask when none is passed: causal and windowed on its sliding layers
    t.insert_before(root, FL, "class Qwen3DFlashAttention(nn.Module):\n", SELF_MASK)
    t.edit(
        root, FL,
        ('        self.sliding_window = config.sliding_window if kinds[layer_idx] == "sliding_attention" else None\n',
         '        self.is_causal = kinds[layer_idx] == "sliding_attention"\n'
         '        self.sliding_window = config.sliding_window if self.is_causal else None\n'),
        ("            k, v = past_key_values.update(k, v, self.layer_idx, {\"cos\": cos, \"sin\": sin})\n",
         "            k, v = past_key_values.update(k, v, self.layer_idx, {\"cos\": cos, \"sin\": sin})\n"
         "        if attention_mask is None and (self.is_causal or self.sliding_window is not None):\n"
         "            attention_mask = _attention_mask(q, k, is_causal=self.is_causal, sliding_window=self.sliding_window)\n"),
    )


def claims_draft_masks_itself(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "def _attention_mask(query, key, *, is_causal, sliding_window):" in text
    assert "        if attention_mask is None and (self.is_causal or self.sliding_window is not None):\n" in text
    assert 'self.is_causal = kinds[layer_idx] == "sliding_attention"' in text
    assert "attention_mask=attention_mask" in text.split("class DFlashDraftModel")[1], "the drafter itself passes no mask of its own"


# ---------------------------------------------------------------- caches whose owner the code does not say


NEW_CACHES = '''def _new_caches():
    return DynamicCache(), DynamicCache()


'''

BOTH_CACHES = "    target_cache = DynamicCache()\n    draft_cache = DynamicCache()\n"


def build_factory_pair(root: Path) -> None:
    # one factory returns both bare caches; the pair is unpacked from its call
    t.insert_before(root, FL, "# ---------------------------------------------------------------- decoding\n", NEW_CACHES)
    t.edit(root, FL, (BOTH_CACHES, "    target_cache, draft_cache = _new_caches()\n"))


def claims_factory_pair(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "def _new_caches():\n    return DynamicCache(), DynamicCache()\n" in text
    assert "    target_cache, draft_cache = _new_caches()\n" in text and text.count("DynamicCache()") == 2


def build_caches_namespace(root: Path) -> None:
    # both caches kept as attributes of one namespace, used through it everywhere
    t.edit(
        root, FL,
        (BOTH_CACHES, "    caches = SimpleNamespace(target=DynamicCache(), draft=DynamicCache())\n"),
        ("past_key_values=target_cache,", "past_key_values=caches.target,", 2),
        ("past_key_values=draft_cache,", "past_key_values=caches.draft,"),
        ("draft_cache.get_seq_length()", "caches.draft.get_seq_length()"),
        ("draft_cache.crop(start)", "caches.draft.crop(start)"),
        ("target_cache.crop(start)", "caches.target.crop(start)"),
    )


def claims_caches_namespace(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "caches = SimpleNamespace(target=DynamicCache(), draft=DynamicCache())" in text
    assert "target_cache" not in text and "draft_cache" not in text
    assert text.count("past_key_values=caches.target,") == 2 and "caches.draft.crop(start)" in text


def build_cache_ifexp(root: Path) -> None:
    # a conditional expression around each bare cache
    t.edit(
        root, FL,
        (BOTH_CACHES, "    target_cache = DynamicCache() if max_new_tokens > 0 else None\n"
                      "    draft_cache = DynamicCache() if block_size > 1 else None\n"),
    )


def claims_cache_ifexp(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "target_cache = DynamicCache() if max_new_tokens > 0 else None" in text
    assert "draft_cache = DynamicCache() if block_size > 1 else None" in text


#: target-cache-config lays the target's cache out at run time: every target call goes through the runtime
ADOPTED = {"target-cache-config": "applied", "verify-forward": "applied"}

_ISSUE22 = [
    Variant(
        "caches-factory-pair", "helpers", "dflash", build_factory_pair, claims_factory_pair,
        statuses=ADOPTED,
        summary="one factory `_new_caches()` returns both bare caches: `target_cache, draft_cache = _new_caches()`",
    ),
    Variant(
        "caches-namespace", "renamed variables", "dflash", build_caches_namespace, claims_caches_namespace,
        statuses=ADOPTED,
        summary="`caches = SimpleNamespace(target=DynamicCache(), draft=DynamicCache())`, used as `caches.target` / `caches.draft`",
    ),
    Variant(
        "cache-ifexp", "the seed's sed", "dflash", build_cache_ifexp, claims_cache_ifexp,
        statuses=ADOPTED,
        summary="`target_cache = DynamicCache() if max_new_tokens > 0 else None` (and the draft's)",
    ),
    Variant(
        "draft-masks-itself", "5.x-native", "dflash", build_draft_masks_itself, claims_draft_masks_itself,
        statuses={"draft-sliding-window": "fixed-upstream"},
        summary="the draft's attention builds its own mask when none is passed: causal and windowed on its sliding layers",
    ),
]
VARIANTS.extend(_ISSUE22)
BY_NAME.update({v.name: v for v in _ISSUE22})


# ---------------------------------------------------------------- code written for transformers 5.24+: the cache as `cache=`


def build_cache_keyword_dflash(root: Path) -> None:
    # the target gets its cache under 5.24's keyword (past_key_values= is deprecated there, removed in 5.40)
    t.edit(root, FL, ("past_key_values=target_cache,", "cache=target_cache,", 2))


def claims_cache_keyword_dflash(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert text.count("cache=target_cache,") == 2 and "past_key_values=target_cache" not in text
    assert "past_key_values=draft_cache," in text, "the drafter (our own module) keeps its keyword"


def build_cache_keyword_ddtree(root: Path) -> None:
    for rel in (TREE, DD):
        t.edit(root, rel, ("past_key_values=past_key_values_target,", "cache=past_key_values_target,", 2))


def claims_cache_keyword_ddtree(root: Path, original: Path) -> None:
    for rel in (TREE, DD):
        text = _read(root, rel)
        assert text.count("cache=past_key_values_target,") == 2 and "past_key_values=past_key_values_target" not in text


_CACHE_KEYWORD = [
    Variant(
        "cache-keyword", "5.24-native", "dflash", build_cache_keyword_dflash, claims_cache_keyword_dflash,
        statuses={"target-cache-config": "applied", "verify-forward": "applied"}, min_transformers="5.24",
        summary="the target gets its cache as `cache=target_cache` (transformers 5.24+'s keyword), the drafter as before",
    ),
    Variant(
        "cache-keyword-ddtree", "5.24-native", "ddtree", build_cache_keyword_ddtree, claims_cache_keyword_ddtree,
        statuses={"target-cache-config": "applied", "verify-forward": "applied", "tree-commit": "applied"},
        min_transformers="5.24",
        summary="the same in both DDTree decoders: `target(..., cache=past_key_values_target, ...)`",
    ),
]
VARIANTS.extend(_CACHE_KEYWORD)
BY_NAME.update({v.name: v for v in _CACHE_KEYWORD})

# Each module below appends its variants to VARIANTS and BY_NAME when it is first imported; importing either one
# first imports this module, whose last lines then import the other: every variant is registered once, in any order.
from . import variants_newest  # noqa: E402,F401  (DFlash's newest upstream: registers its variants here)
from . import variants_forks  # noqa: E402,F401  (registers the shapes of real forks, issue 39)
from . import variants_backbone  # noqa: E402,F401  (verify through the backbone and the fork's own LM head, issue 42)
from . import variants_surgery  # noqa: E402,F401  (registers the forks that edit a cache's layers by hand, issue 42)
from . import variants_refusals  # noqa: E402,F401  (registers the shapes refused without need, issue 42)
from . import variants_round3  # noqa: E402,F401  (registers the engine-side shapes of issue 49, round 3)
