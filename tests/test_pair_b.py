"""The second trained pair (tests/data/pair_b, ``tools/train_tiny_pair.py`` with another shape and seed): a pair
that no stored floor exists for, so the acceptance judge meets it as it meets a user's. Its folders are small and
checkpoint-shaped, its shape differs from the shipped pair's, they load with ``from_pretrained``, and its greedy
decode through the patched vendored trees is token-exact with a drafter that really drafts."""

from __future__ import annotations

import json
from pathlib import Path

from pair_support import PAIR_B, pair_b
from tree_mutants import import_tree, patched_vendored

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "patcher" / "data" / "trained_pair"


def test_pair_b_is_small_has_no_stored_floor_and_differs_in_shape_from_the_shipped_pair():
    target, draft = pair_b()
    for folder in (target, draft):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (folder / name).is_file(), folder / name
    assert not list(PAIR_B.rglob("acceptance_floor.json")), "pair_b must stay a pair verify has never seen"
    assert sum(p.stat().st_size for p in PAIR_B.rglob("*") if p.is_file()) <= 4 * 2**20
    mine = {k: json.loads((f / "config.json").read_text()) for k, f in zip(("target", "draft"), pair_b())}
    shipped = {k: json.loads((SHIPPED / k / "config.json").read_text()) for k in ("target", "draft")}
    assert mine["draft"]["block_size"] == 16 != shipped["draft"]["block_size"]
    assert mine["target"]["layer_types"] != shipped["target"]["layer_types"]
    assert mine["draft"]["dflash_config"]["target_layer_ids"] != shipped["draft"]["dflash_config"]["target_layer_ids"]
    meta = json.loads((PAIR_B / "metadata.json").read_text())
    assert meta["command"].startswith("python tools/train_tiny_pair.py") and meta["training_seconds"] > 0


def test_pair_b_loads_and_decodes_token_exact_through_the_patched_vendored_trees(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = pair_b()
    dflash_generate, ddtree_generate, draft_class = import_tree(patched_vendored(tmp_path / "ddtree"))
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, local_files_only=True).eval()
    draft = draft_class.from_pretrained(draft_dir, dtype=torch.float32, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    block, n = draft.config.block_size, 32
    for text in json.loads((PAIR_B / "metadata.json").read_text())["held_out_prompts"][:2]:
        ids = tok(text, return_tensors="pt").input_ids
        seq = ids[0].tolist()
        with torch.inference_mode():  # the reference: greedy with no cache, one full forward per token
            for _ in range(n):
                seq.append(int(target(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        gold = seq[ids.shape[1]:]
        kw = dict(model=draft, target=target, input_ids=ids, mask_token_id=draft.mask_token_id, max_new_tokens=n,
                  block_size=block, stop_token_ids=None, temperature=0.0)
        for name, res in [("dflash", dflash_generate(**kw))] + [(f"ddtree_tb{b}", ddtree_generate(**kw, tree_budget=b))
                                                                for b in (8, 16)]:
            assert res.output_ids[0, ids.shape[1]:].tolist() == gold, name
            mean = sum(res.acceptance_lengths) / len(res.acceptance_lengths)
            assert mean >= 2.0, f"{name}: mean acceptance {mean:.2f}: the drafter does not draft"
