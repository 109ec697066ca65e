"""The trained tiny pair shipped in patcher/data/trained_pair (tools/train_tiny_pair.py): its folders load
through the --target/--draft path, the preset trained-qwen3_5 is that path unscripted, its drafter really
drafts (acceptance well above a random drafter's ~1.0), and the training script runs.

Its acceptance floor (acceptance_floor.json, ``train_tiny_pair.py --floor``): made by ddpatch's from-scratch
decoders on the shipped weights and prompts, reproducible, equal to what the patched tree reaches, and part
of the verdict: each planted draft-side bug that keeps the target exact fails verify with a ``drafter:`` or
an ``acceptance:`` check named, and the correct tree passes both."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from patcher import api
from patcher.verify.judge.acceptance import floor as acceptance
from patcher.verify.models import trained
from patcher.verify.models.presets import PRESETS
from test_drafter_oracle import BUGS, CHAIN, TREE_, edit

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
    from patcher.verify.models import load as models

    config = json.loads((DRAFT / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    cfg = {"target": str(TARGET), "draft": str(DRAFT), "dtype": "float32", "block_size": 8}
    target, drafts, mask, notes = models.load_real(cfg, {"DFlashDraftModel": draft_class()}, "DFlashDraftModel")
    draft = drafts["DFlashDraftModel"]
    assert not notes
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
    # --scripted-draft with the pair scripts its drafter's proposals (the --target/--draft path); never dropped silently
    assert trained.folder_preset_options({"presets": ["trained-qwen3_5"], "scripted_draft": True})["scripted_draft"] is True
    for untouched in ({"presets": ["tiny-qwen3_5"]}, {"presets": ["trained-qwen3_5", "tiny-qwen3_5"]}):
        assert trained.folder_preset_options(untouched) is untouched  # beside another preset it runs as a pair
    for bad in ({"presets": ["trained-qwen3_5"], "target": "/x"}, {"presets": ["trained-qwen3_5", "tiny-qwen3_5"], "draft": "/x"}):
        with pytest.raises(ValueError):
            trained.folder_preset_options(bad)
    pair = trained.pair_options("trained-qwen3_5", {"prompts": 2, "tree_budgets": None})
    assert pair["target"] == str(TARGET) and pair["prompts"] == 2 and pair["tree_budgets"] == [8, 16] and pair["block_size"] == 8


# ----------------------------------------------------------------------------- the drafter drafts
def test_a_quick_verify_on_the_trained_preset_passes_with_real_acceptance(tree):
    outcome = api.verify(tree, presets=["trained-qwen3_5"], **QUICK)
    payload = outcome.result
    model = payload["models"][0]
    assert outcome.passed, model["checks"]
    assert payload["loaded"]["dtype"] == "float32"
    # acceptance comes from the drafter (a random-weight drafter, or one that lost the target's features, gives ~1.0)
    assert dflash(payload)["acceptance_mean"] > 1.5, model["methods"]
    # and it is judged: against the stored floor, on the floor's prompts, equal to ddpatch's reference decode
    checks = {c["check"]: c for c in model["checks"]}
    for method in ("dflash", "ddtree_tb8"):
        row = checks[f"acceptance: {method}"]
        assert row["passed"] and not row.get("info"), row
        assert row["verdict"] == "the integration is exact: the drafter is the limit" and "drafter oracle: pass" in row["evidence"], row
        assert row["reference"] == "the stored floor", row  # the shipped pair's prompts and settings: the fast path
        assert [r["mean"] for r in row["per_prompt"]] == [r["reference"] for r in row["per_prompt"]], row
    assert dflash(payload)["acceptance_mean"] == checks["acceptance: dflash"]["acceptance_mean"]


# ----------------------------------------------------------------------------- the acceptance floor
FLOOR = PAIR / acceptance.FLOOR_FILE


def test_the_floor_is_measured_on_the_shipped_weights_and_prompts_and_says_how():
    data = json.loads(FLOOR.read_text())
    assert data["command"] == "python tools/train_tiny_pair.py --floor"
    assert data["weights"] == {"target": acceptance.sha256(TARGET / "model.safetensors"), "draft": acceptance.sha256(DRAFT / "model.safetensors")}
    meta = json.loads((PAIR / "metadata.json").read_text())
    st = data["settings"]
    assert st["prompts"] == meta["held_out_prompts"] and len(data["prompts"]) == len(st["prompts"])
    assert st["dtype"] == "float32" and st["block_size"] == 8 and {8, 16, 32} <= set(st["budgets"]) and st["max_new_tokens"] >= 64
    assert data["epsilon"]["logits"] == pytest.approx(data["epsilon"]["output_tolerance"] * data["epsilon"]["lm_head_max_row_l1"])
    for p in data["prompts"]:
        for e in p["methods"].values():
            assert len(e["at"]) == len(e["reachable"]) == st["max_new_tokens"] and all(a in r for a, r in zip(e["at"], e["reachable"]))
    # the held-out prompts are no training data: they come from held-out files (metadata says which share)
    assert "held out" in meta["corpus"]


@pytest.mark.heavy
def test_the_floor_is_reproduced_by_the_reference_decoders_and_equals_the_patched_tree(tree):
    """Recomputed here on the first prompt (16 starts), the stored entries come back; the from-scratch decode, the
    stored per-start walk and the patched tree's own decoders give the same acceptance lengths, round by round."""
    import torch
    from transformers import AutoModelForCausalLM

    from patcher.verify.judge.acceptance import reference_decode as rd
    from patcher.verify.models.load import greedy

    data = json.loads(FLOOR.read_text())
    first, n = data["prompts"][0], 16
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32, local_files_only=True).eval()
    draft = draft_class().from_pretrained(DRAFT, dtype=torch.float32, local_files_only=True).eval()
    cont = greedy(target, torch.tensor([first["ids"]]), n + 7)
    assert cont == first["greedy"][: n + 7]
    pair = rd.ScratchPair(target, draft, draft.mask_token_id, 8)
    methods = ["dflash", "ddtree_tb8", "ddtree_tb32"]
    pos = rd.Positions(pair, first["ids"], cont, methods, n, data["epsilon"]["logits"])
    for m in methods:
        assert pos.reference[m] == first["methods"][m]["at"][:n], m
        assert pos.reachable[m] == first["methods"][m]["reachable"][:n], m
    # the patched tree's own decoders, in a process of their own (its module names dflash / model are generic)
    script = (
        "import json, sys, torch\n"
        f"sys.path.insert(0, {str(tree)!r})\n"
        "from transformers import AutoModelForCausalLM\n"
        "from ddtree import ddtree_generate\nfrom dflash import dflash_generate\nfrom model import DFlashDraftModel\n"
        f"t = AutoModelForCausalLM.from_pretrained({str(TARGET)!r}, dtype=torch.float32).eval()\n"
        f"d = DFlashDraftModel.from_pretrained({str(DRAFT)!r}, dtype=torch.float32).eval()\n"
        f"kw = dict(model=d, target=t, input_ids=torch.tensor([{first['ids']!r}]), mask_token_id=d.mask_token_id, "
        "max_new_tokens=32, block_size=8, stop_token_ids=[], temperature=0.0)\n"
        "print(json.dumps({'dflash': dflash_generate(**kw).acceptance_lengths, "
        "'ddtree_tb8': ddtree_generate(**kw, tree_budget=8).acceptance_lengths, "
        "'ddtree_tb32': ddtree_generate(**kw, tree_budget=32).acceptance_lengths}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    patched = json.loads(proc.stdout.strip().splitlines()[-1])
    for m in methods:
        _, rounds = rd.decode(pair, first["ids"], m, 32)
        assert rounds == patched[m] == rd.walk(first["methods"][m]["at"], 32), m


# ----------------------------------------------------------------------------- planted draft-side bugs
def proposals_shifted(tree: Path) -> None:
    # the proposals read from block positions 0..6 instead of 1..7: every drafter call is exact, its use is not
    edit(tree, CHAIN, ("target.lm_head(draft_hidden[:, 1:, :])", "target.lm_head(draft_hidden[:, :-1, :])"))
    edit(tree, TREE_, ("target.lm_head(draft_hidden[0, 1:, :])", "target.lm_head(draft_hidden[0, :-1, :])"))


def half_budget(tree: Path) -> None:
    # the tree built with half its budget: a correct but smaller tree (DFlash is untouched)
    edit(tree, TREE_, ("build_ddtree_tree(per_position_logits, budget)", "build_ddtree_tree(per_position_logits, max(1, budget // 2))"))


def queries_rotated_at_the_context(tree: Path) -> None:
    # in the drafter's own code: the block's queries get the rotary angles of the first positions
    edit(tree, "model/dflash.py", ("cos[:, -q_len:], sin[:, -q_len:]", "cos[:, :q_len], sin[:, :q_len]"))


def drafter_layers_reversed(tree: Path) -> None:
    # in the drafter's own code, the same with and without a cache: the oracle's reference runs this module too
    edit(tree, "model/dflash.py", ("        for block in self.layers:", "        for block in reversed(self.layers):"))


#: bug -> (the edit, the checks that must fail: kind -> the methods it must fail for)
BOTH = ("dflash", "ddtree_tb8")
TRAINED_BUGS = {
    **{name: (fn, {"drafter": BOTH}) for name, (fn, _) in BUGS.items()},
    "proposals-shifted": (proposals_shifted, {"acceptance": BOTH}),  # the oracle cannot see it: its calls are exact
    "half-budget": (half_budget, {"acceptance": ("ddtree_tb8",)}),
    "queries-rotated": (queries_rotated_at_the_context, {"drafter": BOTH, "acceptance": BOTH}),
    "drafter-layers-reversed": (drafter_layers_reversed, {"acceptance": BOTH}),
}


def _verify_planted(tree: Path, tmp_path: Path, bug: str) -> dict:
    planted = tmp_path / bug
    shutil.copytree(tree, planted, ignore=shutil.ignore_patterns("__pycache__"))
    TRAINED_BUGS[bug][0](planted)
    outcome = api.verify(planted, presets=["trained-qwen3_5"], **QUICK)
    checks = {c["check"]: c for c in outcome.result["models"][0]["checks"]}
    assert not outcome.passed, f"{bug}: verify passed"
    failed = {name for name, c in checks.items() if not c["passed"]}
    for method in BOTH:
        assert checks[f"lossless: {method}"]["passed"] and checks[f"logits == from-scratch: {method}"]["passed"], (bug, method)
    for kind, methods in TRAINED_BUGS[bug][1].items():
        for method in methods:
            assert f"{kind}: {method}" in failed, (bug, kind, method, checks[f"{kind}: {method}"]["evidence"])
            if kind == "acceptance":
                row = checks[f"acceptance: {method}"]
                assert row["verdict"].startswith(("the integration loses acceptance", "the tree is not built as the algorithm says")), row
                assert "first round that differs: prompt" in row["verdict"] or "accepts at most" in row["verdict"], row["verdict"]
    # a proposal bug that collapses acceptance also leaves the run unable to see a rollback (no partial rounds)
    assert all(name.startswith(("drafter: ", "acceptance: ", "rollback seen: ")) for name in failed), failed
    return checks


def test_proposals_from_the_wrong_block_positions_fail_the_acceptance_check_alone(tree, tmp_path):
    checks = _verify_planted(tree, tmp_path, "proposals-shifted")
    assert all(checks[f"drafter: {m}"]["passed"] for m in BOTH)  # the drafter oracle sees nothing wrong


@pytest.mark.heavy
@pytest.mark.parametrize("bug", [b for b in TRAINED_BUGS if b != "proposals-shifted"])
def test_every_planted_draft_side_bug_fails_verify_on_the_trained_pair(tree, tmp_path, bug):
    _verify_planted(tree, tmp_path, bug)


@pytest.mark.heavy
def test_a_random_drafter_of_the_same_shape_does_not_reach_it(tree, tmp_path):
    """The control: the same folders with the drafter's weights freshly drawn still decode losslessly, but the
    acceptance bar of the test above fails; and a drafter whose rounds never accept part of a block cannot show a
    rollback bug, so the verdict is inconclusive, naming --scripted-draft."""
    import torch

    torch.manual_seed(0)
    cls = draft_class()
    cls(cls.config_class.from_pretrained(DRAFT)).save_pretrained(tmp_path / "draft")
    outcome = api.verify(tree, target=str(TARGET), draft=str(tmp_path / "draft"), dtype="float32", block_size=8, **QUICK)
    failed = [c for c in outcome.checks if not c["passed"]]
    assert failed and all(c["check"].startswith(("rollback seen: ", "acceptance: ")) and c["inconclusive"] for c in failed), failed
    assert all("--scripted-draft in place of --draft" in c["evidence"] for c in failed), failed[0]["evidence"]
    assert all(c["passed"] for c in outcome.checks if c["check"].startswith(("lossless: ", "logits == from-scratch: ", "drafter: ")))
    assert dflash(outcome.result)["acceptance_mean"] < 1.5
    # a drafter without a stored floor is judged against this run's reference: a correct DFlash with it accepts 1 token
    # a round too, so no loss could show: inconclusive, never a pass
    row = next(c for c in outcome.result["models"][0]["checks"] if c["check"] == "acceptance: dflash")
    assert not row["passed"] and row["inconclusive"] and "accepts 1 token in every one of the" in row["evidence"], row
    assert "drafter oracle: pass" in row["evidence"]


@pytest.mark.heavy
def test_the_training_script_smoke_run(tmp_path):
    out = tmp_path / "pair"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "train_tiny_pair.py"), "--steps", "5", "--distill", "16",
                           "--corpus-mb", "0.3", "--threads", "1", "--out", str(out),
                           "--floor-new", "24", "--floor-budgets", "4"],  # the floor's own cost is most of the run
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from patcher.verify.models import load as models

    meta = json.loads((out / "metadata.json").read_text())
    assert meta["target"]["steps"] == 5 and meta["draft"]["steps"] == 5 and len(meta["held_out_prompts"]) == 8
    floor = json.loads((out / acceptance.FLOOR_FILE).read_text())
    assert floor["settings"]["max_new_tokens"] == 24 and floor["settings"]["budgets"] == [4]
    assert floor["command"].endswith("--floor-new 24 --floor-budgets 4") and len(floor["prompts"]) == 8
    cfg = {"target": str(out / "target"), "draft": str(out / "draft"), "dtype": "float32", "block_size": 8}
    target, drafts, _, _ = models.load_real(cfg, {"DFlashDraftModel": draft_class()}, "DFlashDraftModel")
    models.check_fit(target, drafts["DFlashDraftModel"])
