"""Run one codemod on one source text, as the fixture tests and the regeneration script do.

A fixture is ``tests/fixtures/<codemod>/<case>.py``; beside it ``<case>.py.out`` holds the
expected output and ``<case>.py.status`` the expected sites, one ``LINE STATUS`` per line
(the statuses a user sees: a site whose code already has the step's output form is
``already-applied`` when the fixture carries ddpatch's provenance line for the step, else
``fixed-upstream``).

The ``.py.out`` and ``.py.status`` files were first written by running the codemod itself
(``python tests/fixture_support.py --write``): they are what the code did when they were
made, so they are expectations only because someone reviewed them. See tests/fixtures/README.md
for how to add and review one; ``python tests/fixture_support.py [CASE ...]`` shows, as a
diff, what the codemod would change in them today without writing anything.
"""

from __future__ import annotations

import json
from pathlib import Path

from patcher.engine.codemods import CODEMODS
from patcher.engine.codemods.base import ALREADY_APPLIED, FIXED_UPSTREAM, PATCHED
from patcher.engine.files import read_provenance
from patcher.engine.pipeline import transform_source
from patcher.engine.recipe import StepSpec

FIXTURES = Path(__file__).parent / "fixtures"


def run_codemod(codemod: str, text: str, **params):
    spec = StepSpec(id=codemod, codemod=codemod, why="", params=params)
    return transform_source(text, [(spec, CODEMODS[codemod])], in_package=False)


def params_of(text: str) -> dict:
    """A fixture may start with ``# fixture-params: {json}`` to run the codemod with recipe parameters."""
    first = text.split("\n", 1)[0]
    prefix = "# fixture-params:"
    return json.loads(first[len(prefix):]) if first.startswith(prefix) else {}


def statuses(codemod: str, text: str, sites) -> list[str]:
    """``LINE STATUS`` for every site, as the engine reports them (patched -> already-applied / fixed-upstream)."""
    recorded = read_provenance(text)
    out = []
    for site in sites:
        status = site.status
        if status == PATCHED:
            status = ALREADY_APPLIED if codemod in recorded else FIXED_UPSTREAM
        out.append(f"{site.line} {status}")
    return sorted(out, key=lambda s: (int(s.split()[0]), s))


def expected_statuses(path: Path) -> list[str]:
    sidecar = path.with_suffix(".py.status")
    lines = sidecar.read_text().splitlines() if sidecar.exists() else []
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def cases():
    """(codemod, input path) for every fixture; the expected output sits beside it as ``.py.out``."""
    return [(d.name, p) for d in sorted(FIXTURES.iterdir()) if d.is_dir() for p in sorted(d.glob("*.py"))]


def main(argv: list[str]) -> int:
    """Show (default) or ``--write`` what the codemod makes of each fixture, for review."""
    import difflib

    write = "--write" in argv
    chosen = [a for a in argv if a != "--write"]
    changed = 0
    for codemod, path in cases():
        name = str(path.relative_to(FIXTURES))
        if chosen and not any(name.startswith(c) for c in chosen):
            continue
        text = path.read_text()
        new, sites, _ = run_codemod(codemod, text, **params_of(text))
        wanted = {".py.out": new, ".py.status": "".join(line + "\n" for line in statuses(codemod, text, sites))}
        for suffix, content in wanted.items():
            target = path.with_suffix(suffix)
            old = target.read_text() if target.exists() else ""
            if old == content:
                continue
            changed += 1
            print("".join(difflib.unified_diff(old.splitlines(True), content.splitlines(True), name + suffix, name + suffix + " (now)")))
            if write:
                target.write_text(content)
    print(f"{changed} file(s) {'written' if write else 'would change (run with --write to write them)'}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))


#: a chain decoder with no benchmark around it (no layout marker, timing, dataset or attention switch): the smallest
#: tree check takes for a decoder's (tests/test_forks_round3.py, tests/test_cache_surgery.py put beside it what they test)
CHAIN_DECODER = '''from transformers import DynamicCache


def chain_generate(target, drafter, ids, rounds):
    cache, draft_cache = DynamicCache(), DynamicCache()
    out = target(ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    for _ in range(rounds):
        block = drafter(target_hidden=out.hidden_states[-1], past_key_values=draft_cache, use_cache=True)
        out = target(block, past_key_values=cache, use_cache=True, output_hidden_states=True)
        cache.crop(ids.shape[1])
    return ids
'''
