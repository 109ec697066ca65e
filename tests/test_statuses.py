"""How per-anchor and per-site statuses add up to a step's status, and how the CLI relabels them.

These guard the classification against the mutants of benchmarks/mutants.py (group
``classify``): a step must be no-match as soon as one anchor is, whatever the others say.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from patcher.cli import main
from patcher.engine.codemods.base import ALREADY_APPLIED, APPLIED, FIXED_UPSTREAM, NO_MATCH, Site
from patcher.engine.classify import _aggregate
from patcher.engine.files import read_provenance
from patcher.results import PENDING, SKIPPED, AnchorResult

VENDORED = Path(__file__).resolve().parent.parent / "vendored"


def anchors(*statuses: str) -> list[AnchorResult]:
    return [AnchorResult(f"f{i}", s, "why") for i, s in enumerate(statuses)]


def sites(*statuses: str) -> list[Site]:
    return [Site(s, i + 1, 1, None, "why") for i, s in enumerate(statuses)]


@pytest.mark.parametrize(
    "anchor_statuses,site_statuses,expected",
    [
        ((APPLIED, NO_MATCH), (), NO_MATCH),
        ((NO_MATCH, FIXED_UPSTREAM), (), NO_MATCH),
        ((ALREADY_APPLIED,), (NO_MATCH,), NO_MATCH),
        ((), (APPLIED, ALREADY_APPLIED), APPLIED),
        ((ALREADY_APPLIED, FIXED_UPSTREAM), (), ALREADY_APPLIED),
        ((FIXED_UPSTREAM,), (FIXED_UPSTREAM,), FIXED_UPSTREAM),
        ((), (), NO_MATCH),
    ],
)
def test_a_step_is_no_match_as_soon_as_one_anchor_or_site_is(anchor_statuses, site_statuses, expected):
    assert _aggregate(anchors(*anchor_statuses), sites(*site_statuses)) == expected


@pytest.mark.parametrize(
    "text,steps",
    [
        ("# ddpatch: recipe r v1, ddpatch 0.1.0; steps: a, b\nx = 1\n", {"a", "b"}),
        ("#!/usr/bin/env python\n# -*- coding: latin-1 -*-\n# ddpatch: recipe r v1, ddpatch 0.1.0; steps: a\n", {"a"}),
        ("x = 1\ny = 2\nz = 3\n# ddpatch: recipe r v1, ddpatch 0.1.0; steps: a\n", set()),
        ("\n\n\n# ddpatch: recipe r v1, ddpatch 0.1.0; steps: a\n", set()),
    ],
)
def test_provenance_is_read_from_the_first_three_lines_only(text, steps):
    assert read_provenance(text) == steps


def test_one_anchor_losing_its_site_makes_the_step_no_match_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))
    tree = tmp_path / "ddtree"
    shutil.copytree(VENDORED / "ddtree", tree, ignore=shutil.ignore_patterns("__pycache__"))
    dflash = tree / "dflash.py"
    source = dflash.read_text()
    assert source.count("target.model.embed_tokens") >= 1
    dflash.write_text(source.replace("target.model.embed_tokens", "model.embed"))
    result = CliRunner().invoke(main, ["check", str(tree), "--recipe", "qwen3_6-gdn", "--select", "input-embeddings",
                                       "--allow-lossy", "-j", "1", "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 1  # a no-match step is a finding
    (step,) = json.loads(result.stdout)["steps"]
    by_function = {a["function"]: a["status"] for a in step["anchors"]}
    assert by_function == {"dflash_generate": NO_MATCH, "ddtree_generate": PENDING}
    assert step["status"] == NO_MATCH


def test_statuses_the_cli_adds_are_distinct_words():
    assert len({APPLIED, ALREADY_APPLIED, FIXED_UPSTREAM, NO_MATCH, PENDING, SKIPPED}) == 6


GUARDED = "import torch\n\n\ndef timed():\n    if torch.cuda.is_available():\n        torch.cuda.synchronize()\n"


@pytest.mark.parametrize("provenance,expected", [("", FIXED_UPSTREAM), ("cpu-safe-timing", ALREADY_APPLIED),
                                                 ("crop-compat", FIXED_UPSTREAM)])
def test_the_output_form_is_already_applied_only_with_ddpatchs_provenance(tmp_path, provenance, expected):
    tree = tmp_path / "tree"
    tree.mkdir()
    head = f"# ddpatch: recipe qwen3_6-gdn v1, ddpatch 0.1.0; steps: {provenance}\n" if provenance else ""
    (tree / "timing.py").write_text(head + GUARDED)
    result = CliRunner().invoke(main, ["check", str(tree), "--recipe", "qwen3_6-gdn", "--select", "cpu-safe-timing",
                                       "-j", "1", "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (step,) = json.loads(result.stdout)["steps"]
    assert step["status"] == expected and {s["status"] for s in step["sites"]} == {expected}


def test_check_puts_the_cause_first_for_an_unparseable_file(tmp_path, monkeypatch):
    """Without writing anything (check, diff, apply --out), the anchors in a broken file are skipped, not no-match."""
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))
    tree = tmp_path / "ddtree"
    shutil.copytree(VENDORED / "ddtree", tree, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "dflash.py").write_text((tree / "dflash.py").read_text() + "\n\ndef oops(:\n    pass\n")
    result = CliRunner().invoke(main, ["check", str(tree), "--recipe", "qwen3_6-gdn", "-j", "1", "--format", "json"],
                                catch_exceptions=False)
    assert result.exit_code == 1  # a skipped file is a finding
    steps = json.loads(result.stdout)["steps"]
    in_broken = [a for s in steps for a in s["anchors"] if a["path"] == "dflash.py"]
    assert in_broken and {a["status"] for a in in_broken} == {SKIPPED}
    assert NO_MATCH not in {s["status"] for s in steps}
    assert result.stderr.strip().splitlines()[0].startswith("ddpatch: error: skipped dflash.py: cannot parse")
