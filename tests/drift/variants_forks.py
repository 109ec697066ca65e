"""Drift variants of the shapes real forks were found to have (issue 39), written for this suite from ``vendored/``.

Each is a small transformation of ``vendored/ddtree`` or ``vendored/dflash`` (no fork's code is
copied): a target-only warm-up helper with its own bare cache, a drafter called positionally, a
clone helper that calls the legacy cache API transformers 5.x removed, a benchmark that imports a
sibling module that no longer exists, an analysis folder the recipe cannot read, a fork that
already reaches the embeddings through ``getattr``, and a tree that is not a DDTree/DFlash tree
at all (a full-prefix decoder with a stray ``torch.cuda.synchronize()``).
"""

from __future__ import annotations

from pathlib import Path

from . import transforms as t
from .variants import BY_NAME, LOSSLESS, NOT_A_DECODER, VARIANTS, NoMatch, Variant, _read

DD = "dflash.py"
BENCH = "benchmark.py"
FL = "dflash/model.py"
FL_BENCH = "dflash/benchmark.py"


# ---------------------------------------------------------------- a target-only helper (ddtree)
TARGET_ONLY = '''def target_generate(target, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding of the target alone: the benchmark's warm-up and its sanity baseline."""
    cache = DynamicCache()
    out = target(input_ids, past_key_values=cache, use_cache=True)
    ids = input_ids
    for _ in range(max_new_tokens):
        token = out.logits[:, -1:].argmax(-1)
        ids = torch.cat([ids, token], dim=1)
        out = target(token, past_key_values=cache, use_cache=True)
    return ids


'''


def build_target_only(root: Path) -> None:
    t.insert_before(root, DD, "@torch.inference_mode()\ndef dflash_generate(", TARGET_ONLY)
    t.edit(
        root, BENCH,
        ("from dflash import dflash_generate\n", "from dflash import dflash_generate, target_generate\n"),
        ("    prompts = load_and_process_dataset(args.dataset)\n",
         "    target_generate(target, tokenizer(\"warm up\", return_tensors=\"pt\").input_ids.to(target.device), 4)\n"
         "    prompts = load_and_process_dataset(args.dataset)\n"),
    )


def claims_target_only(root: Path, original: Path) -> None:
    dd, bench = _read(root, DD), _read(root, BENCH)
    helper = dd.split("def target_generate(")[1].split("\n\n\n")[0]
    assert "cache = DynamicCache()" in helper and "target_hidden" not in helper and "model(" not in helper
    assert "target_generate(target, " in bench and "dflash_generate(draft, target, " in bench


# ---------------------------------------------------------------- a drafter called positionally (dflash)
KEYWORD_DRAFT = '''            hidden = model(
                position_ids=positions[:, draft_cache.get_seq_length() : start + block_size],
                noise_embedding=target.model.embed_tokens(block),
                target_hidden=context,
                past_key_values=draft_cache,
                use_cache=True,
            )
'''
POSITIONAL_DRAFT = '''            hidden = model(
                positions[:, draft_cache.get_seq_length() : start + block_size],
                None,
                target.model.embed_tokens(block),
                context,
                draft_cache,
                True,
            )
'''


def build_positional_drafter(root: Path) -> None:
    t.edit(root, FL, (KEYWORD_DRAFT, POSITIONAL_DRAFT))


def claims_positional_drafter(root: Path, original: Path) -> None:
    decoder = _read(root, FL).split("def dflash_generate(")[1].split("# ------")[0]
    assert "target_hidden=" not in decoder and "past_key_values=draft_cache" not in decoder
    assert "                context,\n                draft_cache,\n" in decoder


# ---------------------------------------------------------------- the legacy cache API 5.x removed (dflash)
CLONE = '''def _clone_cache(cache):
    """A copy of a cache that a later re-run can start from."""
    return DynamicCache.from_legacy_cache(cache.to_legacy_cache())


'''


