"""The mutation check's catalog stays runnable: each mutant's text is in the code exactly once.

``benchmarks/mutants.py`` reports a mutant whose text it cannot place (found 0 times, or more than
once) as ``stale`` and scores nothing for it; only a whole mutation run would show that. This test
shows it in the suite, the moment a change to the code moves a mutant's text, and names the mutant.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # mutants.py imports mutant_catalog by this name: the same module object
    spec.loader.exec_module(module)
    return module


catalog = _load("mutant_catalog")
mutants = _load("mutants")


def test_each_mutants_text_is_in_its_file_exactly_once():
    stale = []
    for mutant in catalog.MUTANTS:
        where, why = mutants.locate(ROOT, mutant)
        if where is None:
            stale.append(f"{mutant.id} ({mutant.what}) in {mutant.path}: {why}")
        elif mutant.old == mutant.new:
            stale.append(f"{mutant.id} changes nothing")
    assert not stale, "stale mutants in benchmarks/mutant_catalog.py:\n" + "\n".join(stale)


def test_ids_are_unique_and_every_group_has_its_tests():
    ids = [m.id for m in catalog.MUTANTS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for group in {m.group for m in catalog.MUTANTS}:
        assert group in catalog.GROUP_TESTS, f"group {group} lists no tests"
        for test in catalog.GROUP_TESTS[group]:
            assert (ROOT / test.split("::")[0]).is_file(), f"group {group} lists {test}, which does not exist"
