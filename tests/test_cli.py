"""End-to-end tests of the CLI on the upstream-shaped code in vendored/."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_support import run


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
#: every step of the recipe; removed-cache-api and cache-surgery have no anchors and speak only where they find a site
#: (none in vendored/)
RECIPE_STEPS = [*STEPS[:3], "removed-cache-api", "cache-surgery", *STEPS[3:]]


pytestmark = pytest.mark.usefixtures("journal_home")  # DDPATCH_HOME in the test's tmp_path (tests/conftest.py)


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


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def statuses(payload: dict) -> dict[str, str]:
    return {s["id"]: s["status"] for s in payload["steps"]}


def test_recipes_list_and_show():
    out = run("recipes", "list")
    assert out.exit_code == 0 and "qwen3_6-gdn" in out.output
    shown = run("recipes", "show", "qwen3_6-gdn")
    assert shown.exit_code == 0
    for step in RECIPE_STEPS:
        assert step in shown.output
    data = json.loads(run("recipes", "show", "qwen3_6-gdn", "--format", "json").stdout)
    assert [s["id"] for s in data["steps"]] == RECIPE_STEPS
    assert all(s["examples"] for s in data["steps"])


def test_check_then_apply_out_then_reapply(ddtree, tmp_path):
    before = snapshot(ddtree)
    check = run("check", ddtree, *RECIPE, "--format", "json")
    assert check.exit_code == 1  # changes pending
    assert set(statuses(json.loads(check.stdout)).values()) == {"pending"}, "check writes nothing: its sites are pending"

    out = tmp_path / "patched"
    applied = run("apply", ddtree, *RECIPE, "--out", out, "--format", "json")
    assert applied.exit_code == 0, applied.output
    payload = json.loads(applied.stdout)
    assert statuses(payload) == {s: "applied" for s in STEPS}
    assert snapshot(ddtree) == before, "--out must leave the original untouched"
    assert (out / "_ddpatch_runtime" / "__init__.py").exists()
    for site in (s for step in payload["steps"] for s in step["sites"]):
        assert site["line"] > 0 and site["column"] > 0 and site["path"]

    again = run("apply", out, *RECIPE, "--format", "json")
    assert again.exit_code == 0
    assert statuses(json.loads(again.stdout)) == {s: "already-applied" for s in STEPS}
    assert json.loads(again.stdout)["written"] == []
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
    # the runtime copy is one line per file, not thousands of lines of ddpatch's own code
    runtime_lines = [line for line in diff.output.splitlines() if "_ddpatch_runtime/" in line]
    assert runtime_lines and all(line.startswith("# ddpatch runtime copy: ") for line in runtime_lines), runtime_lines[:3]
    assert "--- /dev/null" not in diff.output
    full = run("diff", ddtree, *RECIPE, "--color", "never", "--runtime-diff")
    assert "--- /dev/null" in full.output and "+++ b/_ddpatch_runtime/__init__.py" in full.output
    assert "\x1b[" not in diff.output, "plain output when not a terminal"
    colored = run("diff", ddtree, *RECIPE, "--color", "always")
    assert "\x1b[" in colored.output
    stat = run("diff", ddtree, *RECIPE, "--stat")
    assert stat.exit_code == 1 and "files changed" in stat.output and "dflash.py" in stat.output
    runtime_rows = [line for line in stat.output.splitlines() if "_ddpatch_runtime" in line]
    assert len(runtime_rows) == 1 and "ddpatch runtime copy" in runtime_rows[0], "the runtime copy is listed once"
    assert not [line for line in stat.output.splitlines() if line != line.rstrip()], "no trailing padding"
    data = json.loads(run("diff", ddtree, *RECIPE, "--format", "json").stdout)
    assert data["exit_code"] == 1 and data["diff"].startswith("--- a/") and "stat" not in data
    data = json.loads(run("diff", ddtree, *RECIPE, "--format", "json", "--stat").stdout)
    stat_paths = [row["path"] for row in data["stat"]]
    assert "dflash.py" in stat_paths and sum("_ddpatch_runtime" in p for p in stat_paths) == 1, "--stat is honoured with JSON"


def test_select_and_ignore(ddtree):
    data = json.loads(run("check", ddtree, *RECIPE, "--select", "crop-compat", "--format", "json").stdout)
    assert list(statuses(data)) == ["crop-compat"]
    data = json.loads(run("check", ddtree, *RECIPE, "--ignore", "verify-forward,tree-commit", "--format", "json").stdout)
    assert "verify-forward" not in statuses(data) and "tree-commit" not in statuses(data)
    bad = run("check", ddtree, *RECIPE, "--select", "nope")
    assert bad.exit_code == 2 and "unknown step" in bad.stderr


def test_dflash_layout_is_detected_and_tree_steps_do_not_apply(dflash):
    data = json.loads(run("check", dflash, *RECIPE, "--format", "json").stdout)
    assert data["upstream"] == "dflash"
    assert "tree-commit" not in statuses(data)
    assert statuses(data)["target-cache-config"] == "pending"


def test_no_match_blocks_writes_and_exits_2(ddtree):
    source = (ddtree / "ddtree.py").read_text()
    (ddtree / "ddtree.py").write_text(source.replace("def compact_dynamic_cache(", "def compact_cache_renamed("))
    before = snapshot(ddtree)
    result = run("apply", ddtree, *RECIPE, "--format", "json")
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert statuses(payload)["tree-commit"] == "no-match"
    anchor = [a for s in payload["steps"] if s["id"] == "tree-commit" for a in s["anchors"]][0]
    assert "compact_dynamic_cache" in anchor["message"]
    assert snapshot(ddtree) == before, "nothing is written when a step is no-match"
    assert run("check", ddtree, *RECIPE).exit_code == 1
    partial = run("apply", ddtree, *RECIPE, "--allow-partial")
    assert partial.exit_code == 1 and snapshot(ddtree) != before


def test_unparseable_file_is_reported_as_the_cause_and_skipped(ddtree):
    broken = ddtree / "dflash.py"  # the file the dflash_generate anchors live in
    source = broken.read_text() + "\n\ndef oops(target:\n    pass\n"
    broken.write_text(source)
    before = snapshot(ddtree)
    result = run("apply", ddtree, *RECIPE, "--format", "json")
    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    files = {f["path"]: f for f in payload["files"]}
    assert "cannot parse" in files["dflash.py"]["error"]
    assert snapshot(ddtree) == before, "a skipped file stops the run, as a no-match does"
    # the cause first: the anchors in the broken file are not checked, not no-match
    anchors = [a for s in payload["steps"] for a in s["anchors"] if a["path"] == "dflash.py"]
    assert anchors and {a["status"] for a in anchors} == {"skipped"}
    assert all("dflash.py skipped: cannot parse" in a["message"] for a in anchors)
    assert "no-match" not in statuses(payload).values()
    errors = result.stderr.strip().splitlines()
    assert errors[0].startswith("ddpatch: error: skipped dflash.py: cannot parse")
    assert not [line for line in errors if "no-match" in line]
    partial = run("apply", ddtree, *RECIPE, "--allow-partial", "--format", "json")
    assert partial.exit_code == 1
    assert broken.read_text() == source
    assert "DynamicCache(config=target.config)" in (ddtree / "ddtree.py").read_text()


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


# ----------------------------------------------------------------------------- bad input and faults
GUARDED = "import torch\n\n\ndef cuda_time():\n    torch.cuda.synchronize()\n"


def _plant(tree: Path, tmp_path: Path, kind: str) -> Path:
    """One problem file in ``tree``; returns the path the report must name."""
    if kind == "non-utf8":
        bad = tree / "latin1.py"
        bad.write_bytes(b"# caf\xe9\nimport torch\ntorch.cuda.synchronize()\n")
    elif kind == "binary":
        bad = tree / "blob.py"
        bad.write_bytes(b"\x00\x01torch.cuda.synchronize()\x00" * 10)
    elif kind == "outside-symlink":
        outside = tmp_path / "outside.py"
        outside.write_text(GUARDED)
        bad = tree / "linked.py"
        bad.symlink_to(outside)
    elif kind == "read-only":
        bad = tree / "timing.py"
        bad.write_text(GUARDED)
        bad.chmod(0o444)
    elif kind == "unparseable":
        bad = tree / "broken.py"
        bad.write_text("import torch\ndef f(:\n    torch.cuda.synchronize()\n")
    return bad


BAD_KINDS = {
    "non-utf8": "not UTF-8",
    "binary": "binary file",
    "outside-symlink": "symlink points outside the tree",
    "read-only": "read-only file",
    "unparseable": "cannot parse",
}


@pytest.mark.parametrize("kind", list(BAD_KINDS))
def test_bad_file_is_one_line_skipped_and_the_rest_is_patched(kind, ddtree, tmp_path):
    bad = _plant(ddtree, tmp_path, kind)
    target = bad.resolve()
    before = target.read_bytes()
    mode = target.stat().st_mode

    diff = run("diff", ddtree, *RECIPE, "--color", "never")
    assert "+++ b/dflash.py" in diff.output, "the rest of the tree is still diffed"
    lines = [line for line in diff.stderr.splitlines() if bad.name in line]
    if kind == "read-only":  # only writing it is a problem
        assert diff.exit_code == 1 and not lines and f"+++ b/{bad.name}" in diff.output
    else:
        assert diff.exit_code == 1
        assert len(lines) == 1 and lines[0].startswith(f"ddpatch: error: skipped {bad.name}: ") and BAD_KINDS[kind] in lines[0]

    tree_before = snapshot(ddtree)
    blocked = run("apply", ddtree, *RECIPE)
    assert blocked.exit_code == 1
    assert snapshot(ddtree) == tree_before, "nothing is written while a file is skipped"
    lines = [line for line in blocked.stderr.splitlines() if bad.name in line]
    assert len(lines) == 1 and lines[0].startswith(f"ddpatch: error: skipped {bad.name}: ") and BAD_KINDS[kind] in lines[0]
    assert "--allow-partial" in blocked.stderr.splitlines()[-1]

    applied = run("apply", ddtree, *RECIPE, "--allow-partial")
    assert applied.exit_code == 1
    lines = [line for line in applied.stderr.splitlines() if bad.name in line]
    assert len(lines) == 1 and lines[0].startswith(f"ddpatch: error: skipped {bad.name}: ") and BAD_KINDS[kind] in lines[0]
    assert "DynamicCache(config=target.config)" in (ddtree / "dflash.py").read_text(), "the rest of the tree is patched"
    assert target.read_bytes() == before and target.stat().st_mode == mode
    if kind == "outside-symlink":
        assert bad.is_symlink(), "the link is not replaced by a file"
    assert run("revert", ddtree).exit_code == 0


def test_read_only_file_gets_no_runtime_helper_beside_it(ddtree):
    (ddtree / "model" / "dflash.py").chmod(0o444)
    before = (ddtree / "model" / "dflash.py").read_bytes()
    result = run("apply", ddtree, *RECIPE, "--allow-partial")
    assert result.exit_code == 1 and "ddpatch: error: skipped model/dflash.py: read-only file" in result.stderr
    assert (ddtree / "model" / "dflash.py").read_bytes() == before
    assert not (ddtree / "model" / "_ddpatch_runtime").exists()
    assert (ddtree / "_ddpatch_runtime" / "__init__.py").exists()


def test_read_only_file_is_patched_into_a_copy(ddtree, tmp_path):
    bad = _plant(ddtree, tmp_path, "read-only")
    out = tmp_path / "patched"
    assert run("apply", ddtree, *RECIPE, "--out", out).exit_code == 0
    assert "if torch.cuda.is_available():" in (out / bad.name).read_text()
    assert bad.read_text() == GUARDED


def test_empty_directory_and_missing_path_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for args, needle in ((["check", tmp_path / "empty", *RECIPE], "empty directory"), (["diff", tmp_path / "nope", *RECIPE], "path does not exist")):
        result = run(*args)
        assert result.exit_code == 2
        assert result.stderr.strip().splitlines() == [result.stderr.strip()] and needle in result.stderr
        assert result.stderr.startswith("ddpatch: error:")


def test_symlink_inside_the_tree_is_left_to_its_target(ddtree):
    (ddtree / "alias.py").symlink_to(ddtree / "dflash.py")
    assert run("apply", ddtree, *RECIPE).exit_code == 0
    assert (ddtree / "alias.py").is_symlink()
    assert "DynamicCache(config=target.config)" in (ddtree / "alias.py").read_text()


@pytest.mark.slow
def test_killed_apply_leaves_whole_files_and_revert_restores_them(ddtree, tmp_path):
    before = snapshot(ddtree)
    expected = tmp_path / "expected"
    assert run("apply", ddtree, *RECIPE, "--out", expected).exit_code == 0
    patched = snapshot(expected)
    changed = sorted(p for p in patched if patched[p] != before.get(p))
    assert len(changed) >= 3

    env = {**os.environ, "DDPATCH_HOME": os.environ["DDPATCH_HOME"], "DDPATCH_TEST_WRITE_DELAY": "3"}
    proc = subprocess.Popen([sys.executable, "-m", "patcher", "apply", str(ddtree), *RECIPE, "-j", "1"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        # the runtime folder is staged and renamed first; wait for the first user file itself
        ours = [p for p in changed if "_ddpatch_runtime" not in p]
        while time.monotonic() < deadline and not any(snapshot(ddtree).get(p) == patched[p] for p in ours):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # in the pause after the first replaced file
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    now = snapshot(ddtree)
    assert not [p for p in now if any(part.endswith((".ddpatch-tmp", ".ddpatch-old")) for part in p.split("/"))]
    for path in changed:
        assert now.get(path) in (before.get(path), patched[path]), f"{path} is neither original nor patched"
    done = [p for p in changed if now.get(p) == patched[p]]
    assert done and len(done) < len(changed), "killed halfway"
    reverted = run("revert", ddtree)
    assert reverted.exit_code == 0, reverted.output
    assert snapshot(ddtree) == before


def test_progress_bar_only_on_a_terminal_and_for_many_files(monkeypatch):
    import io

    from patcher.report import console

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for total, tty, drawn in ((200, True, True), (10, True, False), (200, False, False)):
        stream = Terminal() if tty else io.StringIO()
        monkeypatch.setattr(console.sys, "stderr", stream)
        with console.file_progress("diff") as progress:
            for done in range(1, total + 1):
                progress(done, total)
        assert bool(stream.getvalue()) == drawn, (total, tty)


def test_run_recipe_reports_progress(ddtree):
    from patcher.engine.pipeline import run_recipe
    from patcher.engine.recipe import load_recipe

    calls = []
    report = run_recipe(load_recipe("qwen3_6-gdn"), ddtree, jobs=2, progress=lambda done, total: calls.append((done, total)))
    total = len([f for f in report.files if "_ddpatch_runtime" not in f.path])
    assert calls == [(i, total) for i in range(1, total + 1)]


def test_libcst_tool_command_runs_the_same_steps():
    """benchmarks/bench_engine.py times this command against ddpatch; it must do the same work."""
    import libcst as cst
    from libcst.codemod import CodemodContext

    from patcher.engine.codemods import CODEMODS
    from patcher.engine.codemods.libcst_recipe import QwenRecipe
    from patcher.engine.pipeline import transform_source
    from patcher.engine.recipe import load_recipe

    path = VENDORED / "ddtree" / "dflash.py"
    text = path.read_text()
    theirs = QwenRecipe(CodemodContext(filename=str(path))).transform_module(cst.parse_module(text)).code
    ours, _sites, _ = transform_source(text, [(s, CODEMODS[s.codemod]) for s in load_recipe("qwen3_6-gdn").steps], in_package=False)
    assert theirs == ours != text


# ----------------------------------------------------------------------------- issue 24, "What we met": output that points at the next step
def test_check_lists_every_file_that_would_change_and_describes_sites_truly(ddtree):
    result = run("check", ddtree, *RECIPE)
    assert result.exit_code == 1
    table, _, files = result.output.partition("file(s) would change:")
    changed = [line.split()[0] for line in files.splitlines() if line.startswith("  ")]
    assert "model/dflash.py" in changed and "model/dflash.py: " in table, "a file with sites outside the anchors is in the table"
    data = json.loads(run("check", ddtree, *RECIPE, "--format", "json").stdout)
    for f in data["files"]:
        if f["changed"] and "_ddpatch_runtime" not in f["path"]:
            assert f["path"] in changed, f["path"]
    assert sum("_ddpatch_runtime" in line for line in files.splitlines()) <= 2, "the runtime copy: one line per folder"
    assert "in the decode loop" not in run("check", ddtree, *RECIPE, "-v").output
    assert not [line for line in result.output.splitlines() if line != line.rstrip()], "no trailing padding when piped"
    assert result.output.rstrip().splitlines()[-1].startswith(f"next: ddpatch diff {ddtree}")


def test_apply_ends_with_the_next_command(ddtree, tmp_path):
    out = tmp_path / "patched"
    result = run("apply", ddtree, *RECIPE, "--out", out)
    assert result.exit_code == 0
    assert result.output.rstrip().splitlines()[-1].startswith(f"next: ddpatch verify {out}")


def test_a_selection_that_drops_the_lossless_steps_warns_and_exits_1(ddtree, tmp_path):
    lossy = ["--select", "crop-compat,input-embeddings,target-cache-config"]
    before = snapshot(ddtree)
    result = run("apply", ddtree, *RECIPE, *lossy)
    assert result.exit_code == 1 and snapshot(ddtree) == before, "nothing is written"
    lines = [line for line in result.stderr.splitlines() if "lossy" in line]
    assert len(lines) == 1 and "verify-forward" in lines[0] and "--allow-lossy" in lines[0]
    assert run("check", ddtree, *RECIPE, *lossy).exit_code == 1
    assert "a file was skipped" not in result.stderr and "--allow-partial" not in result.stderr, "no cause that is not the cause"
    allowed = run("apply", ddtree, *RECIPE, *lossy, "--allow-lossy", "--out", tmp_path / "o")
    assert allowed.exit_code == 0 and "ddpatch: error:" not in allowed.stderr, "--allow-lossy: written as asked, no error line"
    assert "ddpatch: warning: --allow-lossy" in allowed.stderr and "verify-forward" in allowed.stderr
    on_dflash = run("check", ddtree, *RECIPE, "--ignore", "tree-commit")
    assert "tree-commit" in on_dflash.stderr, "tree-commit is lossless on a DDTree layout"


def test_concise_output_is_one_path_line_col_line_per_site(ddtree):
    result = run("check", ddtree, *RECIPE, "--output-format", "concise")
    assert result.exit_code == 1
    import re

    pattern = re.compile(r"^\S+:\d+:\d+: \S+ (pending|no-match|skipped|applied|already-applied|fixed-upstream) .+$")
    lines = result.stdout.splitlines()
    assert lines and all(pattern.match(line) for line in lines), [line for line in lines if not pattern.match(line)][:3]
    assert any(":" in line and " verify-forward pending " in line for line in lines)


def test_recipes_list_keeps_whole_sentences_and_show_gives_each_step_its_own_example():
    listed = run("recipes", "list").output.splitlines()[0]
    assert listed.rstrip().endswith("with transformers 5.x."), listed
    shown = run("recipes", "show", "qwen3_6-gdn").output
    window = shown[shown.index("draft-sliding-window  ["):shown.index("tree-commit  [")]
    assert "draft_forward(" in window and "verify_forward(" not in window
    example = window[window.index("example"):]
    changed = [line for line in example.splitlines() if line.lstrip().startswith(("-", "+"))]
    assert not [line for line in changed if "def generate" in line or "while True" in line], "unchanged lines are context"


def test_print_workflow_fits_a_users_fork():
    text = run("ci", "--print-workflow").output
    assert "pip install -e ." not in text and "vendored/" not in text
    assert "ddpatch-upstream.lock" in text and "DDPATCH_INSTALL" in text


def test_update_lock_defaults_to_a_lock_beside_the_fork(tmp_path, monkeypatch):
    from patcher.ci.lock import default_lock_path, update_lock

    monkeypatch.chdir(tmp_path)
    assert default_lock_path() == tmp_path / "ddpatch-upstream.lock"
    assert update_lock(default_lock_path(), "ddtree", "a" * 40)
    import tomllib

    assert tomllib.loads(default_lock_path().read_text())["ddtree"]["last_verified"] == "a" * 40


def test_verify_help_states_the_float32_tolerance_the_code_uses():
    import re

    from patcher.verify.judge.calibration import FLOAT32_MIN_TOLERANCE

    text = " ".join(run("verify", "--help").output.split())
    found = re.search(r"float32 at least ([0-9.e-]+)", text)
    assert found and float(found.group(1).rstrip(".")) == FLOAT32_MIN_TOLERANCE
