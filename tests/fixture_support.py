"""Run one codemod on one source text, as the fixture tests and the regeneration script do."""

from __future__ import annotations

import json
from pathlib import Path

from patcher.codemods import CODEMODS
from patcher.engine import transform_source
from patcher.recipe import StepSpec

FIXTURES = Path(__file__).parent / "fixtures"


def run_codemod(codemod: str, text: str, **params):
    spec = StepSpec(id=codemod, codemod=codemod, why="", params=params)
    return transform_source(text, [(spec, CODEMODS[codemod])], in_package=False)


def params_of(text: str) -> dict:
    """A fixture may start with ``# fixture-params: {json}`` to run the codemod with recipe parameters."""
    first = text.split("\n", 1)[0]
    prefix = "# fixture-params:"
    return json.loads(first[len(prefix):]) if first.startswith(prefix) else {}


def cases():
    """(codemod, input path) for every fixture; the expected output sits beside it as ``.py.out``."""
    return [(d.name, p) for d in sorted(FIXTURES.iterdir()) if d.is_dir() for p in sorted(d.glob("*.py"))]


if __name__ == "__main__":  # regenerate the expected outputs; review the diff before committing
    for codemod, path in cases():
        text = path.read_text()
        new, _sites, _ = run_codemod(codemod, text, **params_of(text))
        path.with_suffix(".py.out").write_text(new)
        print(path.relative_to(FIXTURES))
