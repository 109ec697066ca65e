"""DFlash's newest upstream is a layout the recipe knows: ``dflash2``, with the statuses docs/statuses.md gives.

The trees are the drift variants of tests/drift/variants_newest.py (``vendored/dflash`` moved to the
newest shapes at test time); no upstream code is involved.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from drift.variants import BY_NAME, VENDORED

from patcher import api

#: what `ddpatch check` says on the newest layout (docs/statuses.md, "DFlash's newest layout")
NEWEST = {
    "target-cache-config": "fixed-upstream",
    "input-embeddings": "fixed-upstream",
    "crop-compat": "applied",
    "cpu-safe-timing": "applied",
    "attn-fallback": "fixed-upstream",
    "lazy-datasets": "fixed-upstream",
    "verify-forward": "applied",
    "draft-sliding-window": "fixed-upstream",
}


def _statuses(report) -> dict[str, str]:
    return {s.spec.id: s.status for s in report.steps}


@pytest.mark.parametrize("name,layout", [("newest", "dflash2"), ("dflash2", "dflash2"), ("make-cache", "dflash"), (None, "dflash")])
def test_the_newest_layout_is_told_apart_by_dflash2(name, layout, tmp_path):
    tree = VENDORED / "dflash" if name is None else BY_NAME[name].make(tmp_path / name)
    assert api.check(tree, jobs=1).upstream == layout


def test_the_newest_layout_has_the_documented_statuses(tmp_path):
    report = api.check(BY_NAME["newest"].make(tmp_path / "newest"), jobs=1)
    assert _statuses(report) == {k: ("pending" if v == "applied" else v) for k, v in NEWEST.items()}
    crop = next(s for s in report.steps if s.spec.id == "crop-compat")
    left = [a for a in crop.sites if a.function == "_crop_to"]
    assert left and all(a.status == "fixed-upstream" for a in left), "the 5.x count in _crop_to is left alone"


def _git(repo: Path, *args: str) -> None:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True)


def test_ci_shows_the_newest_layout_in_its_table(tmp_path):
    from patcher.ci.history import run_ci
    from patcher.engine.recipe import load_recipe
    from patcher.report.text import render_ci

    repo = tmp_path / "dflash"
    shutil.copytree(VENDORED / "dflash", repo, ignore=shutil.ignore_patterns("__pycache__"))
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "shaped like 44947fb", "--date=2026-04-26T12:00:00")
    newest = BY_NAME["newest"].make(tmp_path / "newest")
    shutil.rmtree(repo / "dflash")
    shutil.copytree(newest / "dflash", repo / "dflash")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "DFlash2, sampling, _make_cache", "--date=2026-12-01T12:00:00")

    result = run_ci(load_recipe("qwen3_6-gdn"), repo, since="HEAD~1")
    assert [e.upstream for e in result.evaluated] == ["dflash", "dflash2"]
    assert {sid: result.tip.status(sid) for sid in NEWEST} == NEWEST
    layout = [f for f in result.findings if f.step == "(layout)"]
    assert len(layout) == 1 and (layout[0].before, layout[0].after) == ("dflash", "dflash2")
    table = render_ci(result)
    assert "upstream layout: dflash -> dflash2" in table
    assert any(line.split()[2:3] == ["dflash2"] for line in table.splitlines() if line[:1].isalnum()), table
