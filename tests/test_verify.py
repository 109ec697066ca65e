"""The verifier: its oracle, its control (a patch that only makes the code run must FAIL on
hybrid presets), the full recipe passing, and bad input."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patcher.verify.judge.tokens import compare

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
        args += ["--ignore", ignore, "--allow-lossy"]  # a deliberately lossy tree: a control
    proc = ddpatch(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def verify_json(tree: Path, *args: str) -> tuple[int, dict]:
    proc = ddpatch("verify", tree, "--format", "json", "--greedy-only", "--seeds", "0,1", "--prompts", "1", "--max-new-tokens", "24", *args)
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
            # every method (the chain and each tree budget) kept part of a block at least once:
            # a pass where each round accepted all or nothing would not exercise the rollback
            assert any(1 < k < 4 for k in hist), f"{model['model']} {method['method']}: no partial acceptance ({hist})"


def test_full_recipe_on_dflash_layout(tmp_path):
    tree = patched(tmp_path, "dflash")
    code, payload = verify_json(tree, "--preset", "tiny-qwen3_5-vlm")
    assert code == 0, [c for c in checks_of(payload).values() if not c["passed"]]
    assert [m["method"] for m in payload["models"][0]["methods"]] == ["dflash"]
    assert payload["models"][0]["partial_acceptances"] > 0, "the DFlash layout's rollback was never exercised"


def test_unpatched_tree_fails_to_load_with_a_hint(tmp_path, monkeypatch):
    # as on a machine without `datasets` (the unpatched benchmark imports it at module level), installed here or not
    stub = tmp_path / "no-datasets" / "datasets"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'datasets'\", name='datasets')\n")
    monkeypatch.setenv("PYTHONPATH", str(stub.parent))
    code, payload = verify_json(ROOT / "vendored" / "ddtree")
    assert code == 1
    load = payload["checks"][0]
    assert load["check"] == "loads" and not load["passed"]
    assert "datasets" in load["error"] and load["hint"] == "lazy-datasets" and load["frame"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["verify", ROOT / "docs"], "no DDTree/DFlash decoder found in"),
        (["verify", ROOT / "vendored" / "ddtree", "--target", "/no/such/model", "--draft", "/no/such/draft"], "does not exist"),
        (["verify", ROOT / "vendored" / "ddtree", "--target", ROOT], "or --scripted-draft"),
        (["verify", ROOT / "vendored" / "ddtree", "--draft", ROOT], "--draft needs --target"),
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
from patcher.verify.models.presets import build_target, draft_config
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
    proc = ddpatch("verify", full, "--target", target, "--draft", draft, "--scripted-draft", "--device-map", "cpu",
                   "--dtype", "float32", "--prompts", "2", "--max-new-tokens", "16", "--format", "json")
    assert proc.returncode in (0, 1), proc.stderr
    payload = json.loads(proc.stdout)
    model = payload["models"][0]
    assert model["model"] == "target" and not model["plumbing_figures"]
    assert all(c["passed"] for c in model["checks"]), model["checks"]
    assert _partial_acceptances(model), model["methods"]


def _scripted(tree, target, *extra):
    proc = ddpatch("verify", tree, "--target", target, "--scripted-draft", *extra, "--device-map", "cpu", "--dtype", "float32",
                   "--prompts", "2", "--max-new-tokens", "16", "--format", "json")
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)["models"][0]


def _partial_acceptances(model) -> bool:
    block = 4
    # Every method has rounds where some draft tokens were accepted and some rejected (the
    # rollback had work to do), and accepts well above an unscripted draft's ~1.1 tokens a round.
    methods = [m for m in model["methods"] if m.get("acceptance_histogram")]
    return bool(methods) and all(
        m["acceptance_mean"] > 1.5 and any(1 < int(k) < block for k in m["acceptance_histogram"]) for m in methods
    )


@pytest.mark.slow
def test_scripted_draft_proves_a_local_target_before_any_drafter_exists(full, shape_only, tmp_path):
    """--target DIR --scripted-draft: a draft of the tree's own class is built to fit the target and
    scripted, so partial acceptances happen and the rollback is really exercised: the full recipe
    passes and the code-shape-only patch fails on the user's own (here: saved tiny hybrid) model."""
    target, draft = _save_local_models(full, tmp_path)
    code, model = _scripted(full, target)
    assert code == 0 and all(c["passed"] for c in model["checks"]), model["checks"]
    assert _partial_acceptances(model), model["methods"]
    code, model = _scripted(shape_only, target)
    assert code == 1 and any(c["check"].startswith("lossless") and not c["passed"] for c in model["checks"])
    # --draft DIR --scripted-draft scripts the real drafter's proposals
    code, model = _scripted(full, target, "--draft", draft)
    assert code == 0 and _partial_acceptances(model), model["methods"]


