"""The drafter oracle: draft-side bugs that keep every emitted token exact must fail ``ddpatch verify``.

Each planted bug is a small edit of the fully patched ``vendored/ddtree`` (a copy made at test
time; nothing in ``vendored/`` changes). The presets' scripted draft decides the proposals, so
the target side stays exact whatever the drafter is fed: the lossless and logits checks pass,
and only a ``drafter: METHOD`` check can see the bug. The correct tree must pass it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ("tiny-qwen3_5", "tiny-qwen3_5-vlm")
QUICK = ("--seeds", "0", "--prompts", "1", "--max-new-tokens", "12", "--tree-budgets", "4")
METHODS = ("dflash", "ddtree_tb4")


def ddpatch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "patcher.cli", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("drafter") / "ddtree"
    proc = ddpatch("apply", ROOT / "vendored" / "ddtree", "--recipe", "qwen3_6-gdn", "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def edit(tree: Path, rel: str, *pairs) -> None:
    """Exact-anchor replacements: each ``(old, new)`` must occur (so a moved anchor fails loudly)."""
    path = tree / rel
    text = path.read_text()
    for old, new in pairs:
        assert old in text, f"{rel}: anchor {old!r} is gone"
        text = text.replace(old, new)
    path.write_text(text)


CHAIN, TREE_, UTILS = "dflash.py", "ddtree.py", "model/utils.py"
PREFILL = "target_hidden = extract_context_feature(prefill.hidden_states, model.target_layer_ids)"
EMBED = "noise_embedding = target.get_input_embeddings()(block_output_ids)"


def cache_off_by_one(tree):
    # the draft cache keeps the committed token's block entry (crop to start + 1) and the next round's
    # features skip that position: every shape fits, the cached context is wrong
    edit(tree, CHAIN, ("crop_cache(past_key_values_draft, start)", "crop_cache(past_key_values_draft, start + 1)"),
         ("target_hidden = layers_out[:, :committed]", "target_hidden = layers_out[:, 1:committed]"))
    edit(tree, TREE_, ("crop_cache(past_key_values_draft, start)", "crop_cache(past_key_values_draft, start + 1)"),
         ("target_hidden = layers_out[:, path, :]", "target_hidden = layers_out[:, path[1:], :]"))


def stale_features(tree):
    # the features of the previous verify, indexed as if they were this one's
    edit(tree, CHAIN, ("            target_hidden = layers_out[:, :committed]\n",
                       "            target_hidden = locals().get('stale_out', layers_out)[:, :committed]\n"
                       "            stale_out = layers_out\n"))
    edit(tree, TREE_, ("        target_hidden = layers_out[:, path, :]\n",
                       "        stale_out = locals().get('stale_out', layers_out)\n"
                       "        target_hidden = (stale_out if stale_out.shape[1] > max(path) else layers_out)[:, path, :]\n"
                       "        stale_out = layers_out\n"))


def truncated_features(tree):
    # the prompt's context cut to its last 4 positions (the draft positions start there)
    for rel in (CHAIN, TREE_):
        edit(tree, rel, (PREFILL, PREFILL + "[:, -4:]"),
             ("draft_from = past_key_values_draft.get_seq_length()",
              "draft_from = max(past_key_values_draft.get_seq_length(), start - target_hidden.shape[1])"))


def positions_shifted(tree):
    edit(tree, CHAIN, ("position_ids[:, draft_from : window.stop]", "position_ids[:, draft_from + 1 : window.stop + 1]"))
    edit(tree, TREE_, ("position_ids[:, draft_from : start + block_size]", "position_ids[:, draft_from + 1 : start + block_size + 1]"))


def layers_reversed(tree):
    for rel in (CHAIN, TREE_):
        edit(tree, rel, ("model.target_layer_ids)", "model.target_layer_ids[::-1])"))


def offset_dropped(tree):
    edit(tree, UTILS, ("hidden_states[layer + 1]", "hidden_states[layer]"))


def wrong_table(tree):
    for rel in (CHAIN, TREE_):
        edit(tree, rel, (EMBED, "noise_embedding = torch.nn.functional.embedding(block_output_ids, target.get_output_embeddings().weight)"))


def wrong_mask_id(tree):
    for rel in (CHAIN, TREE_):
        edit(tree, rel, (EMBED, "noise_embedding = target.get_input_embeddings()("
                                "block_output_ids.masked_fill(block_output_ids == mask_token_id, mask_token_id - 1))"))


#: bug -> (the edit, the field the first failure must name)
BUGS = {
    "cache-off-by-one": (cache_off_by_one, "cache"),
    "stale-features": (stale_features, "features"),
    "truncated-features": (truncated_features, "features"),
    "positions-shifted": (positions_shifted, "positions"),
    "layers-reversed": (layers_reversed, "features"),
    "offset-dropped": (offset_dropped, "features"),
    "wrong-table": (wrong_table, "noise"),
    "wrong-mask-id": (wrong_mask_id, "noise"),
}
FAST = ("cache-off-by-one", "stale-features", "layers-reversed", "wrong-mask-id")


def verify(tree: Path) -> tuple[int, dict]:
    proc = ddpatch("verify", tree, "--format", "json", *QUICK, *[a for p in PRESETS for a in ("--preset", p)])
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def checks_of(payload: dict) -> dict[tuple[str, str], dict]:
    return {(m["model"], c["check"]): c for m in payload["models"] for c in m["checks"]}


def test_the_correct_tree_passes_the_drafter_oracle(full):
    code, payload = verify(full)
    checks = checks_of(payload)
    assert code == 0, [c for c in checks.values() if not c["passed"]]
    for preset in PRESETS:
        for method in METHODS:
            check = checks[(preset, f"drafter: {method}")]
            assert check["passed"] and not check.get("skipped"), check
            assert "drafter calls equal a from-scratch drafter forward" in check["evidence"], check


def _planted(full: Path, tmp_path: Path, bug: str) -> Path:
    tree = tmp_path / bug
    shutil.copytree(full, tree, ignore=shutil.ignore_patterns("__pycache__"))
    BUGS[bug][0](tree)
    return tree


def _assert_caught(full, tmp_path, bug):
    code, payload = verify(_planted(full, tmp_path, bug))
    checks = checks_of(payload)
    field = BUGS[bug][1]
    assert code == 1, "a draft-side bug must fail verify"
    for preset in PRESETS:
        for method in METHODS:
            assert checks[(preset, f"lossless: {method}")]["passed"], f"{bug} must keep the target side exact ({preset} {method})"
            assert checks[(preset, f"logits == from-scratch: {method}")]["passed"]
            check = checks[(preset, f"drafter: {method}")]
            assert not check["passed"], f"{bug}: {preset} {method} passed the drafter oracle: {check['evidence']}"
            assert f": {field} differs" in check["evidence"] and "hint:" in check["evidence"], check["evidence"]
            assert check["failures"][0]["field"] == field and "round" in check["evidence"]
    failed = {name for (_, name), c in checks.items() if not c["passed"]}
    assert failed == {f"drafter: {m}" for m in METHODS}, failed


@pytest.mark.parametrize("bug", FAST)
def test_a_draft_side_bug_fails_verify_with_the_field_named(full, tmp_path, bug):
    _assert_caught(full, tmp_path, bug)


@pytest.mark.slow
@pytest.mark.parametrize("bug", [b for b in BUGS if b not in FAST])
def test_every_other_draft_side_bug_fails_verify(full, tmp_path, bug):
    _assert_caught(full, tmp_path, bug)
