"""The scripted draft keeps its power on real shapes, and a run that cannot see a rollback bug says so.

The draft is scripted at the logits (``patcher/verify/models/script.py``): at a vocabulary 48 times the hidden size, as in
real models, its margins are exact and DDTree rounds reach the block's depth, so a tree commit that keeps only the
first two nodes of the accepted path fails; a hidden-state script (the pseudo-inverse it replaced) left only a
projection of its logits there, a nearly flat draft whose rounds never accepted more than one token. The block's
first token is read off the drafter's own input, so a tree that embeds with ``F.embedding`` on the table (DFlash's
newest) is scripted as well, and a partial commit off by one fails there too. A method whose rounds never accept part
of a block is *inconclusive*, never a pass (``rows.rollback_check``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.verify.judge.rollback import rollback_check, settle_rollback

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--greedy-only", "--seeds", "0", "--prompts", "2", "--max-new-tokens", "24", "--format", "json"]


def ddpatch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "patcher", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def apply(src: Path, out: Path) -> Path:
    proc = ddpatch("apply", src, "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def plant(tree: Path, old: str, new: str) -> Path:
    """A bug in the patched tree's runtime copies: ``old`` (exactly once in each commit.py) becomes ``new``."""
    copies = sorted(tree.rglob("_ddpatch_runtime/commit.py"))
    assert copies
    for path in copies:
        text = path.read_text()
        assert text.count(old) == 1, old
        path.write_text(text.replace(old, new))
    return tree


def verify(tree: Path, *args) -> tuple[int, dict]:
    proc = ddpatch("verify", tree, *SMALL, *args)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def checks_of(payload: dict) -> dict[str, dict]:
    return {c["check"]: c for m in payload["models"] for c in m["checks"]}


KEEP_TWO = ("_replay(cache, record, torch.tensor(keep, device=record.plan.path_index.device))",
            "_replay(cache, record, torch.tensor(keep[:2], device=record.plan.path_index.device))")
PARTIAL_OFF_BY_ONE = ("                    _replay(cache, record, n)\n", "                    _replay(cache, record, max(1, n - 1))\n")


@pytest.fixture(scope="module")
def ddtree(tmp_path_factory) -> Path:
    return apply(ROOT / "vendored" / "ddtree", tmp_path_factory.mktemp("scripted") / "ddtree")


@pytest.mark.slow
def test_at_a_real_vocabulary_to_hidden_ratio_tree_rounds_reach_the_block_and_a_two_node_commit_fails(ddtree, tmp_path):
    wide = ["--preset", "tiny-qwen3_5-wide", "--tree-budgets", "8", "--entry", "ddtree.py:ddtree_generate"]
    code, good = verify(ddtree, *wide)
    checks = checks_of(good)
    assert code == 0 and checks["lossless: ddtree_tb8"]["passed"], [c for c in checks.values() if not c["passed"]]
    (method,) = good["models"][0]["methods"]
    assert int(max(method["acceptance_histogram"], key=int)) == 4, method["acceptance_histogram"]  # the block's depth
    assert checks["rollback seen: ddtree_tb8"]["passed"] and "at the logits" in checks["rollback seen: ddtree_tb8"]["evidence"]
    bad = plant(Path(shutil.copytree(ddtree, tmp_path / "keep-two")), *KEEP_TWO)
    code, payload = verify(bad, *wide)
    failed = {name for name, c in checks_of(payload).items() if not c["passed"]}
    assert code == 1 and {"lossless: ddtree_tb8", "logits == from-scratch: ddtree_tb8"} <= failed, failed


@pytest.mark.slow
def test_a_tree_that_embeds_with_f_embedding_is_scripted_and_a_partial_commit_off_by_one_fails(tmp_path):
    from drift.variants import VARIANTS

    (variant,) = [v for v in VARIANTS if v.name == "embed-weight"]
    tree = apply(variant.make(tmp_path / "src"), tmp_path / "good")
    code, good = verify(tree, "--preset", "tiny-qwen3_5")
    checks = checks_of(good)
    assert code == 0, [c for c in checks.values() if not c["passed"]]
    assert "4" in good["models"][0]["methods"][0]["acceptance_histogram"] and checks["rollback seen: dflash"]["passed"]
    bad = plant(Path(shutil.copytree(tree, tmp_path / "off-by-one")), *PARTIAL_OFF_BY_ONE)
    code, payload = verify(bad, "--preset", "tiny-qwen3_5")
    failed = {name for name, c in checks_of(payload).items() if not c["passed"]}
    assert code == 1 and "logits == from-scratch: dflash" in failed, failed


def test_a_run_without_partial_acceptances_is_inconclusive_never_a_pass():
    # the acceptance-1.04 run of DFlash's newest tree before the script read tokens at the token level
    nearly_flat = [1] * 114 + [2] * 5
    check = rollback_check("dflash", nearly_flat, block_size=16)
    assert not check["passed"] and check["inconclusive"] and "could not see a rollback bug" in check["evidence"]
    assert "1:114 2:5" in check["evidence"]
    all_or_nothing = [1] * 10 + [4] * 10
    assert not rollback_check("ddtree_tb8", all_or_nothing, block_size=4)["passed"], "no round accepted part of its block"
    too_few = [2] * 10
    assert rollback_check("dflash", too_few, 4)["inconclusive"], "one length: an off-by-one at another cannot show"
    assert rollback_check("dflash", [1, 2, 3, 4, 2, 3], 4)["passed"]
    assert not rollback_check("dflash", [], 4)["passed"]
    assert rollback_check("dflash", [1, 2, 1, 2], 2)["passed"], "block 2: a rejected and an accepted proposal are enough"


def test_a_real_drafters_inconclusive_rollback_passes_only_where_another_model_saw_it():
    """Sampled, the trained pair's rounds mostly accept one token: its row passes when the scripted preset saw the same
    method's rollback in the same run, naming it; a scripted draft's inconclusive row, or an unseen method, stays."""
    def row(name, acceptance, real):
        return {**rollback_check(name, acceptance, 8), "real_drafter": real}

    seen, nearly_flat = [1, 2, 3, 1, 4, 2], [1] * 40 + [2] * 3
    result = {"models": [
        {"model": "tiny-qwen3_5", "checks": [row("dflash", seen, False), row("ddtree_tb4", nearly_flat, False)]},
        {"model": "trained-qwen3_5", "checks": [row("dflash", nearly_flat, True), row("ddtree_tb4", nearly_flat, True)]},
        {"model": "tiny-qwen3_5-vlm", "checks": [row("dflash", nearly_flat, False)]},
    ]}
    settle_rollback(result)
    (tiny_dflash, tiny_tree), (trained_dflash, trained_tree), (vlm_dflash,) = (m["checks"] for m in result["models"])
    assert trained_dflash["passed"] and not trained_dflash["inconclusive"], trained_dflash
    assert trained_dflash["evidence"].startswith("seen on tiny-qwen3_5: ") and "1:40 2:3" in trained_dflash["evidence"]
    assert not vlm_dflash["passed"] and vlm_dflash["inconclusive"], "a scripted draft that failed to make rollback happen"
    assert not trained_tree["passed"], "no model of the run saw ddtree_tb4's rollback"