def test_draft_that_does_not_fit_the_target(full, tmp_path):
    target, draft = _save_local_models(full, tmp_path, draft_hidden=32)
    proc = ddpatch("verify", full, "--target", target, "--draft", draft, "--device-map", "cpu", "--dtype", "float32")
    assert proc.returncode == 2 and "draft does not fit the target" in proc.stderr


# ----------------------------------------------------------------------------- failures of the run itself
def _broken_copy(full: Path, dest: Path, edit) -> Path:
    tree = dest / "broken"
    shutil.copytree(full, tree)
    source = tree / "ddtree.py"
    source.write_text(edit(source.read_text()))
    return tree


def _raise_in_ddtree(text: str) -> str:
    head, sep, tail = text.partition("    if block_size <= 1:")
    assert sep, "the DDTree decoder's first statement moved"
    return head + '    raise RuntimeError("boom at warm-up")\n' + sep + tail


QUICK = ("--seeds", "0", "--prompts", "1", "--max-new-tokens", "8", "--tree-budgets", "4", "--greedy-only")


@pytest.mark.parametrize("fmt", ["text"])  # text: where the report crashed; json is covered below
def test_a_method_that_fails_to_warm_up_is_a_failed_check_not_a_crash(full, tmp_path, fmt):
    tree = _broken_copy(full, tmp_path, _raise_in_ddtree)
    proc = ddpatch("verify", tree, "--format", fmt, *QUICK)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "TypeError" not in proc.stdout + proc.stderr
    if fmt == "json":
        warm = checks_of(json.loads(proc.stdout))[("tiny-qwen3_5", "warms up")]
        assert not warm["passed"] and "boom at warm-up" in warm["evidence"] and warm["frame"]
    else:
        assert "warms up" in proc.stdout and "boom at warm-up" in proc.stdout and "FAIL" in proc.stdout


@pytest.mark.parametrize("fmt", ["json"])  # one stderr line whatever the format; JSON on stdout too
def test_a_crash_of_the_verifier_is_an_internal_error_not_a_verdict(full, tmp_path, fmt):
    # the worker process dies mid-run (as on an out-of-memory kill or a segfault in a kernel)
    tree = _broken_copy(full, tmp_path, lambda t: _raise_in_ddtree(t).replace(
        '    raise RuntimeError("boom at warm-up")\n', "    import os; os._exit(9)\n"))
    proc = ddpatch("verify", tree, "--format", fmt, *QUICK)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpatch: error: internal error"), proc.stderr
    if fmt == "json":
        payload = json.loads(proc.stdout)
        assert payload["exit_code"] == 3 and payload["passed"] is False and "internal error" in payload["error"]


# ----------------------------------------------------------------------------- ddpatch is not importable by the tree
def test_a_patched_tree_runs_without_ddpatch(full):
    code, payload = verify_json(full, "--seeds", "0", "--prompts", "2", "--max-new-tokens", "24", "--tree-budgets", "4")
    check = {c["check"]: c for c in payload["checks"]}["runs without ddpatch"]
    assert code == 0 and check["passed"], check
    for path in full.rglob("*.py"):
        assert not re.search(r"^\s*(import|from)\s+patcher\b", path.read_text(), re.M), f"{path} imports ddpatch"


def test_a_tree_that_imports_ddpatch_fails_to_load(full, tmp_path):
    # ddpatch is pip-installed here, yet the verifier must not let the tree find it
    tree = _broken_copy(full, tmp_path, lambda t: "import patcher.runtime\n" + t)
    proc = ddpatch("verify", tree, "--format", "json", *QUICK)
    assert proc.returncode == 1, proc.stderr
    payload = json.loads(proc.stdout)
    load = {c["check"]: c for c in payload["checks"]}["loads"]
    assert not load["passed"] and "patcher" in load["error"] and "_ddpatch_runtime" in load["hint"]


# ----------------------------------------------------------------------------- the demo, end to end
@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    proc = ddpatch("demo", "--out", tmp_path / "demo", "--greedy-only")  # the default models: tiny-qwen3_5 and the trained pair
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "+++ " in out and "_ddpatch_runtime.verify_forward(" in out, "the diff is shown"
    assert f"written to {tmp_path / 'demo'}" in out
    for line in ("lossless: dflash", "lossless: ddtree_tb4", "runs without ddpatch"):
        assert re.search(rf"{re.escape(line)}\s+pass", out), line
    assert out.rstrip().endswith("PASS: every check passed")
    assert (tmp_path / "demo" / "_ddpatch_runtime" / "__init__.py").is_file()
