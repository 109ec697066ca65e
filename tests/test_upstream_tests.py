"""``ddpatch verify --upstream-tests``: the tree's own tests run before and after the patch, and a test the patch
breaks is a finding that names the step (patcher/verify/subjects/upstream_tests.py).

The trees are ``vendored/dflash`` with a ``tests/`` folder of our own; the breakage is the one an old
``cpu-safe-timing`` once wrote into DFlash's newest upstream: a module-level ``import torch`` in a benchmark that
promises to import without torch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from drift.variants import VENDORED

from patcher import api, bridge
from patcher.verify.subjects import upstream_tests as ut

ROOT = Path(__file__).resolve().parent.parent

# Our own tests for the vendored tree: two promises the recipe keeps, and one a step changes on purpose.
OWN_TESTS = '''
import inspect


def test_the_package_has_its_lazy_exports():
    import dflash
    assert "load_and_process_dataset" in dflash.__all__


def test_the_benchmark_imports_without_torch():
    from dflash.benchmark import load_and_process_dataset
    assert callable(load_and_process_dataset)
'''
# A test pinned to the unguarded call: cpu-safe-timing changes it, and its failure's traceback names no tree file.
PINNED_TEST = '''
import inspect


def test_the_benchmark_sets_the_device_unguarded():
    from dflash import benchmark
    assert "is_available()" not in inspect.getsource(benchmark)
'''
OLD_GUARD = "import torch  # what an old cpu-safe-timing wrote: a module-level import\n"


def _tree(tmp_path: Path, *tests: tuple[str, str]) -> Path:
    src = tmp_path / "src"
    shutil.copytree(VENDORED / "dflash", src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "tests").mkdir()
    for name, text in tests:
        (src / "tests" / name).write_text(textwrap.dedent(text))
    return src


def _patched(src: Path, out: Path, old_guard: bool = False) -> Path:
    result = api.apply(src, out=out, jobs=1)
    assert result.written and not result.blocked
    if old_guard:  # the old codemod's shape: a module-level import torch above the guard it wrote
        bench = out / "dflash" / "benchmark.py"
        text = bench.read_text()
        at = text.index("\nimport argparse")
        bench.write_text(text[:at + 1] + OLD_GUARD + text[at + 1:])
    return out


def _row(patched: Path, original: Path) -> dict:
    return ut.upstream_tests_row(patched, bridge.unpatched(patched, original), bridge.steps_by_file, timeout=300)


# ----------------------------------------------------------------------------- end to end: pytest before and after
@pytest.mark.heavy
def test_a_test_the_patch_breaks_is_named_with_its_step(tmp_path):
    src = _tree(tmp_path, ("test_shape.py", OWN_TESTS))
    row = _row(_patched(src, tmp_path / "out", old_guard=True), src)
    assert row["passed"] is False and not row.get("info")
    installed, without = row["environments"]
    assert installed["passed_both"] == 2 and not installed["broken"], "with torch installed the old guard breaks nothing"
    assert without["passed_both"] == 1, without
    (broken,) = without["broken"]
    assert broken["test"] == "tests/test_shape.py::test_the_benchmark_imports_without_torch"
    assert (broken["before"], broken["after"]) == ("passed", "failed")
    assert broken["found_by"] == "traceback" and broken["files"] == ["dflash/benchmark.py"]
    assert broken["steps"] == ["cpu-safe-timing"]
    assert ("1 passed before and fails after: tests/test_shape.py::test_the_benchmark_imports_without_torch "
            "(the patch changed dflash/benchmark.py: cpu-safe-timing)") in row["evidence"]


@pytest.mark.heavy
def test_a_correct_patch_keeps_every_promise_and_a_pinned_test_is_blamed_through_its_imports(tmp_path):
    src = _tree(tmp_path, ("test_shape.py", OWN_TESTS), ("test_pinned.py", PINNED_TEST))
    row = _row(_patched(src, tmp_path / "out"), src)
    for env in row["environments"]:
        assert env["passed_both"] == 2, env
        assert [b["test"] for b in env["broken"]] == ["tests/test_pinned.py::test_the_benchmark_sets_the_device_unguarded"]
        (broken,) = env["broken"]
        assert broken["found_by"] == "imports" and broken["files"] == ["dflash/benchmark.py"]
        assert broken["steps"] == ["cpu-safe-timing"]
    assert "dflash/benchmark.py: cpu-safe-timing, which the test imports" in row["evidence"]
    (src / "tests" / "test_pinned.py").unlink()
    shutil.rmtree(tmp_path / "out")
    clean = _row(_patched(src, tmp_path / "out"), src)
    assert clean["passed"] is True and not clean.get("info")
    assert clean["evidence"] == "installed: 2 passed before and after; without torch: 2 passed before and after"


def test_an_in_place_apply_is_compared_with_its_journal(tmp_path):
    src = _tree(tmp_path, ("test_shape.py", OWN_TESTS))
    tree = tmp_path / "tree"
    shutil.copytree(src, tree)
    api.apply(tree, jobs=1)
    unpatched = bridge.unpatched(tree, None)
    assert unpatched.root == tree.resolve() and unpatched.overlay
    before = ut.copy_tree(unpatched.root, tmp_path / "before", unpatched.overlay)
    assert sorted(ut._files(before)) == sorted(ut._files(src))
    assert all((before / rel).read_bytes() == (src / rel).read_bytes() for rel in ut._files(src)), "the journal's originals"
    assert (tree / "dflash" / "_ddpatch_runtime").is_dir() and not (before / "dflash" / "_ddpatch_runtime").exists()
    assert ut.changed_files(before, tree) == ["dflash/benchmark.py", "dflash/model.py"]
    from patcher.engine import journal

    entry = journal.latest(tree.resolve())
    payload = json.loads(entry.read_text())
    payload["files"][0]["path"] = "../outside.py"
    entry.write_text(json.dumps(payload))
    with pytest.raises(api.VerifyError, match="names a file outside the tree"):
        bridge.unpatched(tree, None)


def test_an_out_tree_without_original_is_one_error_line(tmp_path):
    src = _tree(tmp_path, ("test_shape.py", OWN_TESTS))
    out = _patched(src, tmp_path / "out")
    for extra in ([], ["--format", "json"]):
        proc = subprocess.run([sys.executable, "-m", "patcher", "verify", str(out), "--upstream-tests", *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ddpatch: error: --upstream-tests: no in-place apply of"), lines
        assert "pass --original SRC" in lines[0]
        if extra:
            assert json.loads(proc.stdout)["exit_code"] == 2
    with pytest.raises(api.VerifyError, match="is not a directory"):
        bridge.unpatched(out, tmp_path / "missing")
    with pytest.raises(api.VerifyError, match="the patched tree itself"):
        bridge.unpatched(out, out)


def test_a_tree_without_tests_says_so(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(VENDORED / "dflash", src, ignore=shutil.ignore_patterns("__pycache__"))
    row = _row(_patched(src, tmp_path / "out"), src)
    assert row["passed"] is True and row["info"] is True and row["evidence"].startswith("no tests found")


# ----------------------------------------------------------------------------- the pieces, without pytest
def test_tests_are_the_tests_folder_else_test_files_never_the_runtime(tmp_path):
    for rel in ("a/test_x.py", "b_test.py", "pkg/_ddpatch_runtime/test_runtime.py", ".venv/test_v.py", "testing.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert ut.tests_in(tmp_path) == ["a/test_x.py", "b_test.py"]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_y.py").write_text("")
    assert ut.tests_in(tmp_path) == ["tests"]


def test_junit_outcomes_by_test_id(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_a" name="test_ok" file="tests/test_a.py"/>'
        '<testcase classname="tests.test_a.TestK" name="test_m[1]" file="tests/test_a.py"><skipped message="s"/></testcase>'
        f'<testcase classname="tests.test_a" name="test_bad" file="tests/test_a.py"><failure message="boom">{tmp_path}/pkg/m.py:3: in f</failure></testcase>'
        '<testcase classname="" name="tests.test_b" file="tests/test_b.py"><error message="collection failure">E</error></testcase>'
        '</testsuite></testsuites>')
    got = ut.parse_junit(xml, tmp_path)
    assert {k: v[0] for k, v in got.items()} == {"tests/test_a.py::test_ok": "passed", "tests/test_a.py::TestK::test_m[1]": "skipped",
                                                  "tests/test_a.py::test_bad": "failed", "tests/test_b.py": "error"}
    assert got["tests/test_a.py::test_bad"][1] == "boom\npkg/m.py:3: in f", "the copy's own path is cut off"


def _pkg(tmp_path: Path) -> Path:
    for rel, text in {"pkg/__init__.py": "", "pkg/a.py": "from . import b\ndef f():\n    from . import c\n", "pkg/b.py": "X = 1\n", "pkg/c.py": "",
                      "tests/test_t.py": "def test_t():\n    from pkg.a import X\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_a_broken_test_is_blamed_on_its_traceback_then_its_imports_then_every_change(tmp_path):
    tree = _pkg(tmp_path)
    steps = {"pkg/b.py": ["step-b"], "pkg/c.py": ["step-c"]}
    changed = ["pkg/b.py", "pkg/c.py"]
    test = "tests/test_t.py::test_t"
    assert ut.imported_files(tree, "tests/test_t.py") == {"pkg/__init__.py", "pkg/a.py", "pkg/b.py"}
    by_trace = ut.blame(test, "pkg/c.py:1: in <module>\nE  boom", tree, changed, steps)
    assert by_trace == {"files": ["pkg/c.py"], "steps": ["step-c"], "found_by": "traceback"}
    assert ut.blame(test, "E  assert 1 == 2  (not/pkg/c.py, mypkg/c.pyx)", tree, changed, steps)["found_by"] == "imports"
    by_imports = ut.blame(test, "E  assert 1 == 2", tree, changed, steps)
    assert by_imports == {"files": ["pkg/b.py"], "steps": ["step-b"], "found_by": "imports"}
    anywhere = ut.blame(test, "E  assert 1 == 2", tree, ["pkg/c.py"], steps)
    assert anywhere == {"files": ["pkg/c.py"], "steps": ["step-c"], "found_by": "every changed file"}


def test_a_test_missing_after_the_patch_takes_its_modules_collection_error(tmp_path):
    tree = _pkg(tmp_path)
    before = ut.Run({"tests/test_t.py::test_t": ("passed", ""), "tests/test_t.py::test_u": ("failed", "x")})
    after = ut.Run({"tests/test_t.py": ("error", "pkg/b.py:1: in <module>\nE   ModuleNotFoundError: No module named 'torch'")})
    verdict = ut.compare(before, after, tree, ["pkg/b.py"], {"pkg/b.py": ["step-b"]})
    (broken,) = verdict["broken"]
    assert (broken["test"], broken["after"], broken["steps"]) == ("tests/test_t.py::test_t", "error", ["step-b"])
    assert verdict["passed_both"] == 0 and verdict["fail_or_skip_both"] == ["tests/test_t.py::test_u"]
    timed_out = ut.compare(before, ut.Run({}, "pytest timed out after 5 s"), tree, ["pkg/b.py"], {"pkg/b.py": ["step-b"]})
    assert timed_out["broken"][0]["after"] == "absent" and timed_out["broken"][0]["found_by"] == "imports"
    assert "after the patch: pytest timed out after 5 s" in ut._env_text("installed", timed_out, {"pkg/b.py": ["step-b"]})


def test_the_steps_of_a_file_are_checks_sites_narrowed_to_what_its_patched_copy_names(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(VENDORED / "dflash", src, ignore=shutil.ignore_patterns("__pycache__"))
    full = bridge.steps_by_file(src, _patched(src, tmp_path / "full"))
    assert full["dflash/benchmark.py"] == ["cpu-safe-timing"]
    assert {"cpu-safe-timing", "crop-compat"} <= set(full["dflash/model.py"])
    api.apply(src, out=tmp_path / "timing", select="cpu-safe-timing", jobs=1)
    assert bridge.steps_by_file(src, tmp_path / "timing")["dflash/model.py"] == ["cpu-safe-timing"]


def test_verify_adds_the_row_after_the_childs_result_and_checks_its_input_before(tmp_path, monkeypatch):
    from patcher.report.json_report import verify_payload
    from patcher.results import Outcome
    from patcher.verify.process import runner

    calls = []
    child = Outcome({"checks": [{"check": "loads", "passed": True}]}, 1.0)
    monkeypatch.setattr(runner, "run_verify", lambda tree, **kw: calls.append(kw) or child)
    src = tmp_path / "src"
    shutil.copytree(VENDORED / "dflash", src, ignore=shutil.ignore_patterns("__pycache__"))
    out = _patched(src, tmp_path / "out")
    outcome = api.verify(out, original=src, presets=["tiny-qwen3_5"])
    assert [c["check"] for c in outcome.checks] == ["loads", "upstream tests"] and outcome.passed
    assert "upstream_tests" not in calls[0] and "original" not in calls[0], "the verifier child never sees these options"
    assert verify_payload(outcome, 0)["checks"][1]["evidence"].startswith("no tests found")
    with pytest.raises(api.VerifyError, match="no in-place apply"):
        api.verify(out, upstream_tests=True)
    assert len(calls) == 1, "bad input stops verify before its child runs"
