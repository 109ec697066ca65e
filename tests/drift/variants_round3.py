"""Drift variants of the engine-side shapes issue 49 found in forks (round 3: refuse only a site, never a tree).

Each is a small transformation of ``vendored/dflash``, written here in our own words (no fork's code is copied):

* ``drafter-loop-only``: the decode loop lives only in the drafter's own ``spec_generate`` method, driving ``self(...)``;
  the module keeps ``dflash_generate`` as a plain alias of that method (no function of its own), as a fork that moved
  the loop into the class and kept the old name for its callers would;
* ``project-hidden-call``: the drafter gains ``project_target_hidden`` (its fc and norm, no attention), which the
  decoder calls before the real drafter call, handing it the projected features;
* ``cache-code-copy``: a module that copies a transformers release's cache classes (legacy tuples indexed by layer),
  imported by no decoder;
* ``archived-copy-docs-excluded``: a partial copy of the decoder kept under ``docs/``, importing a sibling module the
  copy lacks, in a tree whose ``ddpatch.toml`` follows the refusal's advice (``exclude = ["docs/"]``). Without it,
  ``check`` and ``apply`` exit 1 on the blocking import (``docs/archive/model.py:10``, offering ``--exclude docs/``)
  with no step's no-match: an outcome the drift table has no kind for, which ``tests/test_forks_round3.py`` checks;
* ``gdn-state-by-hand``: helpers that snapshot and restore each linear-attention layer's ``conv_states`` and
  ``recurrent_states`` by hand (``.clone()``, ``.copy_()``) around the verify.

``tests/test_forks_round3.py`` and ``tests/test_cache_surgery.py`` test the same shapes on small trees; these run them
inside a whole vendored tree, with its benchmark, so that a change in what ddpatch makes of them fails here too.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import transforms as t
from .variants import BY_NAME, VARIANTS, NoMatch, Variant, _read

FL = "dflash/model.py"
DECODING = "# ---------------------------------------------------------------- decoding\n"
DRAFT_MODEL = "\n\n# ---------------------------------------------------------------- draft model\n"


# ---------------------------------------------------------------- the drafter's own method is the only decoder
UPSTREAM_METHOD = '''    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int], temperature: float):
        self.eval()
        return dflash_generate(self, target, input_ids, max_new_tokens, stop_token_ids, temperature)
'''
ALIAS = '''

# the loop is the drafter's own now; callers that import the old name still find it (self is the drafter)
dflash_generate = DFlashDraftModel.spec_generate
'''


def build_drafter_loop_only(root: Path) -> None:
    t.rename(root, FL, ["dflash_generate"], {"model": "self"})
    text = _read(root, FL)
    head, rest = text.split("@torch.inference_mode()\ndef dflash_generate(", 1)
    loop, tail = rest.split(DRAFT_MODEL, 1)
    loop = "@torch.inference_mode()\ndef spec_generate(" + t.replace(loop, 'self: "DFlashDraftModel"', "self")
    method = "".join("    " + line if line.strip() else line for line in loop.rstrip("\n").splitlines(keepends=True)) + "\n"
    tail = t.replace(tail, UPSTREAM_METHOD, method, where=FL)
    (root / FL).write_text(head.rstrip("\n") + "\n" + DRAFT_MODEL + tail + ALIAS, encoding="utf-8")


def claims_drafter_loop_only(root: Path, original: Path) -> None:
    import ast

    tree = ast.parse(_read(root, FL))
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "dflash_generate" not in functions, "a module-level decoder function is left"
    [drafter] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DFlashDraftModel"]
    [method] = [f for f in drafter.body if isinstance(f, ast.FunctionDef) and f.name == "spec_generate"]
    loops = [n for n in ast.walk(method) if isinstance(n, ast.While)]
    selfish = [c for loop in loops for c in ast.walk(loop) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
               and c.func.id == "self" and any(k.arg == "target_hidden" for k in c.keywords)]
    assert selfish, "the method does not drive the drafter itself in its loop"
    assert "target_cache = DynamicCache()" in ast.unparse(method) and "model" not in {
        n.id for n in ast.walk(method) if isinstance(n, ast.Name)}
    assert "dflash_generate = DFlashDraftModel.spec_generate" in _read(root, FL)


# ---------------------------------------------------------------- a drafter method that projects the target's features
PROJECT = '''    def project_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's features mapped to the drafter's width (what forward does first unless told they are done)."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
'''


def build_project_hidden_call(root: Path) -> None:
    t.edit(
        root, FL,
        ("        past_key_values: Optional[Cache] = None, use_cache: bool = False, **kwargs,\n",
         "        past_key_values: Optional[Cache] = None, use_cache: bool = False, projected: bool = False, **kwargs,\n"),
        ("        context = self.hidden_norm(self.fc(target_hidden))\n",
         "        context = target_hidden if projected else self.project_target_hidden(target_hidden)\n"),
        ("            hidden = model(\n",
         "            features = model.project_target_hidden(context)\n            hidden = model(\n"),
        ("                noise_embedding=target.model.embed_tokens(block),\n                target_hidden=context,\n",
         "                noise_embedding=target.model.embed_tokens(block),\n                target_hidden=features,\n"
         "                projected=True,\n"),
    )
    text = _read(root, FL)
    forward = "    def forward(\n        self, position_ids: torch.LongTensor,"
    (root / FL).write_text(t.replace(text, forward, PROJECT + forward.split("\n", 1)[1], where=FL), encoding="utf-8")


def claims_project_hidden_call(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "def project_target_hidden(self, target_hidden" in text
    decoder = text.split("def dflash_generate(", 1)[1].split(DRAFT_MODEL, 1)[0]
    assert decoder.index("features = model.project_target_hidden(context)") < decoder.index("hidden = model(")
    assert "target_hidden=features," in decoder and "projected=True," in decoder


# ---------------------------------------------------------------- a copy of a release's cache classes, imported by nothing
KV_COPY = '''"""Key/value caches as the release this fork was first written against defined them, kept to read old checkpoints'
saved caches. Nothing in the decoder imports it: transformers' own DynamicCache runs the decode."""

