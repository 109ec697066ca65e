"""Every built-in preset, saved with ``save_pretrained`` into a folder as a user's checkpoint, verified
through ``--target DIR --scripted-draft`` in float32, bfloat16 and (three families, one Mamba2) float16:
the full recipe passes; the code-shape-only control fails on the stateful ones (issue 19).

Slow: one verifier process per folder and dtype. ``tests/test_calibration.py`` holds the fast ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.verify.models.presets import PRESETS, build_target

ROOT = Path(__file__).resolve().parent.parent
SHAPE_ONLY = "verify-forward,tree-commit,draft-sliding-window"
SMALL = ("--prompts", "2", "--max-new-tokens", "24", "--tree-budgets", "4", "--format", "json")
SERVED = [name for name, p in PRESETS.items() if p.refusal is None and not p.folders and not name.startswith("mid-")]
#: float16 on three families: Gated DeltaNet, Mamba2, Kimi Delta Attention.
HALF = ["tiny-qwen3_5", "tiny-nemotron-h", "tiny-kimi-linear"]

pytestmark = pytest.mark.heavy


def ddpatch(*args, env: dict | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "patcher.cli", *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=900, env=env)


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("folders")
    for name, extra in (("full", ()), ("shape", ("--ignore", SHAPE_ONLY, "--allow-lossy"))):
        proc = ddpatch("apply", ROOT / "vendored" / "ddtree", "--recipe", "qwen3_6-gdn", "--out", base / name, *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return base


def folder(trees: Path, name: str) -> Path:
    path = trees / "models" / name
    if not path.exists():
        build_target(name).save_pretrained(path)
    return path


def verify(tree: Path, target: Path, dtype: str, *extra, verdict: bool = False, env: dict | None = None):
    proc = ddpatch("verify", tree, "--target", target, "--scripted-draft", "--dtype", dtype, *SMALL, *extra, env=env)
    assert proc.returncode in (0, 1), proc.stderr
    payload = json.loads(proc.stdout)
    if verdict:
        return proc.returncode, payload["models"][0], payload["verdict"]
    return proc.returncode, payload["models"][0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", SERVED)
def test_every_preset_folder_passes_with_the_full_recipe(trees, name, dtype):
    """float32: pass. bfloat16: pass, or (routed models, whose near-ties a routing flip can hide) "inconclusive in
    this dtype" naming the float32 command, exit 1 -- never FAIL (issue 32)."""
    target = folder(trees, name)
    code, model, verdict = verify(trees / "full", target, dtype, verdict=True)
    failed = [c for c in model["checks"] if not c["passed"]]
    assert model["calibration"]["dtype"] == dtype
    if dtype == "float32" or verdict == "pass":
        assert (code, verdict) == (0, "pass"), failed
        return
    assert (code, verdict) == (1, "inconclusive"), failed
    assert all(c.get("inconclusive") for c in failed), failed
    commands = {c.get("float32_command") for c in failed} - {None}
    assert commands and all(f"--target {target}" in c and "--dtype float32" in c for c in commands), failed


def test_routing_flips_past_what_is_followed_are_inconclusive_naming_float32_not_fail(trees):
    """The same run with no flip allowed to be followed (``DDPATCH_VERIFY_MAX_ROUTING_FLIPS=0``): the reference cannot
    show the decode exact or lossy in bf16, so the verdict is "inconclusive", exit 1, naming the float32 command;
    never FAIL. The float32 run of the same folder passes."""
    target = folder(trees, "tiny-deepseek-v3")
    code, model, verdict = verify(trees / "full", target, "bfloat16", "--seeds", "3", "--prompts", "2", verdict=True,
                                  env={"DDPATCH_VERIFY_MAX_ROUTING_FLIPS": "0"})
    failed = [c for c in model["checks"] if not c["passed"]]
    assert (code, verdict) == (1, "inconclusive") and failed, model["checks"]
    assert all(c.get("inconclusive") and c["float32_command"].endswith("--dtype float32") for c in failed), failed
    assert any(c["check"].startswith("logits == from-scratch") for c in failed), "the flip is where the logits part"


@pytest.mark.parametrize("name", HALF)
def test_bfloat16_code_shape_only_control_fails_on_gdn_mamba2_and_kda(trees, name):
    """The planted lossy control (no recording) still fails in bf16, conclusively and soon after its first partial
    acceptance, on a Gated DeltaNet, a Mamba2 and a Kimi Delta Attention folder (Kimi-Linear is routed too: a routing
    difference after the lossy commit is no tie, the router's input already differs)."""
    target = folder(trees, name)
    code, model, verdict = verify(trees / "shape", target, "bfloat16", verdict=True)
    assert (code, verdict) == (1, "fail") and model["calibration"]["conclusive"], model["checks"]
    flagged = [(m["method"], r) for m in model["methods"] for r in m["runs"] if not r["logits"]["passed"]]
    assert flagged and all(soon_after_first_partial(method, r) for method, r in flagged), flagged


def test_a_routing_flip_on_deepseek_v3_in_bfloat16_is_followed_not_failed(trees):
    """Issue 32: prompts of seed 3 on the saved tiny-deepseek-v3 folder in bf16 sent one token to other experts in the
    decode than from scratch (a tie under rounding), and the full recipe got FAIL (|Δlogit| 3.3e-2 at new token 14
    against 1.6e-2, and the drafter oracle's features 0.21). The reference now follows that flip: PASS, and the
    flip is listed."""
    target = folder(trees, "tiny-deepseek-v3")
    code, model, verdict = verify(trees / "full", target, "bfloat16", "--seeds", "3", "--prompts", "2", verdict=True)
    assert (code, verdict) == (0, "pass"), [c for c in model["checks"] if not c["passed"]]
    followed = [f for m in model["methods"] for r in m["runs"] for f in (r["logits"].get("routing") or {}).get("followed", [])]
    assert followed and all(f["delta"] <= model["calibration"]["router_tolerance"] for f in followed), followed


@pytest.mark.parametrize("name", HALF)
def test_float16_full_recipe_passes_and_the_control_fails(trees, name):
    target = folder(trees, name)
    code, model = verify(trees / "full", target, "float16")
    assert code == 0, [c for c in model["checks"] if not c["passed"]]
    code, model = verify(trees / "shape", target, "float16")
    assert code == 1 and model["calibration"]["conclusive"]
    flagged = [(m["method"], r) for m in model["methods"] for r in m["runs"] if not r["logits"]["passed"]]
    assert flagged and all(soon_after_first_partial(method, r) for method, r in flagged), flagged


def soon_after_first_partial(method: str, run: dict) -> bool:
    """A chain control is flagged within 2 positions of its first partial acceptance. A tree control may be
    flagged earlier: a round whose path was accepted whole still verified rejected sibling branches, and
    without recording they corrupt the recurrent state too; it must never be flagged later than 2 after."""
    first_over, first_partial = run["logits"]["first_over"], run["first_partial"]
    if first_partial is None:
        return False
    if method.startswith("ddtree"):
        return first_over <= first_partial + 2
    return abs(first_over - first_partial) <= 2