def build_legacy_clone(root: Path) -> None:
    t.insert_before(root, FL, "# ---------------------------------------------------------------- decoding\n", CLONE)
    t.edit(root, FL, ("    acceptance_lengths = []\n    start = prompt_len\n",
                      "    prompt_cache = _clone_cache(target_cache)  # kept for a re-run from the prompt\n"
                      "    acceptance_lengths = []\n    start = prompt_len\n"))


def claims_legacy_clone(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "DynamicCache.from_legacy_cache(cache.to_legacy_cache())" in text
    assert "prompt_cache = _clone_cache(target_cache)" in text


# ---------------------------------------------------------------- a sibling import that resolves to nothing (ddtree)
def build_missing_sibling(root: Path) -> None:
    t.edit(root, BENCH, ("from dflash import dflash_generate\n", "from dflash import dflash_generate\nimport distributed as dist\n"),
           ("    rank = int(os.environ.get(\"RANK\", 0))\n", "    rank = dist.rank() if dist.initialized() else int(os.environ.get(\"RANK\", 0))\n"))


def claims_missing_sibling(root: Path, original: Path) -> None:
    assert "import distributed as dist" in _read(root, BENCH)
    assert not (root / "distributed.py").exists() and not (root / "distributed").exists()


# ---------------------------------------------------------------- an analysis folder the recipe cannot read (dflash)
ANALYSIS = '''"""Token-level analysis of the target: replays a prompt and rewinds its cache."""

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def replay(target, ids, keep, rewind):
    cache = DynamicCache()
    target(ids, past_key_values=cache)
    ar_cache_len = keep
    if rewind:
        ar_cache_len = -rewind
    cache.crop(ar_cache_len)
    return cache


if __name__ == "__main__":
    model = AutoModelForCausalLM.from_pretrained("target").eval()
    with torch.no_grad():
        replay(model, torch.ones(1, 8, dtype=torch.long), 4, 0)
'''


def build_analysis_folder(root: Path) -> None:
    (root / "analysis").mkdir()
    (root / "analysis" / "target_tok.py").write_text(ANALYSIS, encoding="utf-8")


def claims_analysis_folder(root: Path, original: Path) -> None:
    text = _read(root, "analysis/target_tok.py")
    assert "ar_cache_len = keep" in text and "ar_cache_len = -rewind" in text and "cache.crop(ar_cache_len)" in text
    assert "analysis" not in "".join(_read(root, rel) for rel in (FL, FL_BENCH, "dflash/__init__.py"))


# ---------------------------------------------------------------- the accessor already reached through getattr (dflash)
GETATTR_EMBED = '''def _target_input_embeddings(target, ids):
    return getattr(target, "get_input_embeddings")()(ids)


'''


def build_accessor_getattr(root: Path) -> None:
    t.insert_before(root, FL, "# ---------------------------------------------------------------- decoding\n", GETATTR_EMBED)
    t.edit(root, FL, ("noise_embedding=target.model.embed_tokens(block),", "noise_embedding=_target_input_embeddings(target, block),"))


def claims_accessor_getattr(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert 'getattr(target, "get_input_embeddings")()(ids)' in text and "embed_tokens(block)" not in text


# ---------------------------------------------------------------- not a DDTree/DFlash tree (dflash)
FULL_PREFIX = '''@torch.inference_mode()
def full_prefix_generate(target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int, temperature: float = 0.0):
    """Greedy decoding that re-reads the whole prefix every step: no cache, no drafter."""
    start = _cuda_time()
    ids = input_ids
    for _ in range(max_new_tokens):
        ids = torch.cat([ids, sample(target(ids).logits[:, -1:], temperature)], dim=1)
    return ids, _cuda_time() - start


'''


def build_not_a_decoder(root: Path) -> None:
    path = root / FL
    text = path.read_text(encoding="utf-8")
    start = text.index("@torch.inference_mode()\ndef dflash_generate(")
    end = text.index("# ---------------------------------------------------------------- draft model")
    if text.count("@torch.inference_mode()\ndef dflash_generate(") != 1:
        raise t.DriftAnchorError(f"{FL}: the decoder's definition is not there once")
    text = text[:start] + FULL_PREFIX + text[end:]
    cut = text.index("    def spec_generate(")
    path.write_text(text[:cut].rstrip() + "\n", encoding="utf-8")
    t.edit(root, FL_BENCH, ("from .model import DFlashDraftModel, dflash_generate\n", "from .model import DFlashDraftModel, full_prefix_generate\n"),
           ("                dflash_generate(\n                    draft,\n                    target,\n",
            "                full_prefix_generate(\n                    target,\n"),
           ("                    stop_token_ids=[tokenizer.eos_token_id],\n", ""),
           ("                    block_size=size,\n                    return_stats=True,\n", ""))
    t.edit(root, "dflash/__init__.py", ('    "dflash_generate": ".model",\n', '    "full_prefix_generate": ".model",\n'))


def claims_not_a_decoder(root: Path, original: Path) -> None:
    text = "".join(_read(root, rel) for rel in (FL, FL_BENCH, "dflash/__init__.py"))
    assert "def dflash_generate(" not in text and "dflash_generate(" not in text and "target_hidden=context" not in text.split("class ")[0]
    assert "torch.cuda.synchronize()" in text, "the stray device call that made every step no-match is still there"


FORKS = [
    Variant(
        "target-only-helper", "forks", "ddtree", build_target_only, claims_target_only,
        statuses={"target-cache-config": "applied"},
        summary="`target_generate(target, ...)`: plain greedy decoding with its own bare `DynamicCache()`, no drafter in sight; "
                "the benchmark's warm-up calls it with the target it hands `dflash_generate`",
    ),
    Variant(
        "positional-drafter", "forks", "dflash", build_positional_drafter, claims_positional_drafter,
        statuses={"draft-sliding-window": "applied", "verify-forward": "applied", "target-cache-config": "applied"},
        summary="the drafter called with positional arguments only: `model(positions, None, embeds, context, draft_cache, True)`",
    ),
    Variant(
        "legacy-cache-clone", "forks", "dflash", build_legacy_clone, claims_legacy_clone,
        expected=NoMatch("removed-cache-api", FL, "_clone_cache"),
        summary="`_clone_cache(cache)` = `DynamicCache.from_legacy_cache(cache.to_legacy_cache())`, used on the target's cache",
    ),
    Variant(
        "missing-sibling", "forks", "ddtree", build_missing_sibling, claims_missing_sibling,
        summary="`benchmark.py` imports `distributed`, a sibling module the tree no longer has",
    ),
    Variant(
        "analysis-folder", "forks", "dflash", build_analysis_folder, claims_analysis_folder,
        expected=NoMatch("crop-compat", "analysis/target_tok.py", "replay"),
        summary="`analysis/target_tok.py`, imported by no decoder, crops with `ar_cache_len`, assigned a length and a count",
    ),
    Variant(
        "accessor-getattr", "forks", "dflash", build_accessor_getattr, claims_accessor_getattr,
        statuses={"input-embeddings": "fixed-upstream"},
        summary="the embeddings through `_target_input_embeddings(target, ids)` = `getattr(target, \"get_input_embeddings\")()(ids)`",
    ),
    Variant(
        "not-a-decoder", "forks", "dflash", build_not_a_decoder, claims_not_a_decoder, expected=NOT_A_DECODER,
        summary="the decoder replaced by a full-prefix greedy loop (no cache, no drafter call) that keeps `_cuda_time`'s "
                "`torch.cuda.synchronize()`",
    ),
]

assert all(v.expected in (LOSSLESS, NOT_A_DECODER) or isinstance(v.expected, tuple) for v in FORKS)
VARIANTS.extend(FORKS)
BY_NAME.update({v.name: v for v in FORKS})
