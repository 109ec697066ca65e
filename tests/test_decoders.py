"""Which decoders a tree holds, found by what they do (``patcher.verify.subjects.decoders``): a function that runs a model
with a cache round after round in a loop, whatever its name; the functions that call such a loop where it cannot be
called itself; a drafter's own decoding method; and ``--entry`` / ``[tool.ddpatch] entry`` to pick by hand.
Static: nothing here imports a tree or torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patcher.verify.subjects import decoders

ROOT = Path(__file__).resolve().parent.parent

LOOP = """
from transformers import DynamicCache


def {name}({params}):
    cache = DynamicCache()
    out = target(input_ids, past_key_values=cache, use_cache=True)
    while True:
        out = target(input_ids, past_key_values=cache, use_cache=True)
        break
    return input_ids
"""


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def found(root: Path, **kw) -> dict[str, dict]:
    plan = decoders.plan(root, **kw)
    return {f"{d['file']}:{d['qualname']}": d for d in plan["decoders"] + plan["left_out"]}


def test_the_vendored_trees_hold_three_and_one_decoders_and_one_drafter_class():
    ddtree = decoders.plan(ROOT / "vendored" / "ddtree")
    assert {(d["file"], d["qualname"], d["label"]) for d in ddtree["decoders"]} == {
        ("ddtree.py", "ddtree_generate", "ddtree"), ("dflash.py", "dflash_generate", "dflash"),
        ("model/dflash.py", "DFlashDraftModel.spec_generate", "DFlashDraftModel.spec_generate")}
    assert [d["name"] for d in ddtree["drafters"]] == ["DFlashDraftModel"], "attention and layer classes are no drafters"
    dflash = decoders.plan(ROOT / "vendored" / "dflash")
    assert [(d["file"], d["qualname"], d["label"]) for d in dflash["decoders"]] == [("dflash/model.py", "dflash_generate", "dflash")]


def test_decoders_are_found_by_what_they_do_not_by_their_name(tmp_path):
    root = write(tmp_path, {
        "eagle3.py": LOOP.format(name="eagle3_generate", params="model, target, input_ids, max_new_tokens")
                     + LOOP.format(name="target_generate", params="target, input_ids, max_new_tokens"),
        "tools/profile.py": LOOP.format(name="profile_verify", params="args"),
        # a drafter's forward runs its layers with a cache in a loop: no decoder
        "draft.py": """
            class Draft:
                def forward(self, target_hidden, noise_embedding, past_key_values=None):
                    for layer in self.layers:
                        x = layer(x, past_key_value=past_key_values)
                    return x
            def run_layers(layers, x, cache):
                for layer in layers:
                    x = layer(x, past_key_values=cache)
                return x
            """,
        "no_loop.py": "def once(target, input_ids, cache):\n    return target(input_ids, past_key_values=cache)\n",
    })
    got = found(root)
    assert set(got) == {"eagle3.py:eagle3_generate", "eagle3.py:target_generate", "tools/profile.py:profile_verify"}, got
    assert got["eagle3.py:eagle3_generate"]["label"] == "eagle3_generate"


def test_a_loop_the_verifier_cannot_call_is_reached_through_its_callers(tmp_path):
    root = write(tmp_path, {"gen.py": """
        def _rounds(state, cache, block):
            while state.start < 10:
                out = state.target(block, past_key_values=cache)

        def dflash_generate(model, target, input_ids, max_new_tokens):
            return _rounds(None, None, input_ids)
        """})
    got = found(root)
    assert list(got) == ["gen.py:dflash_generate"] and got["gen.py:dflash_generate"]["loop"] == "_rounds"
    assert got["gen.py:dflash_generate"]["label"] == "dflash"


def test_copies_of_one_decoder_are_verified_once_and_the_rest_named(tmp_path):
    body = LOOP.format(name="dflash_generate", params="model, target, input_ids, max_new_tokens")
    root = write(tmp_path, {"benchmark.py": body, "alpha/data_collecting.py": body,
                            "alpha/other.py": body.replace("break", "continue")})
    plan = decoders.plan(root)
    chosen = {f"{d['file']}:{d['qualname']}": d["label"] for d in plan["decoders"]}
    assert chosen == {"benchmark.py:dflash_generate": "dflash", "alpha/other.py:dflash_generate": "dflash_generate@alpha/other.py"}
    (left,) = plan["left_out"]
    assert left["file"] == "alpha/data_collecting.py" and "same code as dflash" in left["reason"]


def test_a_renamed_copy_sorted_first_is_verified_through_the_canonical_decoder(tmp_path):
    # the newest layout keeps a chain_generate in dflash/chain.py, the same loop as dflash/model.py's dflash_generate
    root = write(tmp_path, {"dflash/chain.py": LOOP.format(name="chain_generate", params="model, target, input_ids, max_new_tokens"),
                            "dflash/model.py": LOOP.format(name="dflash_generate", params="model, target, input_ids, max_new_tokens")})
    plan = decoders.plan(root)
    assert [(d["file"], d["label"]) for d in plan["decoders"]] == [("dflash/model.py", "dflash")], plan["decoders"]
    (left,) = plan["left_out"]
    assert left["qualname"] == "chain_generate" and "same code as dflash" in left["reason"]


def test_the_files_exclude_left_out_are_named_in_the_coverage_row(tmp_path):
    from patcher.verify.subjects.methods import coverage_check

    root = write(tmp_path, {"dflash.py": LOOP.format(name="dflash_generate", params="model, target, input_ids, max_new_tokens"),
                            "analysis/target_tok.py": LOOP.format(name="probe_generate", params="target, input_ids")})
    plan = decoders.plan(root, exclude=("analysis",))
    assert [d["qualname"] for d in plan["decoders"]] == ["dflash_generate"] and plan["excluded"] == ["analysis/target_tok.py"]
    row = coverage_check([dict(d, verified=True) for d in plan["decoders"]], plan["unparsed"], [], plan["excluded"])
    assert "--exclude left out 1 file(s): analysis/target_tok.py" in row["evidence"] and row["excluded"] == plan["excluded"]
    assert decoders.plan(root)["excluded"] == []


def test_no_count_leaves_a_decoder_out_and_the_patched_files_come_first(tmp_path):
    files = {f"m{i:02d}.py": LOOP.format(name=f"gen{i}", params="target, input_ids, max_new_tokens").replace("break", f"x = {i}")
             for i in range(26)}
    for i in (20, 3):  # two files ddpatch patched: their decoders lead, in scan order
        files[f"m{i:02d}.py"] = "import _ddpatch_runtime\n" + files[f"m{i:02d}.py"]
    plan = decoders.plan(write(tmp_path, files))
    assert len(plan["decoders"]) == 26 and plan["left_out"] == []
    assert [d["qualname"] for d in plan["decoders"][:3]] == ["gen3", "gen20", "gen0"]


def test_the_runner_spreads_decoders_over_cores_one_model_per_child(tmp_path):
    from patcher.verify.process.runner import split

    plan = {"decoders": [{"file": f"m{i}.py", "qualname": f"gen{i}"} for i in range(16)]}
    cfg = {"presets": ["tiny-qwen3_5"], "pairs": [{"label": "trained-qwen3_5"}], "plan": plan}
    assert len(split(cfg, cores=1)) == 1
    two = split(cfg, cores=2)  # a model each, its 16 decoders in 3 waves of chunks (a timeout keeps the waves that ended)
    assert [(c["presets"], c["pairs"]) for c in two[::3]] == [(["tiny-qwen3_5"], None), ([], [{"label": "trained-qwen3_5"}])]
    assert len(two) == 6 and [c["wave"] for c in two] == [0, 1, 2, 0, 1, 2]
    assert all("run_only" not in c for c in split({**cfg, "plan": {"decoders": plan["decoders"][:6]}}, cores=2))
    assert all("run_only" not in c for c in split({**cfg, "plan": {"decoders": plan["decoders"][:7]}}, cores=8)), \
        "fewer than 4 decoders a child: one child per model"
    eight = split(cfg, cores=8)  # a model each, the decoders in 4 chunks per model: each decoder once per model
    assert len(eight) == 8
    for group in (eight[:4], eight[4:]):
        runs = sorted(tuple(k) for c in group for k in c["run_only"])
        assert runs == sorted((d["file"], d["qualname"]) for d in plan["decoders"])
    assert len(split({**cfg, "target": "/models/x"}, cores=8)) == 1  # a real target: one child, one copy of its weights


def test_merged_children_keep_each_model_once_and_a_chunks_failure(tmp_path):
    from patcher.verify.process.runner import merged

    tree = [{"check": "loads", "passed": True, "evidence": "x"}]
    a = {"checks": tree, "models": [{"model": "m", "checks": [{"check": "noise floor", "passed": True},
                                                              {"check": "warms up", "passed": True},
                                                              {"check": "lossless: a", "passed": True, "decoder": {"function": "a"}}],
                                     "methods": [{"method": "a"}], "partial_acceptances": 2}]}
    b = {"checks": tree, "models": [{"model": "m", "checks": [{"check": "noise floor", "passed": True},
                                                              {"check": "warms up", "passed": False},
                                                              {"check": "lossless: b", "passed": False, "decoder": {"function": "b"}}],
                                     "methods": [{"method": "a"}, {"method": "b"}], "partial_acceptances": 1}]}
    out = merged([a, b])
    assert out["checks"] == tree and len(out["models"]) == 1
    m = out["models"][0]
    assert [(c["check"], c["passed"]) for c in m["checks"]] == [("noise floor", True), ("warms up", False), ("lossless: a", True),
                                                                ("lossless: b", False)]
    assert [x["method"] for x in m["methods"]] == ["a", "b"] and m["partial_acceptances"] == 3


def test_entry_picks_decoders_and_names_a_bad_one(tmp_path):
    root = write(tmp_path, {"a.py": LOOP.format(name="one", params="target, input_ids, max_new_tokens"),
                            "b.py": LOOP.format(name="two", params="target, input_ids, max_new_tokens")
                            + "\ndef helper(target, input_ids):\n    return 1\n"})
    plan = decoders.plan(root, entries=["b.py:two", "b.py:helper"])
    assert [d["qualname"] for d in plan["decoders"]] == ["two", "helper"]
    assert [(d["qualname"], d["reason"]) for d in plan["left_out"]] == [("one", "not picked (--entry)")]
    for bad, says in (("b.py", "expected FILE:FUNCTION"), ("c.py:two", "no file c.py"), ("b.py:three", "defines no function three")):
        with pytest.raises(ValueError, match=says):
            decoders.plan(root, entries=[bad])


def test_verify_entry_is_a_usage_error_in_one_line_and_a_tree_without_decoders_exits_2(tmp_path):
    root = write(tmp_path, {"a.py": "def f():\n    return 1\n"})
    proc = subprocess.run([sys.executable, "-m", "patcher", "verify", str(root), "--format", "json"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("ddpatch: error:") == 1, proc.stderr
    assert "no DDTree/DFlash decoder found in" in proc.stderr and json.loads(proc.stdout)["passed"] is False
    proc = subprocess.run([sys.executable, "-m", "patcher", "verify", str(ROOT / "vendored" / "dflash"), "--entry", "dflash/model.py:nope"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "defines no function nope" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_decoders_left_out_of_a_patched_file_are_a_finding(tmp_path):
    from patcher.verify.subjects.methods import coverage_check

    left = {"file": "b.py", "qualname": "caddtree_generate", "label": "caddtree_generate", "verified": False,
            "reason": "cannot call it", "patched": True}
    ok = {"file": "a.py", "qualname": "dflash_generate", "label": "dflash", "verified": True, "patched": True}
    check = coverage_check([ok, left], [], [])
    assert not check["passed"] and "b.py:caddtree_generate" in check["evidence"] and "2 found, 1 verified" in check["evidence"]
    assert coverage_check([ok, {**left, "patched": False}], [], [])["passed"], "an unpatched file's decoder is named, not failed"


def test_a_decoder_is_never_run_with_a_drafter_class_that_lacks_what_it_calls():
    from patcher.verify.subjects.methods import unfit_classes

    class DFlashDraftModel:
        def forward(self, target_hidden, noise_embedding):
            return target_hidden

    class DFlash2DraftModel(DFlashDraftModel):
        def propose(self, hidden):
            return hidden

    def dflash2_generate(model, target, input_ids, max_new_tokens):
        return model.propose(model.forward(input_ids, input_ids))

    def dflash_generate(model, target, input_ids, max_new_tokens):
        return model.forward(input_ids, input_ids)

    def newest_generate(model, target, input_ids, max_new_tokens):  # DFlash's newest: it branches on the class
        if isinstance(model, DFlash2DraftModel):
            return model.propose(input_ids)
        return model.forward(input_ids, input_ids)

    classes = {"DFlashDraftModel": DFlashDraftModel, "DFlash2DraftModel": DFlash2DraftModel}
    assert unfit_classes(dflash2_generate, classes) == {
        "DFlashDraftModel": "it calls model.propose(), which only DFlash2DraftModel defines"}
    assert unfit_classes(dflash_generate, classes) == {} and unfit_classes(newest_generate, classes) == {}


def test_a_drafter_class_the_verifier_cannot_build_fails_naming_what_it_lacks():
    from patcher.verify.judge.drafter.verdict import class_row as drafter_class_row

    row = drafter_class_row("DFlash2DraftModel", "AttributeError: 'Qwen3Config' object has no attribute 'sample_from_anchor'", True)
    assert not row["passed"] and "its code reads config.sample_from_anchor" in row["evidence"], row
    assert "--draft DIR" in row["evidence"]
    chosen = drafter_class_row("DFlash2DraftModel", "the --draft folder is a DFlashDraftModel", False)
    assert chosen["passed"] and chosen["info"]
