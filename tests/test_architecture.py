"""The package layout (tools/import_graph.py) and the Python API (patcher/api.py).

The import graph of ``patcher/`` must have no cycle and point down only (cli -> api -> ci ->
engine, verify -> report -> results, errors); a copy of the package with an upward import,
a cycle, a CLI import or a long module shows the check failing.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENDORED = ROOT / "vendored"


@pytest.fixture(scope="module")
def graph():
    spec = importlib.util.spec_from_file_location("ddpatch_import_graph", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.usefixtures("journal_home")  # DDPATCH_HOME in the test's tmp_path (tests/conftest.py)


def test_the_import_graph_has_no_cycle_and_points_down(graph):
    result = graph.analyse()
    assert result["violations"] == []
    assert result["module_cycles"] == [] and result["package_cycles"] == []
    packages = result["packages"]
    assert [u for u, deps in packages.items() if "cli" in deps] == ["__main__"]  # nothing else imports the CLI
    assert packages["results"] == ["__init__"] and packages["errors"] == []
    assert packages["check"] == []  # stdlib only: the verifier's child loads it too
    assert packages["runtime"] == []
    assert set(packages["report"]) <= {"results", "env", "check", "__init__"}  # env: plain version facts; check: rows read as Checks
    assert packages["env"] == []
    assert not set(packages["engine"]) & {"verify", "ci", "report", "api", "cli"}


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "patcher", root / "patcher", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")


def test_the_graph_check_fails_on_an_upward_import_a_cycle_and_a_long_module(graph, tmp_path):
    root = _copy(tmp_path)
    _append(root / "patcher" / "engine" / "files.py", "\n\ndef _up():\n    from ..report.text import print_summary  # upward, lazily\n")
    _append(root / "patcher" / "results.py", "\nfrom .errors import EngineError\n")
    _append(root / "patcher" / "errors.py", "\nfrom .results import Report\n")  # results <-> errors
    _append(root / "patcher" / "report" / "diff.py", "\nfrom ..cli import main\n")
    _append(root / "patcher" / "verify" / "models" / "load.py", "\nfrom ...results import Outcome\n")  # the child reaches out
    _append(root / "patcher" / "runtime" / "verify.py", "\nimport transformers\n")  # at module level
    _append(root / "patcher" / "verify" / "models" / "script.py", "\nfrom ..judge import logits\n")  # verify's floors: up
    _append(root / "patcher" / "verify" / "subjects" / "binding.py", "\nfrom ..models import load\n")  # sideways, same floor
    _append(root / "patcher" / "verify" / "child" / "warm.py", "\n\ndef _up():\n    from ..process import runner\n")  # the child: up
    _append(root / "patcher" / "verify" / "check.py", "\nimport torch\nfrom .judge import logits\n")  # the shared leaf reaches out
    _append(root / "patcher" / "api.py", "\n" * 500)
    (root / "patcher" / "ci" / "__init__.py").write_text('"""ci."""\n')
    found = "\n".join(graph.analyse(root)["violations"])
    assert "patcher.engine.files imports patcher.report.text: engine may import only" in found
    assert "import cycle between modules: patcher.errors -> patcher.results" in found
    assert re.search(r"patcher\.errors imports patcher\.results: errors \(layer \d+\) may import only lower layers", found)
    assert "patcher.report.diff imports patcher.cli: nothing imports the CLI" in found
    assert "patcher.verify.models.load imports patcher.results: the verifier's child modules" in found
    assert "patcher.runtime.verify imports transformers" in found
    assert "patcher.verify.models.script imports patcher.verify.judge.logits: verify's models (floor 3) may import only lower" in found
    assert "patcher.verify.subjects.binding imports patcher.verify.models.load: verify's subjects (floor 3)" in found
    assert "patcher.verify.child.warm imports patcher.verify.process.runner: verify's child (floor 1) may import only lower" in found
    assert "patcher.verify.check imports torch: a shared leaf imports only the stdlib" in found
    assert "patcher.verify.check imports patcher.verify.judge.logits: a shared leaf imports nothing of patcher" in found
    assert "patcher.api:" in found and "over 500" in found
    assert "patcher.ci/__init__.py: its docstring must be two lines" in found


def test_the_graph_script_prints_the_layers_and_exits_0(graph, capsys):
    assert graph.main([]) == 0
    out = capsys.readouterr().out
    lines = [line.split()[2] for line in out.splitlines() if line.startswith("layer")]
    assert lines.index("cli") < lines.index("api") < lines.index("ci") < lines.index("engine") < lines.index("report") < lines.index("results")
    assert "cycles: none" in out


def test_the_api_example_of_the_readme(tmp_path):
    from patcher import api
    from patcher.report.diff import diff_text
    from patcher.results import ApplyResult, Report

    tree = tmp_path / "upstream"
    shutil.copytree(VENDORED / "ddtree", tree)
    report = api.check(tree, recipe="qwen3_6-gdn", jobs=1)
    assert isinstance(report, Report)
    statuses = {s.spec.id: s.status for s in report.steps}
    assert statuses["crop-compat"] == "pending" and "no-match" not in statuses.values()
    assert "+++ b/ddtree.py" in diff_text(report)
    result = api.apply(tree, recipe="qwen3_6-gdn", out=tmp_path / "patched", jobs=1)
    assert isinstance(result, ApplyResult) and not result.blocked
    assert "ddtree.py" in result.written and (tmp_path / "patched" / "_ddpatch_runtime" / "__init__.py").exists()
    again = api.check(tmp_path / "patched", jobs=1)
    assert {s.status for s in again.steps} <= {"already-applied", "fixed-upstream"} and not again.changed
    assert (tree / "ddtree.py").read_text() == (VENDORED / "ddtree" / "ddtree.py").read_text()  # the original is untouched
    outcome = api.verify(tmp_path / "patched", presets=["tiny-qwen3_5"], seeds=[0], prompts=2, max_new_tokens=24, tree_budgets=[4],
                         greedy_only=True)
    assert outcome.passed, [c for c in outcome.checks if not c["passed"]]
    assert any(c["check"] == "runs without ddpatch" and c["passed"] for c in outcome.checks)


def test_the_api_raises_one_line_input_errors(tmp_path):
    from patcher import api

    with pytest.raises(api.INPUT_ERRORS, match="path does not exist"):
        api.check(tmp_path / "missing")
    with pytest.raises(api.RecipeError, match="unknown recipe"):
        api.check(VENDORED / "ddtree", recipe="nope")
    with pytest.raises(api.RecipeError, match="unknown step"):
        api.check(VENDORED / "ddtree", select="not-a-step")
    with pytest.raises(api.VerifyError, match="not a directory"):
        api.verify(tmp_path / "missing")
