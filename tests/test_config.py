"""Settings from ``[tool.ddpatch]`` in pyproject.toml or a ddpatch.toml (nearest from the target upward; CLI flags
override; ``--config FILE``, ``--isolated``), the default recipe, and "did you mean" for recipe names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import run

from patcher.config import ConfigError, find_config, load_config

TIMING = "import torch\n\n\ndef timed():\n    torch.cuda.synchronize()\n"
CROP = "def f(cache):\n    cache.crop(3)\n"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "timing.py").write_text(TIMING)
    return root


def steps(result) -> list[str]:
    return [s["id"] for s in json.loads(result.stdout)["steps"]]


def test_pyproject_tool_table_is_read_from_the_target_upward(tmp_path):
    root = checkout(tmp_path)
    (root / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.ddpatch]\nselect = ["cpu-safe-timing"]\nformat = "json"\njobs = 1\n')
    result = run("check", root / "pkg")  # no --recipe (the only one), no --select, no --format: all from the file
    assert result.exit_code == 1, result.output
    assert steps(result) == ["cpu-safe-timing"]
    assert find_config(root / "pkg" / "timing.py") == root / "pyproject.toml"


def test_cli_flags_override_the_file_and_isolated_ignores_it(tmp_path):
    root = checkout(tmp_path)
    (root / "ddpatch.toml").write_text('select = "cpu-safe-timing"\nformat = "json"\n')
    assert steps(run("check", root, "--select", "crop-compat,cpu-safe-timing")) == ["crop-compat", "cpu-safe-timing"]
    isolated = run("check", root, "--isolated", "--select", "cpu-safe-timing")
    # the file's format = "json" is not read: the text report, and check's findings exit (a step pending)
    assert isolated.exit_code == 1, isolated.output
    assert not isolated.stdout.lstrip().startswith("{") and "cpu-safe-timing  pending" in isolated.stdout, isolated.stdout
    # nor its select: without --select every step of the recipe is checked, not only the file's one (on a tree
    # with no decoder, once --upstream says which layout to check it as: without it, one "no decoder" line)
    unselected = run("check", root, "--isolated", "--upstream", "ddtree", "--format", "json")
    assert unselected.exit_code == 1, unselected.output
    listed = steps(unselected)
    assert "cpu-safe-timing" in listed and "crop-compat" in listed and len(listed) > 2, listed


def test_ddpatch_toml_wins_over_pyproject_in_the_same_folder_and_a_pyproject_without_the_table_is_passed_over(tmp_path):
    root = checkout(tmp_path)
    (root / "pyproject.toml").write_text('[tool.ddpatch]\nselect = ["crop-compat"]\n')
    (root / "ddpatch.toml").write_text('select = ["cpu-safe-timing"]\n')
    assert load_config(root).values["select"] == "cpu-safe-timing"
    (root / "ddpatch.toml").unlink()
    (root / "pkg" / "pyproject.toml").write_text('[project]\nname = "inner"\n')
    assert load_config(root / "pkg").path == root / "pyproject.toml"


def test_config_file_flag(tmp_path):
    root = checkout(tmp_path)
    other = tmp_path / "elsewhere.toml"
    other.write_text('select = ["cpu-safe-timing"]\nformat = "json"\n')
    assert steps(run("check", root, "--config", other)) == ["cpu-safe-timing"]
    missing = run("check", root, "--config", tmp_path / "none.toml")
    assert missing.exit_code == 2 and "ddpatch: error:" in missing.stderr


@pytest.mark.parametrize("text,needle", [
    ('selct = ["x"]\n', "unknown key 'selct' (did you mean select?)"),
    ("jobs = 0\n", "jobs must be an integer >= 1"),
    ('format = "xml"\n', "format must be"),
    ("select = [\n", "not valid TOML"),
    ("select = []\n", "select must be a list of step ids"),
])
def test_a_bad_config_is_one_line_and_exit_2(tmp_path, text, needle):
    root = checkout(tmp_path)
    (root / "ddpatch.toml").write_text(text)
    result = run("check", root)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpatch: error: config ") and needle in lines[0], lines
    with pytest.raises(ConfigError):
        load_config(root)


def test_recipe_defaults_to_the_only_one_and_names_get_did_you_mean(tmp_path):
    root = checkout(tmp_path)
    assert run("check", root, "--select", "cpu-safe-timing").exit_code == 1
    typo = run("check", root, "--recipe", "qwen3.6-gdn")
    assert typo.exit_code == 2 and "did you mean qwen3_6-gdn?" in typo.stderr
    shown = run("recipes", "show", "qwen3.6-gdn")
    assert shown.exit_code == 2 and "did you mean qwen3_6-gdn?" in shown.stderr


def test_a_recipe_path_in_the_config_is_relative_to_the_file(tmp_path):
    root = checkout(tmp_path)
    (root / "my.toml").write_text(
        'name = "mine"\nversion = 1\n[[steps]]\nid = "timing"\ncodemod = "guard-call"\n'
    )
    (root / "ddpatch.toml").write_text('recipe = "my.toml"\nformat = "json"\n')
    result = run("check", root / "pkg")
    assert json.loads(result.stdout)["recipe"] == "mine"
    (root / "ddpatch.toml").write_text('recipe = "nope.toml"\nformat = "json"\n')
    failed = run("check", root / "pkg")
    assert failed.exit_code == 2 and "unknown recipe" in json.loads(failed.stdout)["error"], "format from the config: JSON on errors too"


def test_ci_reads_the_config_of_the_working_folder(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from patcher import api

    seen = {}
    monkeypatch.setattr(api, "ci", lambda recipe, repo, **k: seen.update(recipe=recipe, **k) or SimpleNamespace(exit_code=0))
    monkeypatch.setattr("patcher.commands.ci.render_ci_as", lambda result, fmt: "")
    (tmp_path / "ddpatch.toml").write_text('upstream = "ddtree"\njobs = 3\n')
    assert run("ci", "--repo", tmp_path).exit_code == 0
    assert seen["recipe"] == "qwen3_6-gdn" and seen["upstream"] == "ddtree" and seen["jobs"] == 3
    assert run("ci", "--repo", tmp_path, "--isolated").exit_code == 0
    assert seen["upstream"] is None


def test_verify_reads_presets_and_format_from_the_config(tmp_path, monkeypatch):
    from patcher import api
    from patcher.results import Outcome

    seen = {}
    monkeypatch.setattr(api, "verify", lambda path, **k: seen.update(k) or Outcome({"checks": [{"check": "c", "passed": True}]}, 0.0))
    root = checkout(tmp_path)
    (root / "ddpatch.toml").write_text('presets = ["tiny-qwen3"]\nformat = "json"\n')
    result = run("verify", root)
    assert result.exit_code == 0 and json.loads(result.stdout)["exit_code"] == 0
    assert seen["presets"] == ["tiny-qwen3"]
    run("verify", root, "--preset", "tiny-qwen3_5")
    assert seen["presets"] == ["tiny-qwen3_5"], "the flag overrides the file"


def test_verify_reads_its_decoders_and_reviewed_differences_from_the_config(tmp_path, monkeypatch):
    from patcher import api
    from patcher.results import Outcome

    seen = {}
    monkeypatch.setattr(api, "verify", lambda path, **k: seen.update(k) or Outcome({"checks": [{"check": "c", "passed": True}]}, 0.0))
    root = checkout(tmp_path)
    (root / "ddpatch.toml").write_text('entry = ["dflash.py:dflash_generate", "eagle3.py:eagle3_generate"]\nreviewed = ["noise"]\n')
    assert run("verify", root).exit_code == 0
    assert seen["entries"] == ["dflash.py:dflash_generate", "eagle3.py:eagle3_generate"] and seen["reviewed"] == ["noise"]
    run("verify", root, "--entry", "ddtree.py:ddtree_generate")
    assert seen["entries"] == ["ddtree.py:ddtree_generate"], "the flag overrides the file"
    (root / "ddpatch.toml").write_text('reviewed = ["cache"]\n')
    result = run("verify", root)
    assert result.exit_code == 2 and "reviewed" in result.output


def test_the_reviewable_drafter_inputs_are_one_list():
    from patcher import config
    from patcher.commands.verify import verify as verify_command
    from patcher.verify.judge.drafter import verdict as drafter_verdict

    choices = next(p.type.choices for p in verify_command.params if p.name == "reviewed")
    assert config.REVIEWABLE == drafter_verdict.REVIEWABLE == tuple(choices)


def test_verify_reads_its_prompts_file_relative_to_the_config_file(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("patcher.verify.process.runner.run_verify", lambda tree, **k: seen.append(k) or __import__("patcher.results").results
                        .Outcome({"checks": [{"check": "c", "passed": True}]}, 0.0))
    import shutil

    conf = tmp_path / "conf"
    tree = conf / "ddtree"
    shutil.copytree(Path(__file__).resolve().parent.parent / "vendored" / "ddtree", tree)
    (conf / "bench").mkdir()
    (conf / "bench" / "p.txt").write_text("from the config\n")
    (tmp_path / "mine.txt").write_text("from the flag\n")
    (conf / "ddpatch.toml").write_text('prompts-file = "bench/p.txt"\n')
    assert run("verify", tree).exit_code == 0  # the working folder is tmp_path, not conf
    assert [r["text"] for r in seen[-1]["prompt_records"]] == ["from the config"]
    assert seen[-1]["prompts_source"]["file"] == str(conf / "bench" / "p.txt")
    assert load_config(tree).get("prompts-file") == str(conf / "bench" / "p.txt")
    assert run("verify", tree, "--prompts-file", "mine.txt").exit_code == 0
    assert [r["text"] for r in seen[-1]["prompt_records"]] == ["from the flag"], "the flag overrides the file"
    (conf / "ddpatch.toml").write_text('prompts-file = "bench/none.txt"\n')
    missing = run("verify", tree)
    assert missing.exit_code == 2 and f"--prompts-file {conf / 'bench' / 'none.txt'}: no such file" in missing.stderr
    assert len(seen) == 2, "bad input: no verifier started"


@pytest.mark.parametrize("text,needle", [
    ('prompts_file = "p.txt"\n', "unknown key 'prompts_file' (did you mean prompts-file?)"),
    ("prompts-file = 3\n", "prompts-file must be a path to a prompts file"),
    ('prompts-file = ""\n', "prompts-file must be a path to a prompts file"),
])
def test_a_bad_prompts_file_key_is_one_line_and_exit_2(tmp_path, text, needle):
    root = checkout(tmp_path)
    (root / "ddpatch.toml").write_text(text)
    result = run("verify", root)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], lines
