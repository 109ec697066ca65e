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
