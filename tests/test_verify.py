"""The verifier: its oracle, its control (a patch that only makes the code run must FAIL on
hybrid presets), the full recipe passing, and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patcher.oracle import compare

ROOT = Path(__file__).resolve().parent.parent
HYBRID = ["tiny-qwen3_5", "tiny-qwen3_5-vlm", "tiny-qwen3_5-moe", "tiny-qwen3-next"]
SHAPE_ONLY = "verify-forward,tree-commit"  # the rollback/tree steps: without them the code runs but is not lossless


# ----------------------------------------------------------------------------- the oracle
tokens = st.lists(st.integers(0, 100), min_size=1, max_size=40)


@given(tokens, st.data())
@settings(max_examples=200, deadline=None)
def test_oracle_finds_a_single_token_difference_anywhere(seq, data):
    i = data.draw(st.integers(0, len(seq) - 1))
    other = data.draw(st.integers(0, 100).filter(lambda t: t != seq[i]))
    changed = seq[:i] + [other] + seq[i + 1 :]
    verdict = compare(seq, changed)
    assert not verdict.identical
    assert (verdict.first_divergence, verdict.expected, verdict.got) == (i, seq[i], other)
    assert f"at new token {i}" in verdict.describe()


@given(tokens, st.integers(1, 5))
@settings(max_examples=100, deadline=None)
def test_oracle_finds_a_length_difference(seq, extra):
    longer = seq + [7] * extra
    assert compare(seq, longer).first_divergence == len(seq) and compare(seq, longer).expected is None
    shorter = seq[:-1]
    verdict = compare(seq, shorter)
    assert not verdict.identical and verdict.first_divergence == len(seq) - 1 and verdict.got is None


@given(tokens)
def test_oracle_accepts_identical(seq):
    assert compare(seq, list(seq)).identical


# ----------------------------------------------------------------------------- end to end
def ddpatch(*args, timeout=900):
    proc = subprocess.run([sys.executable, "-m", "patcher.cli", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    return proc


def patched(tmp_path: Path, upstream: str, ignore: str | None = None) -> Path:
    out = tmp_path / f"{upstream}-patched"
    args = ["apply", ROOT / "vendored" / upstream, "--recipe", "qwen3_6-gdn", "--out", out]
    if ignore:
        args += ["--ignore", ignore]
    proc = ddpatch(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def verify_json(tree: Path, *args: str) -> tuple[int, dict]:
    proc = ddpatch("verify", tree, "--format", "json", "--seeds", "0,1", "--prompts", "1", "--max-new-tokens", "24", *args)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def checks_of(payload: dict) -> dict[tuple[str, str], dict]:
    return {(m["model"], c["check"]): c for m in payload["models"] for c in m["checks"]}


@pytest.fixture(scope="module")
def shape_only(tmp_path_factory) -> Path:
    return patched(tmp_path_factory.mktemp("shape"), "ddtree", ignore=SHAPE_ONLY)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    return patched(tmp_path_factory.mktemp("full"), "ddtree")


def test_control_shape_only_patch_fails_on_hybrid_and_passes_on_full_attention(shape_only):
    code, payload = verify_json(shape_only, "--preset", "tiny-qwen3_5", "--preset", "tiny-qwen3_5-vlm", "--preset", "tiny-qwen3")
    assert code == 1
    assert payload["environment"]["transformers"].startswith("5.")
    checks = checks_of(payload)
    for preset in ("tiny-qwen3_5", "tiny-qwen3_5-vlm"):
        for method in ("dflash", "ddtree_tb4", "ddtree_tb8"):
            check = checks[(preset, f"lossless: {method}")]
            assert not check["passed"], f"{preset}/{method} must expose the missing rollback"
            assert "diverges at new token" in check["evidence"]
        assert checks[(preset, "warms up")]["passed"], "the code-shape steps alone must make it run"
    for method in ("dflash", "ddtree_tb4", "ddtree_tb8"):
        assert checks[("tiny-qwen3", f"lossless: {method}")]["passed"]


def test_full_recipe_is_lossless_on_every_hybrid_preset(full):
    code, payload = verify_json(full, *[a for p in HYBRID + ["tiny-qwen3"] for a in ("--preset", p)])
    failed = [c for c in checks_of(payload).values() if not c["passed"]]
    assert code == 0 and not failed, failed
    for model in payload["models"]:
        assert model["partial_acceptances"] > 0, "rollback paths must be exercised"
        for method in model["methods"]:
            hist = {int(k): v for k, v in method["acceptance_histogram"].items()}
            assert len(hist) > 1, f"{model['model']} {method['method']}: acceptance never varied"


def test_full_recipe_on_dflash_layout(tmp_path):
    tree = patched(tmp_path, "dflash")
    code, payload = verify_json(tree, "--preset", "tiny-qwen3_5-vlm")
    assert code == 0, [c for c in checks_of(payload).values() if not c["passed"]]
    assert [m["method"] for m in payload["models"][0]["methods"]] == ["dflash"]


def test_unpatched_tree_fails_to_load_with_a_hint():
    code, payload = verify_json(ROOT / "vendored" / "ddtree")
    assert code == 1
    load = payload["checks"][0]
    assert load["check"] == "loads" and not load["passed"]
    assert "datasets" in load["error"] and load["hint"] == "lazy-datasets" and load["frame"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["verify", ROOT / "patcher"], "is not a DDTree/DFlash tree"),
        (["verify", ROOT / "vendored" / "ddtree", "--target", "/no/such/model", "--draft", "/no/such/draft"], "does not exist"),
        (["verify", ROOT / "vendored" / "ddtree", "--target", ROOT], "go together"),
    ],
)
def test_bad_input_is_one_clear_line(args, needle):
    proc = ddpatch(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and needle in proc.stderr


def test_timeout_is_reported(full):
    proc = ddpatch("verify", full, "--timeout", "1")
    assert proc.returncode == 2 and "timed out" in proc.stderr


def _save_local_models(tree: Path, dest: Path, draft_hidden: int | None = None) -> tuple[Path, Path]:
    """A tiny target and a draft of the tree's own class, saved as a user's local model folders."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(tree)!r})
from model import DFlashDraftModel
from patcher.presets import build_target, draft_config
target = build_target("tiny-qwen3_5", seed=3)
cfg = draft_config(target, DFlashDraftModel.config_class, num_layers=1, block_size=4)
if {draft_hidden!r}:
    cfg.hidden_size = {draft_hidden!r}
draft = DFlashDraftModel(cfg)
target.save_pretrained({str(dest / 'target')!r})
draft.save_pretrained({str(dest / 'draft')!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    return dest / "target", dest / "draft"


def test_local_model_folders_load_offline_with_device_map(full, tmp_path):
    target, draft = _save_local_models(full, tmp_path)
    proc = ddpatch("verify", full, "--target", target, "--draft", draft, "--device-map", "cpu", "--dtype", "float32",
                   "--prompts", "1", "--max-new-tokens", "12", "--format", "json")
    assert proc.returncode in (0, 1), proc.stderr
    payload = json.loads(proc.stdout)
    model = payload["models"][0]
    assert model["model"] == "target" and not model["plumbing_figures"]
    assert all(c["passed"] for c in model["checks"]), model["checks"]


def test_draft_that_does_not_fit_the_target(full, tmp_path):
    target, draft = _save_local_models(full, tmp_path, draft_hidden=32)
    proc = ddpatch("verify", full, "--target", target, "--draft", draft, "--device-map", "cpu", "--dtype", "float32")
    assert proc.returncode == 2 and "draft does not fit the target" in proc.stderr
