"""Requirements for CI's environments, read from pyproject.toml, so that CI has no second copy of them.

    python3 .ci/requirements.py spec transformers accelerate libcst
        # one requirement per name, as pyproject.toml writes it: transformers>=5.21,<5.26 ...
    python3 .ci/requirements.py env [--floor NAME ...] [--pin NAME==VERSION ...]
        # every dependency and the test extra, one per line; --floor NAME installs NAME at the
        # lowest release pyproject.toml allows (torch>=2.6 -> torch==2.6.0); --pin replaces NAME
    python3 .ci/requirements.py floor torch
        # the lowest release pyproject.toml allows: 2.6.0

Exit status 1 for a name pyproject.toml does not list, 2 for a usage error.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirements() -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["test"]]


def name_of(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def find(name: str) -> str:
    found = [r for r in requirements() if name_of(r) == name.lower()]
    if not found:
        sys.exit(f"requirements.py: error: pyproject.toml lists no {name!r}")  # exit 1
    return found[0].replace(" ", "")


def floor(name: str) -> str:
    """The release the lower bound names, padded to three parts: ``torch>=2.6`` -> ``2.6.0``."""
    match = re.search(r">=\s*([\d.]+)", find(name))
    if not match:
        sys.exit(f"requirements.py: error: {name} has no lower bound in pyproject.toml")
    parts = match.group(1).split(".")
    return ".".join(parts + ["0"] * (3 - len(parts)))


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("spec", "env", "floor"):
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "spec":
        print("\n".join(find(n) for n in rest))
    elif command == "floor":
        print("\n".join(floor(n) for n in rest))
    else:
        replace: dict[str, str] = {}
        while rest:
            option, value, rest = rest[0], rest[1], rest[2:]
            if option == "--floor":
                replace[value.lower()] = f"{value}=={floor(value)}"
            elif option == "--pin":
                replace[name_of(value)] = value
            else:
                print(f"requirements.py: error: unknown option {option}", file=sys.stderr)
                return 2
        print("\n".join(replace.get(name_of(r), r.replace(" ", "")) for r in requirements()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
