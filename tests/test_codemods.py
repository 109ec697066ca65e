"""Fixture tests: every codemod, before/after, plus the cases it must leave alone.

Cases live in tests/fixtures/<codemod>/<case>.py with the expected output beside them in
<case>.py.out (identical text for a must-not-change case). Each codemod's own EXAMPLES,
which `ddpatch recipes show` prints, are run the same way, so the docs cannot drift.
"""

from __future__ import annotations

import ast

import pytest

from patcher.engine.codemods import CODEMODS
from patcher.engine.codemods.base import ALREADY_APPLIED, APPLIED, FIXED_UPSTREAM
from fixture_support import cases, expected_statuses, params_of, run_codemod, statuses

CASES = cases()


@pytest.mark.parametrize("codemod,path", CASES, ids=[f"{c}/{p.name}" for c, p in CASES])
def test_fixture(codemod, path):
    before = path.read_text()
    expected = path.with_suffix(".py.out").read_text()
    params = params_of(before)
    after, sites, _ = run_codemod(codemod, before, **params)
    assert after == expected
    assert statuses(codemod, before, sites) == expected_statuses(path), "sites and their statuses (the .py.status file)"
    ast.parse(after)
    if after == before:
        assert not [s for s in sites if s.status == APPLIED]
    else:
        assert [s for s in sites if s.status == APPLIED], "a rewrite must be reported as a site"
    again, sites_again, _ = run_codemod(codemod, after, **params)
    assert again == after, "a second run must change nothing"
    assert not [s for s in sites_again if s.status == APPLIED]


def test_every_codemod_has_fixtures_that_change_and_that_must_not():
    for codemod in CODEMODS:
        paths = [p for c, p in CASES if c == codemod]
        changed = [p for p in paths if p.read_text() != p.with_suffix(".py.out").read_text()]
        assert changed, f"{codemod}: no before/after fixture"
        assert len(changed) < len(paths), f"{codemod}: no must-not-change fixture"


def test_every_codemod_has_fixtures_that_expect_each_status():
    for codemod in CODEMODS:
        seen = {line.split()[1] for c, p in CASES if c == codemod for line in expected_statuses(p)}
        for status in (APPLIED, ALREADY_APPLIED, FIXED_UPSTREAM):
            assert status in seen, f"{codemod}: no fixture expects {status}"


EXAMPLES = [(cls.ID, i, ex.clean()) for cls in CODEMODS.values() for i, ex in enumerate(cls.EXAMPLES)]


@pytest.mark.parametrize("codemod,i,example", EXAMPLES, ids=[f"{c}#{i}" for c, i, _ in EXAMPLES])
def test_documented_example(codemod, i, example):
    after, _, _ = run_codemod(codemod, example.before, **example.params)
    assert after == example.after


def test_a_remembered_transform_is_the_transform_and_its_sites_are_the_callers():
    """``transform_source`` keeps results per process (``ddpatch ci`` meets a file in every commit)."""
    from pathlib import Path

    from patcher.engine import pipeline
    from patcher.engine.recipe import load_recipe

    text = (Path(__file__).resolve().parent.parent / "vendored" / "ddtree" / "ddtree.py").read_text()
    steps = [(s, CODEMODS[s.codemod]) for s in load_recipe("qwen3_6-gdn").steps]
    pipeline._MEMO.clear()
    for _ in range(2):  # the first call's sites and a remembered call's sites
        for site in pipeline.transform_source(text, steps, in_package=False)[1]:
            site.status, site.path, site.message = "mutated", "elsewhere", ""  # as process_file does, to its copy
    fresh = pipeline._transform(text, steps, in_package=False)
    again = pipeline.transform_source(text, steps, in_package=False)
    assert len(pipeline._MEMO) == 1, "the second call was not remembered"
    assert again[0] == fresh[0] != text and again[2] == fresh[2]
    assert [s.as_dict() for s in again[1]] == [s.as_dict() for s in fresh[1]] != []
    # each input of the transform is in the key: in a package the runtime is imported relatively
    in_package = pipeline.transform_source(text, steps, in_package=True)[0]
    assert in_package == pipeline._transform(text, steps, in_package=True)[0] != again[0]
    crop_only = [(s, c) for s, c in steps if s.id == "crop-compat"]
    assert pipeline.transform_source(text, crop_only, in_package=False)[0] == pipeline._transform(text, crop_only, in_package=False)[0]
    assert len(pipeline._MEMO) == 3
