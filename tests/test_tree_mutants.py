"""The planted tree bugs of tests/tree_mutants.py still apply: each edit's text occurs exactly once in the patched
vendored/ddtree and in the patched real DDTree HEAD (../shared/upstream; skipped where absent), and the planted
files compile. What each bug does to acceptance is measured by benchmarks/bench_acceptance_power.py."""

from __future__ import annotations

import py_compile

import pytest

import tree_mutants as tm


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("mutants")
    return {"vendored": tm.patched_vendored(base / "vendored"), "upstream": tm.patched_upstream(base / "upstream")}


@pytest.mark.parametrize("kind", ["vendored", "upstream"])
def test_every_mutant_plants_once_on_the_patched_tree_and_compiles(trees, kind, tmp_path):
    if trees[kind] is None:
        pytest.skip(f"{tm.BUNDLE} is absent: the real upstream histories live in ../shared/upstream")
    catalog = tm.CATALOGS[kind]
    assert len([m for m in catalog if m.methods == ("ddtree",)]) == 10 and len({m.name for m in catalog}) == len(catalog)
    for mutant in catalog:
        out = tm.plant(trees[kind], mutant, tmp_path / mutant.name)
        for e in mutant.edits:
            text = (out / e.file).read_text()
            assert e.new in text and (e.old in e.new or e.old not in text), (mutant.name, e.old)
            py_compile.compile(str(out / e.file), doraise=True)
