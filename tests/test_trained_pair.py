"""The trained tiny pair shipped in patcher/data/trained_pair (tools/train_tiny_pair.py): its folders load
through the --target/--draft path, the preset trained-qwen3_5 is that path unscripted, its drafter really
drafts (acceptance well above a random drafter's ~1.0), and the training script runs."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from patcher import api
from patcher.verify import trained
from patcher.verify.presets import PRESETS

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "patcher" / "data" / "trained_pair"
TARGET, DRAFT = PAIR / "target", PAIR / "draft"
QUICK = dict(seeds=[0], prompts=2, max_new_tokens=32, tree_budgets=[8])


def draft_class():
    sys.path.insert(0, str(ROOT / "vendored" / "dflash"))
    from dflash.model import DFlashDraftModel

    return DFlashDraftModel


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "ddtree-patched"
    proc = subprocess.run([sys.executable, "-m", "patcher.cli", "apply", ROOT / "vendored" / "ddtree", "--out", out],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def dflash(outcome_payload: dict) -> dict:
    model = outcome_payload["models"][0]
    return next(m for m in model["methods"] if m["method"] == "dflash")


# ----------------------------------------------------------------------------- the folders
def test_the_folders_are_checkpoint_shaped_package_data_under_12_mb():
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (TARGET / name).is_file(), name
    for name in ("config.json", "model.safetensors"):
        assert (DRAFT / name).is_file(), name
    weights = sum(p.stat().st_size for p in PAIR.rglob("*.safetensors"))
    assert weights <= 12 * 2**20, weights
    meta = json.loads((PAIR / "metadata.json").read_text())
    assert "standard library" in meta["corpus"] and meta["held_out_prompts"] and meta["draft"]["block_size"] == 8
    assert meta["target"]["steps"] > 0 and meta["draft"]["final_loss"] > 0
    # the wheel carries them: every file of the pair matches a package-data glob of the patcher package
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["patcher"]
    files = [p.relative_to(ROOT / "patcher") for p in PAIR.rglob("*") if p.is_file()]
    assert files and all(any(f.match(g) for g in globs) for f in files), (files, globs)


def test_the_folders_load_through_the_target_draft_path():
    from patcher.verify import models

    config = json.loads((DRAFT / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    cfg = {"target": str(TARGET), "draft": str(DRAFT), "dtype": "float32", "block_size": 8}
    target, draft, mask = models.load_real(cfg, draft_class())
    models.check_fit(target, draft)
    tc = target.config.get_text_config(decoder=True)
    assert type(target).__name__ == "Qwen3_5ForCausalLM" and target._ddpatch_loaded["auto_class"] == "AutoModelForCausalLM"
    assert tc.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
    assert mask == tok.convert_tokens_to_ids("<|mask|>") and len(tok) == tc.vocab_size
    # the drafter has no embeddings or LM head of its own: it reads the target's
    names = [n for n, _ in draft.named_parameters()]
    assert not any("embed" in n or "lm_head" in n for n in names), names
    # its weights are the file's, not a fresh init
    from safetensors.torch import load_file

    saved = load_file(DRAFT / "model.safetensors")
    assert set(saved) == set(draft.state_dict())
    assert all(bool((draft.state_dict()[k] == v.float()).all()) for k, v in saved.items())


def test_the_preset_is_the_folder_path_unscripted():
    preset = PRESETS["trained-qwen3_5"]
    assert preset.folders == (TARGET, DRAFT) and preset.hybrid
    options = trained.folder_preset_options({"presets": ["trained-qwen3_5"], "dtype": None, "block_size": None})
    assert options["target"] == str(TARGET) and options["draft"] == str(DRAFT) and not options["presets"]
    assert options["dtype"] == "float32" and options["block_size"] == 8 and not options["scripted_draft"]
    assert trained.folder_preset_options({"presets": ["trained-qwen3_5"], "block_size": 4})["block_size"] == 4
    untouched = {"presets": ["tiny-qwen3_5"]}
    assert trained.folder_preset_options(untouched) is untouched
    for bad in ({"presets": ["trained-qwen3_5", "tiny-qwen3_5"]}, {"presets": ["trained-qwen3_5"], "target": "/x"}):
        with pytest.raises(ValueError):
            trained.folder_preset_options(bad)


def test_with_another_preset_it_is_a_usage_error(tree):
    with pytest.raises(api.VerifyError, match="alone"):
        api.verify(tree, presets=["trained-qwen3_5", "tiny-qwen3_5"], **QUICK)


# ----------------------------------------------------------------------------- the drafter drafts
def test_a_quick_verify_on_the_trained_preset_passes_with_real_acceptance(tree):
    outcome = api.verify(tree, presets=["trained-qwen3_5"], **QUICK)
    payload = outcome.result
    model = payload["models"][0]
    assert outcome.passed, model["checks"]
    assert payload["loaded"]["dtype"] == "float32"
    # acceptance comes from the drafter (a random-weight drafter, or one that lost the target's features, gives ~1.0)
    assert dflash(payload)["acceptance_mean"] > 1.5, model["methods"]


@pytest.mark.slow
def test_a_random_drafter_of_the_same_shape_does_not_reach_it(tree, tmp_path):
    """The control: the same folders with the drafter's weights freshly drawn still verify lossless,
    but the acceptance bar of the test above fails."""
    import torch

    torch.manual_seed(0)
    cls = draft_class()
    cls(cls.config_class.from_pretrained(DRAFT)).save_pretrained(tmp_path / "draft")
    outcome = api.verify(tree, target=str(TARGET), draft=str(tmp_path / "draft"), dtype="float32", block_size=8, **QUICK)
    assert outcome.passed, outcome.result["models"][0]["checks"]
    assert dflash(outcome.result)["acceptance_mean"] < 1.5


@pytest.mark.slow
def test_the_training_script_smoke_run(tmp_path):
    out = tmp_path / "pair"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "train_tiny_pair.py"), "--steps", "5", "--distill", "16",
                           "--corpus-mb", "0.3", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from patcher.verify import models

    meta = json.loads((out / "metadata.json").read_text())
    assert meta["target"]["steps"] == 5 and meta["draft"]["steps"] == 5 and len(meta["held_out_prompts"]) == 8
    cfg = {"target": str(out / "target"), "draft": str(out / "draft"), "dtype": "float32", "block_size": 8}
    target, draft, _ = models.load_real(cfg, draft_class())
    models.check_fit(target, draft)
