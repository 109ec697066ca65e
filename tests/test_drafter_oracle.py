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
QUICK = ("--seeds", "0", "--prompts", "2", "--max-new-tokens", "24", "--tree-budgets", "4", "--greedy-only")
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
FAST = ("cache-off-by-one", "stale-features", "wrong-mask-id")


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
    # a bug in a helper every decoder shares (offset-dropped: model/utils.py) also fails the drafter's own
    # decoder (DFlashDraftModel.spec_generate); only drafter checks may fail
    assert {f"drafter: {m}" for m in METHODS} <= failed and all(n.startswith("drafter: ") for n in failed), failed


@pytest.mark.parametrize("bug", FAST)
def test_a_draft_side_bug_fails_verify_with_the_field_named(full, tmp_path, bug):
    _assert_caught(full, tmp_path, bug)


@pytest.mark.slow
@pytest.mark.parametrize("bug", [b for b in BUGS if b not in FAST])
def test_every_other_draft_side_bug_fails_verify(full, tmp_path, bug):
    _assert_caught(full, tmp_path, bug)


# ----------------------------------------------------------------------------- a drafter it cannot bind
def unbindable(tree):
    # the drafter's context parameter under a name the oracle does not know (the decoders follow it)
    edit(tree, "model/dflash.py", ("target_hidden: Optional[torch.Tensor] = None,", "ctx_states: Optional[torch.Tensor] = None,"),
         ("self.fc(target_hidden)", "self.fc(ctx_states)"))
    for rel in (CHAIN, TREE_):
        edit(tree, rel, ("target_hidden=target_hidden,", "ctx_states=target_hidden,"))
    edit(tree, "model/dflash.py", ("target_hidden=context,", "ctx_states=context,"))  # the drafter's own spec_generate


def test_a_drafter_it_cannot_bind_is_a_visible_skip_not_a_pass(full, tmp_path):
    tree = tmp_path / "unbindable"
    shutil.copytree(full, tree, ignore=shutil.ignore_patterns("__pycache__"))
    unbindable(tree)
    proc = ddpatch("verify", tree, *QUICK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for method in METHODS:
        row = next(line for line in proc.stdout.splitlines() if f"drafter: {method} " in line)
        assert " skip " in row and "drafter oracle: skipped (the drafter's forward takes none of target_hidden" in row, row
        assert " pass " not in row, row


def test_the_verdict_names_the_first_round_every_field_and_a_hint():
    from patcher.verify.judge.drafter.verdict import method_check
    from patcher.verify.judge.drafter.verdict import DrafterVerdict

    verdict = DrafterVerdict(rounds=3, failures=[(1, "features", "max |Δ| 4.0e-02"), (1, "output", "max |Δ| 1.1e+00"), (2, "output", "x")])
    text = verdict.describe()
    assert text.startswith("round 1: features differs: max |Δ| 4.0e-02; output differs: max |Δ| 1.1e+00; 1 later rounds differ too")
    assert "hint: target_hidden = extract_context_feature" in text and not verdict.passed
    assert not DrafterVerdict().passed, "no drafter call judged is no evidence"
    runs = [{"prompt": 0, "drafter": verdict.as_dict(), "drafter_description": text}]
    check = method_check("ddtree_tb4", runs)
    assert check["check"] == "drafter: ddtree_tb4" and not check["passed"] and check["failures"][0]["field"] == "features"
    skipped = method_check("dflash", runs, skipped="the drafter declares no target_layer_ids")
    assert skipped["passed"] and skipped["skipped"] and skipped["evidence"].startswith("drafter oracle: skipped (")


# ----------------------------------------------------------------------------- the DFlash layouts, drafters that mask themselves
def _applied(src: Path, out: Path, *extra) -> Path:
    proc = ddpatch("apply", src, "--recipe", "qwen3_6-gdn", "--out", out, *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _drafter_checks(tree: Path) -> tuple[int, dict]:
    proc = ddpatch("verify", tree, "--format", "json", *QUICK)
    assert proc.returncode in (0, 1), proc.stderr
    payload = json.loads(proc.stdout)
    return proc.returncode, {c["check"]: c for c in payload["models"][0]["checks"]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dflash", "dflash-legacy", "dflash-2604", "draft-masks-itself", "native-5x"])
def test_every_dflash_layout_and_a_self_masking_drafter_pass(tmp_path, layout):
    from drift.variants import BY_NAME
    from test_layouts import LAYOUTS

    if layout == "dflash":
        src = ROOT / "vendored" / "dflash"
    elif layout in LAYOUTS:
        src = LAYOUTS[layout](tmp_path)
    else:
        src = BY_NAME[layout].make(tmp_path / layout)
    code, checks = _drafter_checks(_applied(src, tmp_path / "patched"))
    assert code == 0, [c for c in checks.values() if not c["passed"]]
    check = checks["drafter: dflash"]
    assert check["passed"] and not check.get("skipped") and "drafter calls equal" in check["evidence"], check


@pytest.mark.slow
def test_a_planted_bug_in_the_dflash_layout_fails(tmp_path):
    tree = _applied(ROOT / "vendored" / "dflash", tmp_path / "patched")
    path = tree / "dflash" / "model.py"
    text = path.read_text()
    assert text.count("model.target_layer_ids)") == 2
    path.write_text(text.replace("model.target_layer_ids)", "model.target_layer_ids[::-1])"))
    code, checks = _drafter_checks(tree)
    assert code == 1 and checks["lossless: dflash"]["passed"]
    assert not checks["drafter: dflash"]["passed"] and "reverse order" in checks["drafter: dflash"]["evidence"]


@pytest.mark.slow
def test_a_drafter_that_attends_past_its_window_fails(tmp_path):
    """Without the draft-sliding-window step, sdpa ignores the drafter's window (prompt 8 + 12 tokens
    outgrow the presets' window of 16): the target side stays exact, the drafter's output does not."""
    tree = _applied(ROOT / "vendored" / "ddtree", tmp_path / "patched", "--ignore", "draft-sliding-window", "--allow-lossy")
    code, checks = _drafter_checks(tree)
    assert code == 1 and checks["lossless: dflash"]["passed"] and checks["lossless: ddtree_tb4"]["passed"]
    for method in METHODS:
        check = checks[f"drafter: {method}"]
        assert not check["passed"] and check["failures"][0]["field"] == "output", check


def test_features_the_drafters_own_projection_already_gave_are_judged_through_its_output():
    """A fork that projects the target's features first (``model.project_target_hidden(...)``, issue 49) hands the
    drafter rows as wide as its fc's output: not a features difference (the output they feed is compared, and a wrong
    projection fails there: tests/drift's ``project-hidden-call``); rows of any other width still are."""
    import torch

    from patcher.verify.judge.drafter.verdict import _features

    feats, worst = torch.zeros(8, 128), (lambda name, value: value)
    assert _features(None, feats, torch.zeros(8, 64), 0, 8, 1e-4, worst, projected=64) is None
    assert "8 rows given" in _features(None, feats, torch.zeros(8, 64), 0, 8, 1e-4, worst, projected=None)
    assert "rows given" in _features(None, feats, torch.zeros(8, 96), 0, 8, 1e-4, worst, projected=64)
