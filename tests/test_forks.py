"""Forks as people write them (issue 39): what check, apply and verify say about shapes the recipe reads by data flow,
removed APIs and broken imports, a run narrowed with --exclude, "already done" forms, and trees that are not DDTree/DFlash.

The trees are the drift variants of ``vendored/`` (``tests/drift/variants_forks.py``) and small trees written here.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path, PurePosixPath

import pytest
from cli_support import run

from drift.variants import BY_NAME, VENDORED
from patcher import api
from patcher.engine.pipeline import _matches, exclude_globs
from patcher.verify.subjects import decoders

RECIPE = ["--recipe", "qwen3_6-gdn", "-j", "1"]


pytestmark = pytest.mark.usefixtures("journal_home")  # DDPATCH_HOME in the test's tmp_path (tests/conftest.py)


def variant(name: str, tmp_path: Path) -> Path:
    return BY_NAME[name].make(tmp_path / name)


def errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("ddpatch: error: ")]


# ----------------------------------------------------------------------------- 1. target-only and positional shapes
def test_a_target_only_helper_gets_the_targets_config_and_runs_on_a_hybrid(tmp_path, monkeypatch):
    """The benchmark's warm-up helper builds its own bare cache for the target: patched, it decodes a hybrid target
    greedily (unpatched, it raises in the cache: the warm-up the issue saw fail)."""
    import types

    import torch

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=None))  # the unpatched tree imports it
    from patcher.verify.models.presets import build_target

    src, out = variant("target-only-helper", tmp_path), tmp_path / "out"
    assert run("apply", src, *RECIPE, "--out", out).exit_code == 0
    assert "cache = DynamicCache(config=target.config)" in (out / "dflash.py").read_text()
    target = build_target("tiny-qwen3_5", seed=0)
    prompt = torch.randint(0, 60, (1, 6), generator=torch.Generator().manual_seed(0))  # the preset's vocabulary is 64
    with torch.no_grad():
        expected = prompt
        for _ in range(5):
            expected = torch.cat([expected, target(expected).logits[:, -1:].argmax(-1)], dim=1)
    tops = ("dflash", "model", "ddtree", "_ddpatch_runtime")
    # another test of this worker may have imported a `dflash` (vendored/dflash's): it is set aside, then put back
    saved = {name: sys.modules.pop(name) for name in [m for m in sys.modules if m.split(".")[0] in tops]}
    for tree, ok in ((out, True), (src, False)):
        sys.path.insert(0, str(tree))
        try:
            module = importlib.import_module("dflash")
            if ok:
                assert module.target_generate(target, prompt, 5).tolist() == expected.tolist()
            else:
                with pytest.raises((IndexError, AttributeError, TypeError)):
                    module.target_generate(target, prompt, 5)
        finally:
            sys.path.remove(str(tree))
            for name in [m for m in sys.modules if m.split(".")[0] in tops]:
                del sys.modules[name]
    sys.modules.update(saved)


def test_a_bare_cache_nothing_names_is_listed_with_its_reason(tmp_path):
    """A helper that hands a bare cache to a model no data flow names: left alone, and listed by check (default and -v)."""
    tree = variant("target-only-helper", tmp_path)
    (tree / "profile.py").write_text(
        "from transformers import DynamicCache\n\n\ndef warm_up(model, ids):\n    cache = DynamicCache()\n"
        "    model(ids, past_key_values=cache)\n    model(ids, past_key_values=cache)\n"
    )
    default, verbose = run("check", tree, *RECIPE), run("check", tree, *RECIPE, "-v")
    for result in (default, verbose):
        assert "left alone, 1 site(s) no step could classify" in result.stdout
        assert "profile.py:5: left alone: `DynamicCache()` is given to `model(...)` in `warm_up`" in result.stdout
    payload = json.loads(run("check", tree, *RECIPE, "--format", "json").stdout)
    assert [(n["path"], n["line"]) for n in payload["notes"]] == [("profile.py", 5)]


# ----------------------------------------------------------------------------- 2. removed and broken APIs
def test_the_legacy_cache_api_on_the_target_is_named_before_anything_is_written(tmp_path):
    src = variant("legacy-cache-clone", tmp_path)
    result = run("apply", src, *RECIPE, "--out", tmp_path / "out")
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    line = next(n for n, text in enumerate((src / "dflash/model.py").read_text().splitlines(), 1) if "to_legacy_cache()" in text)
    refusals = [e for e in errors(result) if e.startswith("ddpatch: error: no-match removed-cache-api")]
    [named] = [e for e in refusals if f"dflash/model.py:{line}: `cache.to_legacy_cache()`" in e]  # one line per site
    assert "to_legacy_cache()" in named and "no place for a hybrid target" in named


def test_a_missing_sibling_is_listed_and_one_the_decoders_import_stops_apply(tmp_path):
    src = variant("missing-sibling", tmp_path)
    check = run("check", src, *RECIPE)
    line = next(n for n, text in enumerate((src / "benchmark.py").read_text().splitlines(), 1) if text == "import distributed as dist")
    assert f"benchmark.py:{line}: distributed: no `distributed.py` or `distributed/` in the tree" in check.stdout
    assert not [e for e in errors(check) if "distributed" in e], "a script no decoder imports is listed, not a refusal"
    # the same import in a module the decoders import: verify could not load them, so apply writes nothing
    init = src / "model" / "__init__.py"
    init.write_text(init.read_text() + "from .distributed_utils import rank\n")
    result = run("apply", src, *RECIPE, "--out", tmp_path / "out")
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    at = len(init.read_text().splitlines())
    assert errors(result)[0].startswith(f"ddpatch: error: model/__init__.py:{at}: import .distributed_utils: `.distributed_utils` names no file")
    assert "nothing written" in errors(result)[-1]
    assert run("apply", src, *RECIPE, "--out", tmp_path / "partial", "--allow-partial").exit_code == 1
    assert (tmp_path / "partial" / "dflash.py").read_text() != (src / "dflash.py").read_text()


def test_a_guarded_or_lazy_import_is_not_flagged(tmp_path):
    tree = variant("missing-sibling", tmp_path)
    bench = tree / "benchmark.py"
    bench.write_text(bench.read_text().replace(
        "import distributed as dist\n",
        "try:\n    import distributed as dist\nexcept ImportError:\n    dist = None\n\n\ndef _later():\n    import gone_module\n"))
    payload = json.loads(run("check", tree, *RECIPE, "--format", "json").stdout)
    assert payload["unresolved_imports"] == []


# ----------------------------------------------------------------------------- 3. narrowing a run
def test_exclude_reads_names_anywhere_and_paths_from_the_root():
    def left_out(pattern, path):
        said = _matches(path, exclude_globs(pattern))
        assert decoders.excluded(PurePosixPath(path), pattern) == said, f"verify's decoder search reads {pattern!r} otherwise"
        return said

    assert left_out("analysis", "analysis/target_tok.py") and left_out("analysis/", "a/analysis/x.py")
    assert not left_out("analysis", "analysis_utils.py") and not left_out("analysis", "myanalysis/x.py")
    assert left_out("profile_*.py", "tools/profile_verify.py") and not left_out("profile_*.py", "profile.txt.py")
    assert left_out("scripts/old/", "scripts/old/a.py") and not left_out("scripts/old", "x/scripts/old/a.py")
    assert left_out("./tools/bench.py", "tools/bench.py") and exclude_globs("  ") == []


def test_an_analysis_script_is_refused_with_what_was_found_and_the_exact_exclude(tmp_path):
    src = variant("analysis-folder", tmp_path)
    check = run("check", src, *RECIPE)
    [refusal] = [e for e in errors(check) if "crop-compat" in e]
    assert "`ar_cache_len` is assigned a 4.x length (line 10): `keep`; a 5.x count (line 12): `-rewind`" in refusal
    assert "analysis/target_tok.py is imported by no decoder (dflash/model.py" in refusal
    assert refusal.endswith("leave it out with --exclude analysis/)")
    for args in (["--exclude", "analysis/"], ["--exclude", "analysis"]):
        out = tmp_path / f"out{len(args[1])}"
        applied = run("apply", src, *RECIPE, *args, "--out", out)
        assert applied.exit_code == 0, applied.stderr
        assert f"left out (--exclude {args[1]}): 1 file(s): analysis/target_tok.py" in applied.stdout
        assert (out / "analysis" / "target_tok.py").read_text() == (src / "analysis" / "target_tok.py").read_text()
    payload = json.loads(run("diff", src, *RECIPE, "--exclude", "analysis", "--format", "json").stdout)
    assert payload["exclude"] == ["analysis"] and payload["excluded"] == [{"path": "analysis/target_tok.py", "by": "--exclude analysis"}]


def test_apply_keeps_the_users_exclude_for_verify(tmp_path):
    """apply --exclude: its next: line carries the --exclude, and verify of the tree it wrote reads it from the runtime
    copy's manifest, so the analysis folder's decoders are not verified (issue 42, item 2)."""
    from patcher.verify.process import settings as runner

    src = variant("analysis-folder", tmp_path)
    (src / "analysis" / "probe.py").write_text(
        "from transformers import DynamicCache\n\n\ndef probe_generate(target, input_ids, max_new_tokens):\n"
        "    cache = DynamicCache()\n    for _ in range(max_new_tokens):\n"
        "        input_ids = target(input_ids, past_key_values=cache).logits[:, -1:].argmax(-1)\n    return input_ids\n")
    assert any(d.file.startswith("analysis/") for d in decoders.inventory(src).decoders), "the fixture holds such a decoder"
    out = tmp_path / "out"
    applied = run("apply", src, *RECIPE, "--exclude", "analysis", "--out", out)
    assert applied.exit_code == 0, applied.stderr
    assert f"next: ddpatch verify {out} --exclude analysis" in applied.stdout
    manifests = sorted(out.glob("**/_ddpatch_runtime/MANIFEST.json"))
    assert manifests and all(json.loads(m.read_text())["apply"] == {"exclude": ["analysis"]} for m in manifests)
    assert runner.recorded_exclude(out) == ["analysis"]
    options = runner.narrowed(out, {})
    assert options["exclude"] == ["analysis"] and "apply that wrote this tree" in options["exclude_source"]
    plan = decoders.plan(out, exclude=tuple(options["exclude"]))
    assert not [d for d in plan["decoders"] + plan["left_out"] if d["file"].startswith("analysis/")] and plan["excluded"]
    assert runner.narrowed(out, {"exclude": ["x"]}) == {"exclude": ["x"]}, "the user's own --exclude wins"
    again = json.loads(run("apply", out, *RECIPE, "--exclude", "analysis", "--format", "json").stdout)
    assert again["written"] == [], "the same apply again writes nothing (the manifest too)"
    whole = tmp_path / "whole"
    run("apply", src, *RECIPE, "--out", whole, "--allow-partial")  # no --exclude: nothing recorded, the manifest as before
    assert all("apply" not in json.loads(m.read_text()) for m in whole.glob("**/_ddpatch_runtime/MANIFEST.json"))


def test_exclude_in_the_config_file_and_a_tree_left_empty(tmp_path):
    src = variant("analysis-folder", tmp_path)
    (src / "pyproject.toml").write_text('[tool.ddpatch]\nexclude = ["analysis/"]\n')
    assert run("check", src, *RECIPE).exit_code == 1  # pending changes, no refusal
    assert not [e for e in errors(run("check", src, *RECIPE)) if "no-match" in e]
    assert [e for e in errors(run("check", src, *RECIPE, "--isolated")) if "no-match crop-compat" in e]
    (src / "pyproject.toml").write_text('[tool.ddpatch]\nexclude = [""]\n')
    bad = run("check", src, *RECIPE)
    assert bad.exit_code == 2 and "exclude must be" in bad.stderr
    everything = run("check", src, *RECIPE, "--isolated", "--exclude", "*.py")
    assert everything.exit_code == 2 and "every Python file under" in everything.stderr


# ----------------------------------------------------------------------------- 4. already done is not "no site"
def test_a_form_the_step_does_not_trust_is_named_in_the_no_match(tmp_path):
    tree = tmp_path / "dflash"
    shutil.copytree(VENDORED / "dflash", tree, ignore=shutil.ignore_patterns("__pycache__"))
    model = tree / "dflash" / "model.py"
    model.write_text(model.read_text().replace("target.model.embed_tokens(block)", 'getattr(target.model, "embed_tokens")(block)'))
    [named] = [e for e in errors(run("check", tree, *RECIPE)) if "input-embeddings" in e]
    assert "it reaches the embeddings as `getattr(target.model, 'embed_tokens')` (line" in named


def test_a_verify_held_by_a_class_names_the_class_and_what_to_do(tmp_path):
    tree = tmp_path / "dflash"
    shutil.copytree(VENDORED / "dflash", tree, ignore=shutil.ignore_patterns("__pycache__"))
    model = tree / "dflash" / "model.py"
    text = model.read_text().replace(
        "        out = target(\n            block,\n", "        out = verifier.verify(\n            block,\n"
    ).replace("    target_cache = DynamicCache()\n", "    target_cache = DynamicCache()\n    verifier = _Verifier(target, target_cache)\n")
    text = text.replace("# ---------------------------------------------------------------- decoding\n",
                        "class _Verifier:\n    def __init__(self, model, cache):\n        self.model, self.cache = model, cache\n\n"
                        "    def verify(self, block, **kwargs):\n        return self.model(block, past_key_values=self.cache, **kwargs)\n\n\n"
                        "# ---------------------------------------------------------------- decoding\n")
    model.write_text(text.replace("            past_key_values=target_cache,\n            use_cache=True,\n            output_hidden_states=block_size > 1,\n        )\n        if sampled",
                                  "            use_cache=True,\n            output_hidden_states=block_size > 1,\n        )\n        if sampled"))
    [named] = [e for e in errors(run("check", tree, *RECIPE)) if "no-match verify-forward" in e]
    assert "`self.model(...)` in `_Verifier.verify`" in named and "`_ddpatch_runtime.verify_forward(self.model, ...)`" in named


# ----------------------------------------------------------------------------- 5. say what a tree is
@pytest.mark.parametrize("command", ["check", "diff", "apply", "verify"])
def test_a_tree_with_no_decoder_is_one_line_on_every_command(tmp_path, command):
    tree = variant("not-a-decoder", tmp_path)
    result = run(command, tree, *(RECIPE if command != "verify" else []))
    [line] = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and result.stdout == ""
    assert line == (f"ddpatch: error: no DDTree/DFlash decoder found in {tree.resolve()} (looked for the functions "
                    "_dflash_generate, ddtree_generate, dflash_generate, and a function that hands a drafter `target_hidden` in a "
                    "decode loop or beside a cache)")
    payload = json.loads(run(command, tree, *(RECIPE if command != "verify" else []), "--format", "json").stdout)
    assert payload["exit_code"] == 2 and payload["error"] == line.removeprefix("ddpatch: error: ")


def test_a_serving_engine_is_named_with_a_pointer_to_the_docs(tmp_path):
    tree = tmp_path / "engine"
    (tree / "vllm" / "worker").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "vllm" / "worker" / "timing.py").write_text("import torch\n\n\ndef sync():\n    torch.cuda.synchronize()\n")
    for command in ("check", "apply"):
        result = run(command, tree, *RECIPE)
        [line] = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and "is a vLLM serving engine tree (vllm/)" in line
        assert "docs/usage.md#what-ddpatch-patches" in line and "no-match" not in result.stderr
    # beside a decoder, the engine's package is left out, and said so
    shutil.copytree(VENDORED / "dflash", tree / "fork", ignore=shutil.ignore_patterns("__pycache__"))
    payload = json.loads(run("check", tree, *RECIPE, "--format", "json").stdout)
    assert payload["decoders"] and {e["path"] for e in payload["excluded"]} == {"vllm/__init__.py", "vllm/worker/timing.py"}
    assert not any(s["path"].startswith("vllm/") for step in payload["steps"] for s in step["sites"])


def test_select_runs_what_it_names_on_any_tree(tmp_path):
    tree = variant("not-a-decoder", tmp_path)
    result = run("check", tree, *RECIPE, "--select", "cpu-safe-timing")
    assert result.exit_code == 1 and "cpu-safe-timing" in result.stdout


def test_verify_exclude_reaches_the_decoder_search_from_the_cli_and_the_config(tmp_path, monkeypatch):
    """`verify --exclude` (and `exclude` in [tool.ddpatch]) is the `exclude` option the runner hands `decoders.plan`."""
    asked = []
    monkeypatch.setattr(decoders, "plan", lambda tree, entries=None, exclude=(), skip=None: asked.append(exclude) or {"decoders": []})
    src = tmp_path / "fork"
    for folder in ("new", "old"):
        shutil.copytree(VENDORED / "dflash", src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    result = run("verify", src, "--exclude", "old", "--exclude", "scripts/")
    [line] = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and line.startswith(f"ddpatch: error: no DDTree/DFlash decoder found in {src.resolve()} (looked for")
    assert asked == [("old", "scripts/")]
    (src / "pyproject.toml").write_text('[tool.ddpatch]\nexclude = ["old"]\n')
    assert run("verify", src).exit_code == 2 and asked[-1] == ("old",)


def test_verify_refuses_in_the_parent_before_a_child_starts(tmp_path, monkeypatch):
    started = []
    from patcher.results import Outcome

    monkeypatch.setattr("patcher.verify.process.runner.run_verify", lambda *a, **k: started.append(a) or Outcome({"checks": []}, 0.0))
    tree = variant("not-a-decoder", tmp_path)
    with pytest.raises(api.VerifyError, match="no DDTree/DFlash decoder found in"):
        api.verify(tree)
    src = tmp_path / "dflash"
    shutil.copytree(VENDORED / "dflash", src / "old", ignore=shutil.ignore_patterns("__pycache__"))
    with pytest.raises(api.VerifyError, match="no DDTree/DFlash decoder found in"):
        api.verify(src, exclude=["old"])
    api.verify(src)
    assert len(started) == 1, "the child starts only for a tree with a decoder"
    # a loop no survey calls a DDTree/DFlash decoder is refused as check refuses it, unless --entry names it
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "greedy.py").write_text("def target_generate(target, ids, cache, n):\n    for _ in range(n):\n"
                                     "        ids = target(ids, past_key_values=cache).logits.argmax(-1)\n    return ids\n")
    with pytest.raises(api.VerifyError, match="no DDTree/DFlash decoder found in"):
        api.verify(plain)
    api.verify(plain, entries=["greedy.py:target_generate"])
    assert len(started) == 2
