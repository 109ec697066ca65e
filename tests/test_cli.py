"""End-to-end tests of the CLI on the upstream-shaped code in vendored/."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from patcher.cli import main

ROOT = Path(__file__).resolve().parent.parent
VENDORED = ROOT / "vendored"
RECIPE = ["--recipe", "qwen3_6-gdn"]
STEPS = [
    "target-cache-config",
    "input-embeddings",
    "crop-compat",
    "cpu-safe-timing",
    "attn-fallback",
    "lazy-datasets",
    "verify-forward",
    "draft-sliding-window",
    "tree-commit",
]


@pytest.fixture(autouse=True)
def _journal_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))


@pytest.fixture
def ddtree(tmp_path) -> Path:
    dest = tmp_path / "ddtree"
    shutil.copytree(VENDORED / "ddtree", dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.fixture
def dflash(tmp_path) -> Path:
    dest = tmp_path / "dflash"
    shutil.copytree(VENDORED / "dflash", dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def statuses(payload: dict) -> dict[str, str]:
    return {s["id"]: s["status"] for s in payload["steps"]}


def test_recipes_list_and_show():
    out = run("recipes", "list")
    assert out.exit_code == 0 and "qwen3_6-gdn" in out.output
    shown = run("recipes", "show", "qwen3_6-gdn")
    assert shown.exit_code == 0
    for step in STEPS:
        assert step in shown.output
    data = json.loads(run("recipes", "show", "qwen3_6-gdn", "--format", "json").output)
    assert [s["id"] for s in data["steps"]] == STEPS
    assert all(s["examples"] for s in data["steps"])


def test_check_then_apply_out_then_reapply(ddtree, tmp_path):
    before = snapshot(ddtree)
    check = run("check", ddtree, *RECIPE, "--format", "json")
    assert check.exit_code == 1  # changes pending
    assert set(statuses(json.loads(check.output)).values()) == {"applied"}

    out = tmp_path / "patched"
    applied = run("apply", ddtree, *RECIPE, "--out", out, "--format", "json")
    assert applied.exit_code == 0, applied.output
    payload = json.loads(applied.output)
    assert statuses(payload) == {s: "applied" for s in STEPS}
    assert snapshot(ddtree) == before, "--out must leave the original untouched"
    assert (out / "_ddpatch_runtime.py").exists()
    for site in (s for step in payload["steps"] for s in step["sites"]):
        assert site["line"] > 0 and site["column"] > 0 and site["path"]

    again = run("apply", out, *RECIPE, "--format", "json")
    assert again.exit_code == 0
    assert statuses(json.loads(again.output)) == {s: "already-applied" for s in STEPS}
    assert json.loads(again.output)["written"] == []
    assert run("check", out, *RECIPE).exit_code == 0
    empty = run("diff", out, *RECIPE)
    assert empty.exit_code == 0 and empty.output == ""


def test_in_place_apply_is_idempotent_and_revert_restores_bytes(ddtree):
    before = snapshot(ddtree)
    assert run("apply", ddtree, *RECIPE).exit_code == 0
    once = snapshot(ddtree)
    assert once != before
    assert run("apply", ddtree, *RECIPE).exit_code == 0
    assert snapshot(ddtree) == once, "apply twice must equal apply once"
    reverted = run("revert", ddtree)
    assert reverted.exit_code == 0, reverted.output
    assert snapshot(ddtree) == before


def test_revert_refuses_to_clobber_later_edits(ddtree):
    assert run("apply", ddtree, *RECIPE).exit_code == 0
    edited = ddtree / "dflash.py"
    edited.write_text(edited.read_text() + "\n# my own change\n")
    refused = run("revert", ddtree)
    assert refused.exit_code == 2 and "changed since" in refused.stderr
    assert "# my own change" in edited.read_text()
    assert run("revert", ddtree, "--force").exit_code == 0


def test_diff_stat_json_and_plain(ddtree):
    diff = run("diff", ddtree, *RECIPE, "--color", "never")
    assert diff.exit_code == 1
    assert "--- a/dflash.py" in diff.output and "+++ b/dflash.py" in diff.output
    assert "--- /dev/null" in diff.output and "+++ b/_ddpatch_runtime.py" in diff.output
    assert "\x1b[" not in diff.output, "plain output when not a terminal"
    colored = run("diff", ddtree, *RECIPE, "--color", "always")
    assert "\x1b[" in colored.output
    stat = run("diff", ddtree, *RECIPE, "--stat")
    assert stat.exit_code == 1 and "files changed" in stat.output and "dflash.py" in stat.output
    data = json.loads(run("diff", ddtree, *RECIPE, "--format", "json").output)
    assert data["exit_code"] == 1 and data["diff"].startswith("--- a/")


def test_select_and_ignore(ddtree):
    data = json.loads(run("check", ddtree, *RECIPE, "--select", "crop-compat", "--format", "json").output)
    assert list(statuses(data)) == ["crop-compat"]
    data = json.loads(run("check", ddtree, *RECIPE, "--ignore", "verify-forward,tree-commit", "--format", "json").output)
    assert "verify-forward" not in statuses(data) and "tree-commit" not in statuses(data)
    bad = run("check", ddtree, *RECIPE, "--select", "nope")
    assert bad.exit_code == 2 and "unknown step" in bad.stderr


def test_dflash_layout_is_detected_and_tree_steps_do_not_apply(dflash):
    data = json.loads(run("check", dflash, *RECIPE, "--format", "json").output)
    assert data["upstream"] == "dflash"
    assert "tree-commit" not in statuses(data)
    assert statuses(data)["target-cache-config"] == "applied"


def test_no_match_blocks_writes_and_exits_2(ddtree):
    source = (ddtree / "ddtree.py").read_text()
    (ddtree / "ddtree.py").write_text(source.replace("def compact_dynamic_cache(", "def compact_cache_renamed("))
    before = snapshot(ddtree)
    result = run("apply", ddtree, *RECIPE, "--format", "json")
    assert result.exit_code == 2
    payload = json.loads(result.output)
    assert statuses(payload)["tree-commit"] == "no-match"
    anchor = [a for s in payload["steps"] if s["id"] == "tree-commit" for a in s["anchors"]][0]
    assert "compact_dynamic_cache" in anchor["message"]
    assert snapshot(ddtree) == before, "nothing is written when a step is no-match"
    assert run("check", ddtree, *RECIPE).exit_code == 2
    partial = run("apply", ddtree, *RECIPE, "--allow-partial")
    assert partial.exit_code == 2 and snapshot(ddtree) != before


def test_unparseable_file_is_reported_and_skipped(ddtree):
    broken = ddtree / "broken.py"
    source = "from transformers import DynamicCache\ndef oops(target:\n    target(past_key_values=DynamicCache())\n"
    broken.write_text(source)
    result = run("apply", ddtree, *RECIPE, "--format", "json")
    assert result.exit_code == 2
    files = {f["path"]: f for f in json.loads(result.output)["files"]}
    assert "cannot parse" in files["broken.py"]["error"]
    assert broken.read_text() == source
    assert "DynamicCache(config=target.config)" in (ddtree / "dflash.py").read_text()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["check", "/nonexistent/tree", *RECIPE], "path does not exist"),
        (["check", str(VENDORED / "ddtree"), "--recipe", "no-such-recipe"], "unknown recipe"),
        (["verify", "/nonexistent/tree"], "not a directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    proc = subprocess.run([sys.executable, "-m", "patcher.cli", *args], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpatch: error:") and needle in lines[0]


def test_out_must_be_empty_unless_forced(ddtree, tmp_path):
    out = tmp_path / "occupied"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    result = run("apply", ddtree, *RECIPE, "--out", out)
    assert result.exit_code == 2 and "not empty" in result.stderr
    assert run("apply", ddtree, *RECIPE, "--out", out, "--force").exit_code == 0
    assert (out / "keep.txt").read_text() == "x"


def test_every_command_has_help():
    for command in (["--help"], ["apply", "--help"], ["diff", "--help"], ["check", "--help"], ["verify", "--help"],
                    ["revert", "--help"], ["demo", "--help"], ["recipes", "--help"], ["recipes", "show", "--help"]):
        result = run(*command)
        assert result.exit_code == 0 and "Usage:" in result.output
