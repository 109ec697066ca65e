"""Is it the drafter or the integration? (issue 43) On a pair no floor was stored for, ``pair_b`` (trained here the
DFlash way with another shape: block 16, another layer pattern; ``tests/data/pair_b``), verify judges acceptance from
a reference it computes in the run. Every tree-construction bug of ``tests/tree_mutants.py`` and the drafter that
loses the prefill's features keep every token exact and fail an ``acceptance`` row; the correct trees pass at
float32 and bfloat16, at two block sizes and two budgets.

Each mutant is a decoder of its own in one tree (``tree_mutants.plant_together``): one verify judges them all, each
on its own (issue 42), with the pair loaded once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pair_support import pair_b
from tree_mutants import CATALOGS, patched_vendored, plant_together

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.heavy
SETTINGS = ["--prompts", "4", "--max-new-tokens", "64", "--tree-budgets", "8,16", "--greedy-only"]


def verify(tree: Path, *args: str) -> tuple[int, dict]:
    target, draft = pair_b()
    proc = subprocess.run([sys.executable, "-m", "patcher", "verify", str(tree), "--target", str(target), "--draft", str(draft),
                           *SETTINGS, "--format", "json", *args], capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


def rows(payload: dict) -> dict[str, dict]:
    return {c["check"]: c for m in payload["models"] for c in m["checks"]}


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    return patched_vendored(tmp_path_factory.mktemp("pair-b") / "patched")


def test_every_planted_bug_fails_its_acceptance_on_a_pair_with_no_stored_floor(patched, tmp_path):
    mutants = CATALOGS["vendored"]
    names = plant_together(patched, mutants, tmp_path / "mutants")
    code, payload = verify(tmp_path / "mutants", "--dtype", "float32")
    checks = rows(payload)
    assert code == 1
    for name, row in checks.items():  # every token stays exact: the bugs only cost (or fake) acceptance
        if name.startswith("lossless: "):
            assert row["passed"], (name, row["evidence"])
    for decoder, mutant in names.items():
        mine = {n: r for n, r in checks.items() if n.startswith("acceptance: ") and decoder in n}
        assert mine, f"{mutant}: no acceptance row for {decoder}"
        failed = [r for r in mine.values() if not r["passed"]]
        assert failed, f"{mutant} passed every acceptance row: {[r['evidence'][:160] for r in mine.values()]}"
        assert "this run's reference" in failed[0]["evidence"]
    # the bugs that raise acceptance fail as a tree not built as the algorithm says, round by round
    for raising in ("budget_plus_one", "child_at_parent_depth"):
        assert any(not r["passed"] and r["verdict"].startswith("the tree is not built as the algorithm says")
                   for n, r in checks.items() if n.startswith("acceptance: ") and raising in n), raising
    for correct in ("acceptance: dflash", "acceptance: ddtree_tb8", "acceptance: ddtree_tb16"):
        assert checks[correct]["passed"] and checks[correct]["verdict"] == "the integration is exact: the drafter is the limit"
        assert not checks[correct].get("info") and checks[correct]["reference"] == "this run's reference"
    per_round = checks["acceptance: ddtree_generate__heap_min_first_tb8"]["per_prompt"][0]
    assert per_round["acceptance"] and per_round["reference_acceptance"] and per_round["off"], "both sequences in the JSON"


@pytest.mark.parametrize("dtype, block", [("float32", None), ("bfloat16", None), ("float32", "8"), ("bfloat16", "8")])
def test_the_correct_trees_pass_at_both_dtypes_and_block_sizes(patched, dtype, block):
    code, payload = verify(patched, "--dtype", dtype, *(["--block-size", block] if block else []))
    failed = [(c["check"], c["evidence"][:300]) for c in payload.get("checks", []) + [c for m in payload["models"] for c in m["checks"]]
              if not c["passed"]]
    assert code == 0 and not failed, failed
    checks = rows(payload)
    for method in ("dflash", "ddtree_tb8", "ddtree_tb16", "DFlashDraftModel.spec_generate"):
        row = checks[f"acceptance: {method}"]
        assert not row.get("info") and row["judged_rounds"] > 0, row
    loaded = payload["loaded"]["settings"]
    assert loaded["block_size"] == (int(block) if block else 16), "a real drafter runs at its config's block size by default"
