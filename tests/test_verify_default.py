"""What the default ``ddpatch verify`` holds a tree to, beyond token identity on one decoder:

* every drafter class the tree defines runs, built from a scaled-down config (DFlash2's selector and convolutions
  included), and the drafter oracle reads what DFlash2 adds: the rows its ``propose`` gets and its anchor ids;
* a decoder that takes a temperature also runs sampled, with the logits oracle on every committed row and a
  distributional test (a rollback bug fails it);
* a drafter input a tree sets differently on purpose is a finding with the exact difference, blamed on no recipe
  step, and ``--reviewed`` records that it was reviewed;
* an unpatched tree's warm-up names its first real failure beside the CUDA-timing one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--seeds", "0", "--prompts", "2", "--max-new-tokens", "24", "--format", "json", "--preset", "tiny-qwen3_5"]


def ddpatch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "patcher", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def apply(src: Path, out: Path, *extra) -> Path:
    proc = ddpatch("apply", src, "--out", out, *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def verify(tree: Path, *args) -> tuple[int, dict]:
    proc = ddpatch("verify", tree, *SMALL, *args)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def checks_of(payload: dict) -> dict[tuple[str, str], dict]:
    return {(m["model"], c["check"]): c for m in payload["models"] for c in m["checks"]}


def edit(tree: Path, rel: str, old: str, new: str) -> Path:
    path = tree / rel
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    return tree


@pytest.mark.heavy
def test_every_drafter_class_runs_and_dflash2s_anchor_is_read(tmp_path):
    from drift.variants import VARIANTS

    (variant,) = [v for v in VARIANTS if v.name == "dflash2"]
    tree = apply(variant.make(tmp_path / "src"), tmp_path / "good")
    code, payload = verify(tree, "--greedy-only")
    checks = checks_of(payload)
    assert code == 0, [k for k, c in checks.items() if not c["passed"]]
    row = checks[("tiny-qwen3_5", "drafter: dflash[DFlash2DraftModel]")]
    assert "selector" in row["evidence"] and row["decoder"] == {"file": "dflash/model.py", "function": "dflash_generate",
                                                                  "kind": "chain", "drafter": "DFlash2DraftModel"}
    assert checks[("tiny-qwen3_5", "lossless: dflash")]["decoder"]["drafter"] == "DFlashDraftModel"
    bad = edit(Path(shutil.copytree(tree, tmp_path / "bad")), "dflash/model.py",
               "model.propose(hidden[:, 1:], block[:, 0], target.lm_head, temperature)",
               "model.propose(hidden[:, 1:], block[:, 1], target.lm_head, temperature)")
    code, payload = verify(bad, "--greedy-only")
    row = checks_of(payload)[("tiny-qwen3_5", "drafter: dflash[DFlash2DraftModel]")]
    assert code == 1 and not row["passed"] and "anchor differs" in row["evidence"], row["evidence"]


@pytest.mark.heavy
def test_a_decoder_that_takes_a_temperature_is_verified_sampled_by_default(tmp_path):
    good = apply(ROOT / "vendored" / "dflash", tmp_path / "good")
    code, payload = verify(good)
    checks = checks_of(payload)
    assert code == 0, [k for k, c in checks.items() if not c["passed"]]
    sampled = "tiny-qwen3_5 (sampled)"
    assert checks[(sampled, "logits == from-scratch: dflash")]["passed"]
    assert checks[(sampled, "sampling distribution: dflash")]["passed"] and checks[(sampled, "rollback seen: dflash")]["passed"]
    shape_only = apply(ROOT / "vendored" / "dflash", tmp_path / "shape", "--ignore", "verify-forward", "--allow-lossy")
    code, payload = verify(shape_only, "--seeds", "0,1")
    checks = checks_of(payload)
    assert code == 1 and not checks[(sampled, "logits == from-scratch: dflash")]["passed"], \
        "the sampled pass sees a rollback bug through the logits of every committed row"


@pytest.mark.heavy
def test_a_deliberate_drafter_input_is_a_finding_blamed_on_no_step_until_reviewed(tmp_path):
    tree = apply(ROOT / "vendored" / "dflash", tmp_path / "seeded")
    # the fork seeds the mask positions with the committed token instead of the mask id (a design of its own)
    edit(tree, "dflash/model.py", "noise_embedding=target.get_input_embeddings()(block),",
         "noise_embedding=target.get_input_embeddings()(block[:, :1].expand(-1, block.shape[1])),")
    code, payload = verify(tree, "--greedy-only")
    checks = checks_of(payload)
    row = checks[("tiny-qwen3_5", "drafter: dflash")]
    assert checks[("tiny-qwen3_5", "lossless: dflash")]["passed"], "the tokens stay exact"
    assert code == 1 and not row["passed"] and "of the target's own table (not the mask id)" in row["evidence"], row["evidence"]
    assert "--reviewed noise" in row["evidence"] and "input-embeddings" not in row["evidence"]
    code, payload = verify(tree, "--greedy-only", "--reviewed", "noise")
    row = checks_of(payload)[("tiny-qwen3_5", "drafter: dflash")]
    assert code == 0 and row["passed"] and "reviewed deliberate difference (noise)" in row["evidence"], row["evidence"]


@pytest.mark.heavy
def test_an_unpatched_tree_names_its_first_real_failure_beside_the_timing_one():
    code, payload = verify(ROOT / "vendored" / "dflash", "--greedy-only")
    row = checks_of(payload)[("tiny-qwen3_5", "warms up")]
    assert code == 1 and not row["passed"] and row["hint"].startswith("cpu-safe-timing"), row
    then = row["then"]
    assert then["shimmed"] == ["cuda"] and "it then fails" in then["text"] and then.get("hint"), then
    assert "cpu-safe-timing" not in then["hint"], "the next failure is the code's own, with its own step"


@pytest.mark.heavy
def test_a_shortened_last_block_is_not_failed_and_a_tree_built_wrong_fails_the_default_verify(tmp_path):
    """DFlash's newest shortens its last block; the acceptance check judges the rounds before it (the old floor, which
    assumed whole last blocks, failed the correct tree: 3.10 < 3.40). A tree built with one node fewer than its budget
    keeps every token exact; the trained pair's acceptance row fails it in the default verify."""
    from drift.variants import VARIANTS

    (variant,) = [v for v in VARIANTS if v.name == "last-block-short"]
    tree = apply(variant.make(tmp_path / "src"), tmp_path / "short")
    proc = ddpatch("verify", tree, "--preset", "trained-qwen3_5", "--greedy-only", "--format", "json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    row = checks_of(json.loads(proc.stdout))[("trained-qwen3_5", "acceptance: dflash")]
    assert row["passed"] and not row.get("info") and "last round(s) left out" in row["evidence"], row["evidence"]

    wrong = edit(apply(ROOT / "vendored" / "ddtree", tmp_path / "budget"), "ddtree.py",
                 "while frontier and len(tokens) < budget:", "while frontier and len(tokens) < budget - 1:")
    proc = ddpatch("verify", wrong, "--greedy-only", "--entry", "ddtree.py:ddtree_generate", "--format", "json")
    checks = checks_of(json.loads(proc.stdout))
    failed = {k for k, c in checks.items() if not c["passed"]}
    assert proc.returncode == 1 and ("trained-qwen3_5", "acceptance: ddtree_tb8") in failed, failed
    assert all(c["passed"] for (m, name), c in checks.items() if name.startswith("lossless")), "the tokens stay exact"
