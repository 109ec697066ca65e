"""One typed check: the row every oracle makes and every report format renders.

A ``Check`` is a verdict with its evidence and figures: ``lossless: ddtree`` passed, on what evidence, with which
numbers. Verify's oracles make them in the child, serialise them (``to_json``) onto the result the parent reads,
and the renderers (text, JSON, HTML, SARIF, JUnit) read them back (``from_json``) to show them. The JSON is the
row the verify report has always printed: ``{"check": NAME, "passed": BOOL, "evidence": TEXT, ...figures}``, its
keys in the order the oracle wrote them, so that a report stays byte-for-byte what it was.

This module imports only the stdlib: the verifier's child loads it inside its private package (it imports
nothing of ``patcher``), and ``patcher.results`` re-exports it for the renderers (``tools/import_graph.py``
places it on the bottom layer: ``SHARED_LEAVES``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

#: The statuses a check shows, from its ``passed`` and the flags its figures carry.
PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
CONTROL, INFO, SKIP, WARNING = "control", "info", "skip", "warning"
#: A passing check's flags, first match wins: what the row is besides a pass (a control run that passes whatever it
#: shows, a figure with nothing to judge it against, an oracle that could not judge, a finding that fails nothing).
PASSING_FLAGS = (("control", CONTROL), ("info", INFO), ("skipped", SKIP), ("warning", WARNING))
#: The keys a check's JSON row names itself with; every other key is a figure.
OWN_KEYS = ("check", "passed", "evidence")


@dataclass(frozen=True)
class Check:
    """A verdict (``passed``), its ``evidence`` (text; an error summary dict on a few crash rows; None: the row has
    none) and its ``figures`` (every other key of the row: flags such as ``inconclusive``, the decoder it names,
    histograms, tolerances). ``status`` is what a report shows for it."""

    name: str
    passed: bool
    evidence: Any = None
    figures: Mapping[str, Any] = field(default_factory=dict)
    #: The JSON row's keys in the order they are written (kept so that a report stays byte-for-byte what it was);
    #: empty: check, passed, evidence, then the figures.
    layout: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "figures", MappingProxyType(dict(self.figures)))

    # ------------------------------------------------------------------ making one
    @classmethod
    def of(cls, name: str, **fields: Any) -> "Check":
        """``Check.of("lossless: ddtree", passed=True, evidence="4/4 runs token-identical", decoder={...})``: the
        keyword order is the JSON's key order (``passed`` is required)."""
        return cls.from_json({"check": name, **fields})

    def with_(self, **fields: Any) -> "Check":
        """This check with ``fields`` set as ``dict.update`` would: a key it has keeps its place, a new one goes last."""
        return Check.from_json({**self.to_json(), **fields})

    # ------------------------------------------------------------------ reading one
    @property
    def status(self) -> str:
        """pass, fail, inconclusive (a failure that could not judge in this setting: never a pass), or a passing
        row's flag: control, info, skip, warning."""
        if not self.passed:
            return INCONCLUSIVE if self.figures.get("inconclusive") else FAIL
        return next((word for key, word in PASSING_FLAGS if self.figures.get(key)), PASS)

    def get(self, key: str, default: Any = None) -> Any:
        """A key of the JSON row (``check``, ``passed``, ``evidence`` or a figure), as ``dict.get`` reads it."""
        if key in OWN_KEYS:
            value = {"check": self.name, "passed": self.passed, "evidence": self.evidence}[key]
            return default if value is None and key == "evidence" else value
        return self.figures.get(key, default)

    # ------------------------------------------------------------------ the JSON row
    def to_json(self) -> dict[str, Any]:
        """The row as the verify report prints it (a fresh dict: the parent may settle it further)."""
        values = {"check": self.name, "passed": self.passed, **self.figures}
        if self.evidence is not None:
            values["evidence"] = self.evidence
        order = [k for k in self.layout if k in values] or list(OWN_KEYS)
        order += [k for k in values if k not in order]
        return {k: values[k] for k in order if k in values}

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> "Check":
        """A row of a verify report (or of ``ci``'s verify summary, whose rows also name their ``model``)."""
        if "check" not in row or "passed" not in row:
            raise ValueError(f"not a check row (it needs 'check' and 'passed'): {sorted(row)}")
        figures = {k: v for k, v in row.items() if k not in OWN_KEYS}
        return cls(row["check"], row["passed"], row.get("evidence"), figures, tuple(row))


def checks_of(rows) -> list[Check]:
    """JSON rows (a verify report's, or ``ci``'s verify summary's) as Checks: what the renderers read."""
    return [row if isinstance(row, Check) else Check.from_json(row) for row in rows]


def rows(checks) -> list[dict[str, Any]]:
    """Checks as the JSON rows a result carries (a row already JSON passes through)."""
    return [c.to_json() if isinstance(c, Check) else c for c in checks]
