"""Drift variants of forks that edit a cache's layers by hand (issue 42, item 4), written for this suite from ``vendored/``.

Each is a small transformation of ``vendored/ddtree`` or ``vendored/dflash`` (no fork's code is copied): a flag whose
branch trims the target cache's keys and values to the committed prefix, the same branch trimming the keys alone, a
trim helper used for the target's crop, the draft's crop spelled as a hand trim, and a batched fork's
``batch_select_indices`` on the target's cache behind an optional argument.
"""

from __future__ import annotations

from pathlib import Path

from . import transforms as t
from .variants import BY_NAME, LOSSLESS, VARIANTS, NoMatch, Variant, _read

TREE = "ddtree.py"
FL = "dflash/model.py"
SECTION = "# ---------------------------------------------------------------- decoding\n"
COMPACT = "        compact_dynamic_cache(past_key_values_target, start, path)\n"


# ---------------------------------------------------------------- a flag that trims the target cache (ddtree)
def _flag(root: Path, body: str) -> None:
    t.edit(root, TREE,
           ("    tree_budget: int | None = None,\n) -> SimpleNamespace:",
            "    tree_budget: int | None = None, trim_kv: bool = False,\n) -> SimpleNamespace:"),
           (COMPACT, COMPACT + "        if trim_kv:  # keep only what was committed, in place\n"
                              "            for layer in past_key_values_target.layers:\n" + body))


def build_trim_flag(root: Path) -> None:
    _flag(root, "                layer.keys = layer.keys[:, :, : start + committed]\n"
                "                layer.values = layer.values[:, :, : start + committed]\n")


def build_keys_only_flag(root: Path) -> None:
    _flag(root, "                layer.keys = layer.keys[:, :, : start + committed]\n")


def _claims_flag(root: Path, values: bool) -> None:
    text = _read(root, TREE)
    decoder = text.split("def ddtree_generate(")[1]
    assert "trim_kv: bool = False" in decoder and "        if trim_kv:" in decoder
    assert "layer.keys = layer.keys[:, :, : start + committed]" in decoder
    assert ("layer.values = layer.values[:, :, : start + committed]" in decoder) == values


# ---------------------------------------------------------------- a trim helper for the target's crop (dflash)
TRIM_HELPER = '''def _trim_kv(cache, length):
    """Keep the first ``length`` tokens of every layer that holds keys (the fork's own crop)."""
    for layer in cache.layers:
        if not hasattr(layer, "keys"):
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


'''


def build_trim_helper(root: Path) -> None:
    t.insert_before(root, FL, SECTION, TRIM_HELPER)
    t.edit(root, FL, ("        target_cache.crop(start)\n", "        _trim_kv(target_cache, start)\n"))


def claims_trim_helper(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "def _trim_kv(cache, length):" in text and "        _trim_kv(target_cache, start)\n" in text
    assert "target_cache.crop(" not in text and "draft_cache.crop(start)" in text


# ---------------------------------------------------------------- the draft's crop as a hand trim (dflash)
def build_draft_trim(root: Path) -> None:
    t.edit(root, FL, ("            draft_cache.crop(start)\n",
                      "            for layer in draft_cache.layers:\n"
                      "                layer.keys = layer.keys[..., :start, :]\n"
                      "                layer.values = layer.values[..., :start, :]\n"))


def claims_draft_trim(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "draft_cache.crop(" not in text and "for layer in draft_cache.layers:" in text
    assert "    draft_cache = DynamicCache()\n" in text, "the draft's cache is built bare: attention layers only"


# ---------------------------------------------------------------- batch selection on the target's cache (dflash)
def build_batch_select(root: Path) -> None:
    t.edit(root, FL,
           ("    top_p: float = 1.0, top_k: int = 0,\n):",
            "    top_p: float = 1.0, top_k: int = 0, keep_rows: Optional[torch.Tensor] = None,\n):"),
           ("        start += run + 1\n        target_cache.crop(start)\n",
            "        start += run + 1\n        target_cache.crop(start)\n"
            "        if keep_rows is not None:  # a batched run drops the finished prompts\n"
            "            target_cache.batch_select_indices(keep_rows)\n"))


def claims_batch_select(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "keep_rows: Optional[torch.Tensor] = None" in text and "target_cache.batch_select_indices(keep_rows)" in text


SURGERY = [
    Variant(
        "kv-trim-flag", "forks", "ddtree", build_trim_flag, lambda root, original: _claims_flag(root, True),
        statuses={"cache-surgery": "applied", "tree-commit": "applied"},
        summary="`ddtree_generate(..., trim_kv=False)`: when set, the target cache's keys and values are trimmed by hand to "
                "the committed prefix after the compaction",
    ),
    Variant(
        "kv-keys-only-flag", "forks", "ddtree", build_keys_only_flag, lambda root, original: _claims_flag(root, False),
        expected=NoMatch("cache-surgery", TREE, "ddtree_generate"),
        summary="the same branch trims the keys and not the values",
    ),
    Variant(
        "kv-trim-helper", "forks", "dflash", build_trim_helper, claims_trim_helper,
        statuses={"cache-surgery": "applied", "crop-compat": "applied", "verify-forward": "applied"},
        summary="`_trim_kv(cache, length)` keeps the first `length` tokens of every layer with keys, used for the target's crop",
    ),
    Variant(
        "kv-trim-draft", "forks", "dflash", build_draft_trim, claims_draft_trim,
        statuses={"cache-surgery": "fixed-upstream", "crop-compat": "applied"},
        summary="the draft's crop spelled as a hand trim of each layer's keys and values on its bare cache",
    ),
    Variant(
        "batch-select-flag", "forks", "dflash", build_batch_select, claims_batch_select,
        expected=NoMatch("cache-surgery", FL, "dflash_generate"),
        summary="`dflash_generate(..., keep_rows=None)`: when given, `target_cache.batch_select_indices(keep_rows)`",
    ),
]

assert all(v.expected == LOSSLESS or isinstance(v.expected, tuple) for v in SURGERY)
VARIANTS.extend(SURGERY)
BY_NAME.update({v.name: v for v in SURGERY})
