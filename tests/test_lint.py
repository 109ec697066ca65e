"""The linter the project keeps: ``ruff check`` (rules in pyproject.toml's ``[tool.ruff]``, and why) is clean on the
code the project runs: patcher/, tests/, tools/ and benchmarks/. It runs in the fast tier and in .ci/run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("patcher", "tests", "tools", "benchmarks")


def _ruff() -> list[str]:
    try:
        import ruff  # noqa: F401  (the test extra installs it: its binary sits beside the interpreter)
    except ImportError:
        exe = shutil.which("ruff")
        if exe is None:
            pytest.skip("ruff is not installed (python3 -m pip install -e '.[test]' installs it)")
        return [exe]
    return [sys.executable, "-m", "ruff"]


def _check(root: Path, *paths: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", *paths], cwd=root,
                          capture_output=True, text=True, timeout=300)


def test_ruff_is_clean_on_the_code_the_project_runs():
    done = _check(ROOT, *FOLDERS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_finds_a_closure_over_a_loop_variable_and_an_undefined_annotation(tmp_path):
    # the two kinds of finding issue 48 named: the configuration must keep catching them
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "patcher").mkdir()
    (tmp_path / "patcher" / "bad.py").write_text(
        "from __future__ import annotations\n\n\n"
        "def f(xs) -> Any:\n"
        "    out = []\n"
        "    for x in xs:\n"
        "        out.append(lambda: x)\n"
        "    return out\n")
    done = _check(tmp_path, "patcher")
    assert done.returncode == 1
    assert "B023" in done.stdout and "F821" in done.stdout, done.stdout
