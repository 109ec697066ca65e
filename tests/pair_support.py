"""The second trained pair (``tests/data/pair_b``): a pair that verify has never seen (no ``acceptance_floor.json``),
of another shape than the shipped one (see its ``metadata.json`` and docs/performance.md#the-second-pair).

``pair_b()`` returns ``(target folder, draft folder)``, as a user passes them: ``--target T --draft D``.
"""

from __future__ import annotations

from pathlib import Path

PAIR_B = Path(__file__).resolve().parent / "data" / "pair_b"


def pair_b() -> tuple[Path, Path]:
    return PAIR_B / "target", PAIR_B / "draft"