from typing import Optional

import torch


class Cache:
    """What every cache answers."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class DynamicCache(Cache):
    """One growing tensor of keys and one of values per layer."""

    def __init__(self) -> None:
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.key_cache)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.key_cache[layer_idx].shape[-2] if layer_idx < len(self.key_cache) else 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int):
        if layer_idx == len(self.key_cache):
            self.key_cache.append(keys)
            self.value_cache.append(values)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], keys], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], values], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def to_legacy_cache(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        return tuple(zip(self.key_cache, self.value_cache))

    @classmethod
    def from_legacy_cache(cls, past_key_values: Optional[tuple[tuple[torch.Tensor, torch.Tensor], ...]] = None):
        cache = cls()
        if past_key_values is not None:
            for layer_idx in range(len(past_key_values)):
                keys, values = past_key_values[layer_idx]
                cache.update(keys, values, layer_idx)
        return cache
'''


def build_cache_code_copy(root: Path) -> None:
    (root / "dflash" / "legacy_kv.py").write_text(KV_COPY, encoding="utf-8")


def claims_cache_code_copy(root: Path, original: Path) -> None:
    copy = _read(root, "dflash/legacy_kv.py")
    assert "class DynamicCache(Cache):" in copy and "past_key_values[layer_idx]" in copy
    for path in root.rglob("*.py"):
        assert "legacy_kv" not in path.read_text(encoding="utf-8"), f"{path.name} imports the copy"


# ---------------------------------------------------------------- an archived partial copy under docs/
EXCLUDE_DOCS = '# the archived copy under docs/ is for reading: ddpatch leaves it out\nexclude = ["docs/"]\n'


def build_archived_copy_docs(root: Path) -> None:
    archived = t.replace(_read(root, FL), "import time\n", "import time\n\nfrom .fused import fused_rms_norm  # noqa: F401\n")
    folder = root / "docs" / "archive"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(archived, encoding="utf-8")
    (folder / "NOTES.md").write_text("The decoder as it was before the fused kernels moved out; kept for reading.\n",
                                     encoding="utf-8")
    # what the refusal advises (`--exclude docs/`), kept in the tree's own settings as its README would tell a user to
    (root / "ddpatch.toml").write_text(EXCLUDE_DOCS, encoding="utf-8")


def claims_archived_copy_docs(root: Path, original: Path) -> None:
    archived = _read(root, "docs/archive/model.py")
    assert "from .fused import fused_rms_norm" in archived and "def dflash_generate(" in archived
    assert not list(root.rglob("fused.py")), "the sibling the copy imports must be missing"
    assert _read(root, FL) == _read(original, FL), "the real decoder is untouched"
    assert _read(root, "ddpatch.toml") == EXCLUDE_DOCS


# ---------------------------------------------------------------- the linear-attention state kept by hand
STATE_BY_HAND = '''def _keep_linear_state(cache):
    """Each linear-attention layer's convolution and recurrent state, cloned before a verify."""
    kept = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            kept.append((layer.conv_states.clone(), layer.recurrent_states.clone()))
    return kept


