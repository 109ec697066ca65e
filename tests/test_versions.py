"""The tested transformers range says the same everywhere: pyproject's pin, patcher/env.py, the recipe,
the runtime's refusal, the version matrix (.ci/matrix) and .ci/run (docs/transformers.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from patcher import env as penv

ROOT = Path(__file__).resolve().parent.parent
LOW, HIGH = penv.TESTED_RANGES["transformers"]


def _pin(spec: str) -> tuple[str, str]:
    match = re.fullmatch(r"\s*>=\s*([\d.]+)\s*,\s*<\s*([\d.]+)\s*", spec)
    assert match, f"not a >=LOW,<HIGH range: {spec!r}"
    return match.group(1), match.group(2)


def test_the_pin_is_the_tested_range():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d[len("transformers"):] for d in deps if re.match(r"transformers\s*[<>=]", d)]
    assert _pin(spec) == (LOW, HIGH)


def test_the_pin_covers_the_newest_tested_release_and_only_whole_minors():
    """The range runs from a whole minor (the floor) to the minor after the newest release the matrix ran: it covers
    every patch of the newest tested minor and nothing of the next one."""
    low, high = penv.release(LOW), penv.release(HIGH)
    assert low[2] == 0 and high[2] == 0 and high > low, (LOW, HIGH)
    newest = max(penv.release(r) for r in _matrix_releases())
    assert high == (newest[0], newest[1] + 1, 0), f"the pin ends at {HIGH}, the matrix's newest release is {newest}"
    assert penv.tested_range_status("transformers", f"{newest[0]}.{newest[1]}.99") == "inside"


def test_the_recipe_and_the_docs_name_the_same_range():
    recipe = tomllib.loads((ROOT / "recipes" / "qwen3_6-gdn.toml").read_text())
    assert _pin(recipe["transformers"]) == (LOW, HIGH)
    assert f"`transformers>={LOW},<{HIGH}`" in (ROOT / "docs" / "transformers.md").read_text()


def test_this_suite_runs_inside_the_tested_range():
    import transformers

    assert penv.tested_range_status("transformers", transformers.__version__) == "inside", transformers.__version__


def _matrix_releases() -> list[str]:
    text = (ROOT / ".ci" / "matrix").read_text()
    match = re.search(r'^RELEASES=\$\{DDPATCH_MATRIX:?-"([^"]+)"\}', text, re.M)
    assert match, "RELEASES line not found in .ci/matrix"
    return match.group(1).split()


def test_the_matrix_runs_the_floor_a_middle_release_and_the_newest():
    releases = _matrix_releases()
    assert len(releases) >= 3
    versions = [penv.release(r) for r in releases]
    assert min(versions) == penv.release(LOW), "the matrix must run the floor of the pin"
    newest = max(versions)
    assert any(min(versions) < v < newest for v in versions), f"no release between the floor and the newest: {releases}"
    assert newest[:2] == (penv.release(HIGH)[0], penv.release(HIGH)[1] - 1), "the matrix must run the newest minor the pin allows"
    assert all(penv.tested_range_status("transformers", r) == "inside" for r in releases)


def _matrix_setting(name: str) -> str:
    match = re.search(rf"^{name}=([\d.]+)$", (ROOT / ".ci" / "matrix").read_text(), re.M)
    assert match, f"{name}= not found in .ci/matrix"
    return match.group(1)


def _floor(name: str) -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(rf"{name}\s*[<>=]", d)]
    return re.search(r">=\s*([\d.]+)", spec).group(1)


def _next_minor(version: str) -> str:
    major, minor = penv.release(version)[:2]
    return f"{major}.{minor + 1}"


def test_the_tested_ranges_run_from_the_matrix_s_oldest_stack_to_its_newest():
    """``ddpatch env`` calls tested what CI runs: each range starts at what the matrix's oldest stack
    installs (pyproject.toml's floors of torch, accelerate and libcst; Python 3.11) and ends at the
    minor after its newest stack (Python 3.13, torch 2.15.0)."""
    assert penv.TESTED_RANGES["python"] == (_matrix_setting("OLDEST_PYTHON"), _next_minor(_matrix_setting("NEWEST_PYTHON")))
    assert penv.TESTED_RANGES["torch"] == (_floor("torch"), _next_minor(_matrix_setting("NEWEST_TORCH")))
    for name in ("accelerate", "libcst"):
        assert penv.TESTED_RANGES[name][0] == _floor(name), name
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={_matrix_setting('OLDEST_PYTHON')}", "requires-python is the oldest Python CI runs"


def test_ci_run_runs_the_readme_command_then_the_matrix_and_fails_with_it():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    readme = (ROOT / "README.md").read_text()
    command = 'python3 -m pip install -q torch==2.13.0 -e ".[test]" && python3 -m pytest -q'
    assert command in readme
    suite = next(i for i, line in enumerate(lines) if command in line)
    matrix = next(i for i, line in enumerate(lines) if ".ci/matrix" in line)
    assert suite < matrix and "status=1" in lines[suite] and "status=1" in lines[matrix]
    assert lines[-1] == "exit $status", ".ci/run must fail when the suite or a matrix cell fails"


def test_the_matrix_and_ci_run_scripts_parse():
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / "matrix")], check=True)
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")], check=True)


def _junit(path: Path, **cases: str) -> None:
    """A JUnit report as pytest writes it: test name -> passed | skipped | failed."""
    body = {"passed": "", "skipped": '<skipped type="pytest.skip" message="5.24+: not here"/>',
            "failed": '<failure message="boom"/>'}
    path.write_text('<testsuites><testsuite name="pytest">' + "".join(
        f'<testcase classname="tests.test_x" name="{name}">{body[result]}</testcase>' for name, result in cases.items())
        + "</testsuite></testsuites>")


def test_the_skip_check_passes_only_when_each_skipped_test_ran_in_another_cell(tmp_path):
    """.ci/skips: a test skipped on one release must run (pass) on another; skipped everywhere, or
    failed where it was not skipped, is a gap (exit 1, named)."""
    cells = tmp_path / "junit"
    cells.mkdir()
    _junit(cells / "transformers-5.21.0--lossless.xml", test_mamba="passed", test_other="passed")
    _junit(cells / "transformers-5.25.0--lossless.xml", test_mamba="skipped", test_other="passed")
    run = [sys.executable, str(ROOT / ".ci" / "skips"), str(cells)]
    ok = subprocess.run(run, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout
    assert "tests.test_x::test_mamba" in ok.stdout and "ran in: transformers-5.21.0--lossless" in ok.stdout
    _junit(cells / "transformers-5.21.0--lossless.xml", test_mamba="failed", test_other="passed")
    gap = subprocess.run(run, capture_output=True, text=True)
    assert gap.returncode == 1 and "ran in: NOWHERE" in gap.stdout, gap.stdout
    suite = tmp_path / "suite.xml"
    _junit(suite, test_mamba="passed")
    assert subprocess.run(run + [str(suite)], capture_output=True, text=True).returncode == 0


def test_a_skip_for_want_of_shared_is_a_gap_only_where_shared_is_there(tmp_path):
    """The real-tree tests skip where ../shared/upstream is absent (a clone elsewhere): .ci/skips lists them and
    passes there; where the folder is there (CI), the same skip everywhere is a gap."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("ci_skips", str(ROOT / ".ci" / "skips"))
    skips = importlib.util.module_from_spec(importlib.util.spec_from_loader("ci_skips", loader))
    loader.exec_module(skips)
    cells = tmp_path / "junit"
    cells.mkdir()
    (cells / "suite--all.xml").write_text(
        '<testsuites><testsuite name="pytest"><testcase classname="tests.test_upstream_trees" name="test_head">'
        '<skipped message="../shared/upstream/dflash.bundle is absent: the real upstream histories live in ../shared"/>'
        "</testcase></testsuite></testsuites>")
    for present, code in ((False, 0), (True, 1)):
        shared = tmp_path / ("shared" if present else "nowhere") / "upstream"
        shared.mkdir(parents=True)
        skips.SHARED = shared if present else tmp_path / "absent"
        assert skips.main([str(cells)]) == code, present


def test_ci_reads_the_ranges_from_pyproject():
    """.ci/run and .ci/matrix keep no second copy of pyproject.toml's ranges: .ci/requirements.py reads them."""
    def req(*args):
        return subprocess.run([sys.executable, str(ROOT / ".ci" / "requirements.py"), *args], capture_output=True,
                              text=True, check=True).stdout.split()

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d.replace(" ", "") for d in deps if d.startswith("transformers")]
    assert req("spec", "transformers") == [spec]
    assert req("floor", "torch") == [".".join((_floor("torch").split(".") + ["0", "0"])[:3])]
    oldest = req("env", "--floor", "torch", "--floor", "accelerate", "--floor", "libcst")
    assert f"torch=={req('floor', 'torch')[0]}" in oldest and spec in oldest and any(r.startswith("pytest") for r in oldest)
    assert "torch==2.15.0" in req("env", "--pin", "torch==2.15.0")
    run = (ROOT / ".ci" / "run").read_text()
    assert "requirements.py spec transformers" in run and "transformers>=" not in run


