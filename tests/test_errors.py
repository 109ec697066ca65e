"""Every failure is one ``ddpatch: error:`` line on stderr, with the cause first, and a JSON object with --format json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import run

ROOT = Path(__file__).resolve().parent.parent
VENDORED = ROOT / "vendored"
RECIPE = ["--recipe", "qwen3_6-gdn", "-j", "1"]
TIMING = "import torch\n\n\ndef timed():\n    torch.cuda.synchronize()\n"


pytestmark = pytest.mark.usefixtures("journal_home")  # DDPATCH_HOME in the test's tmp_path (tests/conftest.py)


@pytest.fixture
def ddtree(tmp_path) -> Path:
    dest = tmp_path / "ddtree"
    shutil.copytree(VENDORED / "ddtree", dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def one_error_line(result, needle: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ddpatch: error: ") and needle in lines[0], lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- usage errors
@pytest.mark.parametrize(
    "args,needle",
    [
        (["apply"], "Missing argument 'PATH'"),
        (["apply", "x", "--bogus"], "No such option"),
        (["frobnicate"], "No such command"),
        (["check", "x", "--recipe", "qwen3_6-gdn", "--jobs", "many"], "'many' is not a valid integer"),
        (["verify", "x", "--timeout", "0"], "--timeout"),
        (["verify", "x", "--timeout", "-5"], "--timeout"),
        (["verify", "x", "--tree-budgets", "4,0"], "--tree-budgets"),
        (["verify", "x", "--tree-budgets", "4,x"], "--tree-budgets"),
        (["verify", "x", "--tree-budgets", ","], "--tree-budgets"),
        (["verify", "x", "--block-size", "1"], "--block-size"),
        (["verify", "x", "--prompts", "0"], "--prompts"),
        (["demo", "--block-size", "0"], "--block-size"),
        (["demo", "--timeout", "-1"], "--timeout"),
        (["ci", "--recipe", "qwen3_6-gdn", "--repo", ".", "--verify", "--tree-budgets", "0"], "--tree-budgets"),
        # a random preset's draft is always scripted: the flag would change nothing, so it is refused
        (["verify", str(VENDORED / "ddtree"), "--scripted-draft"], "--scripted-draft needs --target"),
        (["verify", str(VENDORED / "ddtree"), "--preset", "tiny-qwen3_5", "--scripted-draft"], "always scripted already"),
    ],
)
def test_usage_errors_are_one_ddpatch_error_line_and_exit_2(args, needle):
    result = run(*args)
    assert result.exit_code == 2
    one_error_line(result, needle)
    assert "Error:" not in result.stderr.replace("ddpatch: error:", "")


def test_usage_error_from_a_real_process_says_ddpatch_error():
    proc = subprocess.run([sys.executable, "-m", "patcher", "apply", "--bogus"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("ddpatch: error: ") and len(proc.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- a JSON object on every path
@pytest.mark.parametrize(
    "args,command,needle",
    [
        (["check", "/nonexistent/tree", "--recipe", "qwen3_6-gdn", "--format", "json"], "check", "path does not exist"),
        (["apply", "--format", "json"], "apply", "Missing argument"),
        (["diff", ".", "--recipe", "nope", "--format=json"], "diff", "unknown recipe"),
        (["verify", "/nonexistent/tree", "--format", "json"], "verify", "not a directory"),
        (["verify", ".", "--timeout", "0", "--format", "json"], "verify", "--timeout"),
        (["ci", "--recipe", "qwen3.6-gdn", "--repo", ".", "--format", "json"], "ci", "did you mean qwen3_6-gdn?"),
    ],
)
def test_json_errors_print_one_object(args, command, needle):
    result = run(*args)
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["command"] == command and needle in payload["error"] and payload["exit_code"] == 2
    one_error_line(result, needle)


def test_revert_with_nothing_recorded_says_where_journals_are_kept(tmp_path):
    tree = tmp_path / "moved"
    tree.mkdir()
    result = run("revert", tree, "--format", "json")
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["command"] == "revert" and payload["exit_code"] == 2
    home = str(tmp_path / "home" / "journals")
    assert home in payload["error"] and "moved or renamed" in payload["error"]
    one_error_line(result, home)


def test_revert_after_the_tree_moved_says_where_journals_are_kept(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "timing.py").write_text(TIMING)
    assert run("apply", tree, *RECIPE, "--select", "cpu-safe-timing").exit_code == 0
    moved = tmp_path / "elsewhere"
    tree.rename(moved)
    result = run("revert", moved)
    assert result.exit_code == 2
    one_error_line(result, str(tmp_path / "home" / "journals"))
    moved.rename(tree)
    assert run("revert", tree).exit_code == 0 and (tree / "timing.py").read_text() == TIMING


def test_verify_timeout_prints_json_and_one_line(ddtree, tmp_path):
    patched = tmp_path / "patched"
    assert run("apply", ddtree, *RECIPE, "--out", patched).exit_code == 0
    result = run("verify", patched, "--timeout", "0.05", "--format", "json")
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["command"] == "verify" and payload["passed"] is False and "error" in payload and payload["exit_code"] == 2
    one_error_line(result, "")


# ----------------------------------------------------------------------------- the cause first
def test_a_tree_without_recipe_code_says_so_in_one_line(tmp_path):
    tree = tmp_path / "other"
    tree.mkdir()
    (tree / "app.py").write_text("def main():\n    return 1\n")
    for command in ("check", "diff", "apply"):
        result = run(command, tree, *RECIPE)
        assert result.exit_code == 2 and result.stdout == ""
        one_error_line(result, f"no DDTree/DFlash decoder found in {tree.resolve()} (looked for ")
    payload = json.loads(run("check", tree, *RECIPE, "--format", "json").stdout)
    assert payload["error"].startswith("no DDTree/DFlash decoder found in")


def test_check_labels_sites_pending_and_apply_labels_them_applied(ddtree):
    check = run("check", ddtree, *RECIPE)
    assert check.exit_code == 1
    table = check.stdout.split("\n", 1)[1]
    assert "pending" in table and " applied" not in table, "an unpatched tree must not read as done"
    data = json.loads(run("check", ddtree, *RECIPE, "--format", "json").stdout)
    every = [s["status"] for s in data["steps"]] + [a["status"] for s in data["steps"] for a in s["anchors"]]
    every += [site["status"] for s in data["steps"] for site in s["sites"]]
    assert "pending" in every and "applied" not in every
    applied = json.loads(run("apply", ddtree, *RECIPE, "--format", "json").stdout)
    assert {s["status"] for s in applied["steps"]} == {"applied"}


def test_a_blocked_apply_reports_its_sites_pending(ddtree):
    source = (ddtree / "ddtree.py").read_text()
    (ddtree / "ddtree.py").write_text(source.replace("def compact_dynamic_cache(", "def compact_cache_renamed("))
    result = run("apply", ddtree, *RECIPE, "--format", "json")
    assert result.exit_code == 1  # a no-match step is a finding
    statuses = {s["id"]: s["status"] for s in json.loads(result.stdout)["steps"]}
    assert statuses["tree-commit"] == "no-match" and "applied" not in statuses.values() and "pending" in statuses.values()
    lines = result.stderr.strip().splitlines()
    assert all(line.startswith("ddpatch: error: ") for line in lines)
    assert any("no-match tree-commit" in line for line in lines) and "--allow-partial" in lines[-1]


def test_read_only_file_blocks_the_apply_and_its_sites_say_skipped(ddtree):
    target = ddtree / "model" / "dflash.py"
    target.chmod(0o444)
    before = {p: p.read_bytes() for p in ddtree.rglob("*.py")}
    result = run("apply", ddtree, *RECIPE, "--format", "json")
    assert result.exit_code == 1  # a skipped file is a finding
    assert {p: p.read_bytes() for p in ddtree.rglob("*.py")} == before and not list(ddtree.rglob("_ddpatch_runtime*"))
    payload = json.loads(result.stdout)
    sites = [site for s in payload["steps"] for site in s["sites"] if site["path"] == "model/dflash.py"]
    assert sites and {site["status"] for site in sites} == {"skipped"}
    assert all("read-only" in site["message"] for site in sites)
    assert "applied" not in {s["status"] for s in payload["steps"]}
    assert payload["written"] == []
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "ddpatch: error: skipped model/dflash.py: read-only file; not patched (make it writable to patch it)"
    text = run("apply", ddtree, *RECIPE)
    assert "model/dflash.py" in text.stdout and "skipped" in text.stdout


# ----------------------------------------------------------------------------- smaller promises
def test_demo_does_not_suggest_an_option_it_lacks(tmp_path):
    out = tmp_path / "occupied"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    result = run("demo", "--out", out, "--no-verify")
    assert result.exit_code == 2
    line = one_error_line(result, "not empty")
    assert "--force" not in line and "--out" in line


@pytest.mark.parametrize("command", ["apply", "revert", "check", "diff", "verify", "ci"])
def test_help_states_the_exit_codes(command):
    text = " ".join(run(command, "--help").output.split())
    assert "Exit 0" in text or "exit status" in text.lower() or "Exit codes" in text
    assert "2" in text


def test_revert_force_restores_the_original_contents(ddtree):
    original = {p.relative_to(ddtree): p.read_bytes() for p in ddtree.rglob("*") if p.is_file()}
    assert run("apply", ddtree, *RECIPE).exit_code == 0
    edited = ddtree / "dflash.py"
    edited.write_text(edited.read_text() + "\n# my own change\n")
    (ddtree / "_ddpatch_runtime" / "verify.py").write_text("# edited helper\n")
    refused = run("revert", ddtree)
    assert refused.exit_code == 2 and "# my own change" in edited.read_text()
    forced = run("revert", ddtree, "--force", "--format", "json")
    assert forced.exit_code == 0
    payload = json.loads(forced.stdout)
    assert "dflash.py" in payload["restored"]
    assert {o["path"]: o["backup"] for o in payload["overwritten"]} == {"dflash.py": "dflash.py.orig",
                                                                        "_ddpatch_runtime/verify.py": "_ddpatch_runtime/verify.py.orig"}
    assert (ddtree / "dflash.py.orig").read_text().endswith("# my own change\n"), "the later edit is kept as a .orig"
    now = {p.relative_to(ddtree): p.read_bytes() for p in ddtree.rglob("*") if p.is_file() and not p.name.endswith(".orig")}
    assert now == original, "--force puts back the original bytes, and removes the files apply created"


def test_a_stale_runtime_copy_is_refreshed(ddtree):
    from patcher.engine.files import runtime_sources

    assert run("apply", ddtree, *RECIPE).exit_code == 0
    helper = ddtree / "_ddpatch_runtime" / "commit.py"
    current = helper.read_text()
    assert current == runtime_sources()["commit.py"]
    stale = current.replace("def crop_cache(", "def crop_cache_old(")
    helper.write_text(stale)
    patched = {p: p.read_bytes() for p in ddtree.rglob("*.py") if "_ddpatch_runtime" not in p.parts}
    check = run("check", ddtree, *RECIPE, "--format", "json")
    assert check.exit_code == 1
    assert [f["path"] for f in json.loads(check.stdout)["files"] if f["changed"]] == ["_ddpatch_runtime/commit.py"]
    again = run("apply", ddtree, *RECIPE, "--format", "json")
    assert again.exit_code == 0 and json.loads(again.stdout)["written"] == ["_ddpatch_runtime/commit.py"]
    assert helper.read_text() == current
    assert {p: p.read_bytes() for p in ddtree.rglob("*.py") if "_ddpatch_runtime" not in p.parts} == patched
    assert run("check", ddtree, *RECIPE).exit_code == 0


def test_bare_ddpatch_shows_the_help_not_an_error():
    result = run()
    assert "Usage: " in result.output and "ddpatch: error" not in result.output


# ----------------------------------------------------------------------------- issue 24, "What we met", item 9: bad input
def test_a_fifo_named_like_python_is_skipped_with_a_reason_not_read(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "timing.py").write_text(TIMING)
    os.mkfifo(tree / "x.py")
    proc = subprocess.run([sys.executable, "-m", "patcher", "check", str(tree), *RECIPE, "--select", "cpu-safe-timing"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)  # a FIFO read would hang: the timeout fails it
    assert proc.returncode == 1
    assert "ddpatch: error: skipped x.py: not a regular file (a FIFO); not read" in proc.stderr


@pytest.mark.parametrize("make,needle", [
    (lambda p: (p / "notes.txt").write_text("x"), "not a Python file"),
    (lambda p: (p / "empty").mkdir(), "empty directory"),
])
def test_a_non_python_file_and_an_empty_folder_say_so(tmp_path, make, needle):
    make(tmp_path)
    target = tmp_path / ("notes.txt" if needle.startswith("not") else "empty")
    result = run("check", target, *RECIPE)
    assert result.exit_code == 2
    one_error_line(result, needle)


def test_a_single_file_hints_at_the_checkout_root(ddtree):
    result = run("check", ddtree / "ddtree.py", *RECIPE)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines  # not one "not defined anywhere" per step
    assert lines[0].startswith("ddpatch: error: ddtree.py is a single file: ") and "pass the checkout's root folder" in lines[0]
    assert "dflash_generate" in lines[0]


def test_a_read_only_tree_gives_one_reason_suggests_out_and_says_checked(ddtree):
    files = sorted(ddtree.rglob("*.py"))
    for path in files:
        path.chmod(0o444)
    result = run("apply", ddtree, *RECIPE)
    assert result.exit_code == 1
    errors = result.stderr.strip().splitlines()
    reasons = [line for line in errors if "read-only file" in line]
    assert len(reasons) == 1 and "skipped 5 files" in reasons[0], errors
    assert any("pass --out DIR" in line for line in errors)
    assert "not checked:" not in result.output and "checked, not written" in result.output, "the files were read and checked"


def test_a_second_revert_says_already_reverted(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "timing.py").write_text(TIMING)
    assert run("apply", tree, *RECIPE, "--select", "cpu-safe-timing").exit_code == 0
    assert run("revert", tree).exit_code == 0
    again = run("revert", tree)
    assert again.exit_code == 0 and again.output.startswith("already reverted") and "moved" not in again.output
    assert json.loads(run("revert", tree, "--format", "json").stdout)["already_reverted"] is True


@pytest.mark.parametrize("entry", ["../outside.py", "/etc/evil.py", "link/evil.py"])
def test_revert_refuses_a_journal_entry_that_leaves_the_tree(tmp_path, entry):
    from patcher.engine import journal

    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "timing.py").write_text(TIMING)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tree / "link").symlink_to(outside)
    path = journal.record(tree, {"timing.py": TIMING}, "qwen3_6-gdn v1")
    payload = json.loads(path.read_text())
    payload["files"][0]["path"] = entry
    path.write_text(json.dumps(payload))
    result = run("revert", tree)
    assert result.exit_code == 2
    one_error_line(result, "refusing to revert")
    assert not (tmp_path / "outside.py").exists() and not list(outside.iterdir())


@pytest.mark.parametrize("args,needle", [
    (["check", ".", "-j", "0"], "0 is not in the range x>=1"),
    (["check", ".", "-j", "-3"], "-3 is not in the range x>=1"),
    (["check", ".", "--select", ""], "--select: no step id given"),
    (["ci", "--repo", ".", "--preset", "foo"], "--preset only apply with --verify"),
    (["ci", "--repo", ".", "-j", "0"], "0 is not in the range x>=1"),
])
def test_values_that_were_accepted_silently_are_rejected(args, needle):
    result = run(*args)
    assert result.exit_code == 2
    one_error_line(result, needle)


def test_recipes_show_json_error_names_the_subcommand():
    result = run("recipes", "show", "nope", "--format", "json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["command"] == "recipes show"


def test_ci_never_prints_a_placeholder_for_the_commit_tree(tmp_path):
    repo = tmp_path / "up"
    repo.mkdir()
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    for args in (["init", "-q", "-b", "main"], ["commit", "-q", "--allow-empty", "-m", "empty"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True, env=env, capture_output=True)
    result = run("ci", "--recipe", "qwen3_6-gdn", "--repo", repo)
    assert result.exit_code == 1
    assert "<tree>" not in result.output and f"{repo}@" in result.output