def _put_back_linear_state(cache, kept):
    """The cloned states copied back into their layers after a rejection."""
    linear = [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]
    for layer, (conv, recurrent) in zip(linear, kept):
        layer.conv_states.copy_(conv)
        layer.recurrent_states.copy_(recurrent)


'''


def build_gdn_state_by_hand(root: Path) -> None:
    t.insert_before(root, FL, DECODING, STATE_BY_HAND)
    t.edit(
        root, FL,
        ("        out = target(\n            block,\n",
         "        kept_state = _keep_linear_state(target_cache)\n        out = target(\n            block,\n"),
        ("        start += run + 1\n        target_cache.crop(start)\n",
         "        start += run + 1\n        target_cache.crop(start)\n"
         "        if run + 1 < block_size:  # a rejection: the recurrent layers go back to before the verify\n"
         "            _put_back_linear_state(target_cache, kept_state)\n"),
    )


def claims_gdn_state_by_hand(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "layer.conv_states.clone()" in text and "layer.recurrent_states.copy_(recurrent)" in text
    decoder = text.split("def dflash_generate(", 1)[1]
    assert "kept_state = _keep_linear_state(target_cache)" in decoder and "_put_back_linear_state(target_cache, kept_state)" in decoder
    assert re.search(r"if hasattr\(layer, \"recurrent_states\"\)", text), "on a pure-attention target the helpers do nothing"


#: the decoder's sites all rewritten (the steps a tree without them would leave fixed-upstream or refuse)
ROUTED = {"target-cache-config": "applied", "verify-forward": "applied", "draft-sliding-window": "applied", "crop-compat": "applied"}

ROUND3 = [
    Variant(
        "drafter-loop-only", "forks (issue 49)", "dflash", build_drafter_loop_only, claims_drafter_loop_only,
        statuses=ROUTED, methods=("DFlashDraftModel.spec_generate",),
        summary="the decode loop moved into `DFlashDraftModel.spec_generate(self, target, ...)`, driving `self(...)`; "
                "`dflash_generate = DFlashDraftModel.spec_generate` is left as an alias (no module-level function)",
    ),
    Variant(
        "project-hidden-call", "forks (issue 49)", "dflash", build_project_hidden_call, claims_project_hidden_call,
        statuses=ROUTED,
        summary="`DFlashDraftModel.project_target_hidden(target_hidden)` (fc + norm, no attention); the decoder calls it "
                "first and hands the drafter `target_hidden=features, projected=True`",
    ),
    Variant(
        "cache-code-copy", "forks (issue 49)", "dflash", build_cache_code_copy, claims_cache_code_copy,
        statuses=ROUTED,
        summary="`dflash/legacy_kv.py`: `Cache` and `DynamicCache(Cache)` of an old release, `past_key_values[layer_idx]` "
                "unpacked as a legacy tuple; no module imports it",
    ),
    Variant(
        "archived-copy-docs-excluded", "forks (issue 49)", "dflash", build_archived_copy_docs, claims_archived_copy_docs,
        statuses=ROUTED,
        summary="`docs/archive/model.py`: a copy of the decoder that imports `.fused`, a sibling the copy lacks; the tree's "
                "`ddpatch.toml` says `exclude = [\"docs/\"]`, as the refusal advises",
    ),
    Variant(
        "gdn-state-by-hand", "forks (issue 49)", "dflash", build_gdn_state_by_hand, claims_gdn_state_by_hand,
        expected=(NoMatch("cache-surgery", FL, "_keep_linear_state"), NoMatch("cache-surgery", FL, "_put_back_linear_state")),
        summary="`_keep_linear_state(cache)` clones each linear layer's `conv_states` / `recurrent_states` before the "
                "verify, `_put_back_linear_state` copies them back (`.copy_()`) after a rejection",
    ),
]

VARIANTS.extend(ROUND3)
BY_NAME.update({v.name: v for v in ROUND3})
