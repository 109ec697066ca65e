"""Run one codemod on one source text, as the fixture tests and the regeneration script do.

A fixture is ``tests/fixtures/<codemod>/<case>.py``; beside it ``<case>.py.out`` holds the
expected output and ``<case>.py.status`` the expected sites, one ``LINE STATUS`` per line
(the statuses a user sees: a site whose code already has the step's output form is
``already-applied`` when the fixture carries ddpatch's provenance line for the step, else
``fixed-upstream``).
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


if __name__ == "__main__":  # regenerate the expected outputs and statuses; review the diff before committing
    for codemod, path in cases():
        text = path.read_text()
        new, sites, _ = run_codemod(codemod, text, **params_of(text))
        path.with_suffix(".py.out").write_text(new)
        path.with_suffix(".py.status").write_text("".join(line + "\n" for line in statuses(codemod, text, sites)))
        print(path.relative_to(FIXTURES))