def test_the_workflow_verifies_on_the_newest_transformers():
    from patcher.ci.workflow import workflow_template

    text = workflow_template()
    job = text[text.index("\n  newest-transformers:"):]
    assert "pip install --upgrade transformers" in job
    assert job.index("pip install --upgrade transformers") < job.index("ddpatch verify")
    assert "ddpatch env" in job
    assert "\t" not in text


def test_the_runtime_refuses_a_transformers_below_the_floor_in_one_line():
    """Below the floor the runtime refuses at first use, in one line naming the version (docs/transformers.md):
    5.20.2 (reads the cache's internals), 5.7.0 (the same), 5.2.0 (before transformers#45513)."""
    code = """
import sys
import transformers
real = transformers.__version__
from patcher import runtime as rt
from patcher.verify.models.presets import build_target
model = build_target("tiny-qwen3_5", seed=0)
for version in ("5.20.2", "5.7.0", "5.2.0", real):  # the runtime checks at first use, and remembers only a pass
    sys.modules["transformers"].__version__ = version  # transformers swaps its lazy module in on first use
    try:
        rt.hybrid_linear_modules(model)
    except rt.UnsupportedModelError as exc:
        print(version, "|", str(exc).replace("\\n", "<newline>"))
    else:
        print(version, "| NOT REFUSED")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.strip().splitlines()
    assert len(out) == 4, out
    assert out[-1].endswith("| NOT REFUSED"), "the installed release is inside the range and must be served"
    for line in out[:-1]:
        version, message = line.split(" | ", 1)
        assert message.startswith("ddpatch: ") and "<newline>" not in message, line
        assert version in message and LOW in message, line


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_the_logits_recorder_finds_the_cache_by_type_not_keyword(keyword):
    """transformers 5.24+ names a model's cache ``cache=`` (``past_key_values=`` is deprecated): a decoder
    that passes either is a decoding step the verifier records; a forward without a cache is not."""
    import torch
    from transformers import DynamicCache

    from patcher.verify.judge.logits import LogitsRecorder

    class Target(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return type("Out", (), {"logits": torch.zeros(1, input_ids.shape[1], 5)})()

    target = Target()
    with LogitsRecorder(target) as recorder:
        target(torch.tensor([[1, 2, 3]]), **{keyword: DynamicCache()})
        target(torch.tensor([[4]]), use_cache=False)
    assert [c["ids"] for c in recorder.calls] == [[1, 2, 3]]
    assert recorder.calls[0]["positions"] == [0, 1, 2]
