"""Stage 2 of the pipeline: the prefilters that keep most files away from LibCST.

First the text: a step's trigger regexes must all match a file's text (``Step.triggers``).
Then, for the steps that check a tree, the stdlib ``ast``: ``Step.may_match`` on one
``ast.parse`` of the file. Neither may turn away a file where its step has a site
(tests/test_properties.py, tests/test_corpus.py).
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import Iterable

from .codemods.base import Step
from .recipe import StepSpec

_PATTERNS: dict[str, "_Trigger"] = {}
_STEP_TRIGGERS: dict[int, tuple[StepSpec, list["_Trigger"]]] = {}
_WORDS = re.compile(r"(?:\w|\\[(.])+(?:\|(?:\w|\\[(.])+)*")


class _Trigger:
    """One trigger regex; an alternation of plain words (``a|b\\(``) is tested with ``in``, which
    ``re`` cannot beat: it tries every alternative at every position of the file."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.words = [w.replace("\\", "") for w in pattern.split("|")] if _WORDS.fullmatch(pattern) else None
        self.regex = None if self.words else re.compile(pattern)

    def found(self, text: str) -> bool:
        if self.words is not None:
            return any(w in text for w in self.words)
        return self.regex.search(text) is not None


def _triggers(spec: StepSpec, cls: type) -> list[_Trigger]:
    """A step's triggers, compiled once per spec (a spec's parameters do not change)."""
    entry = _STEP_TRIGGERS.get(id(spec))
    if entry is None or entry[0] is not spec:
        entry = _STEP_TRIGGERS[id(spec)] = (spec, [_PATTERNS.setdefault(t, _Trigger(t)) for t in cls.triggers({**cls.PARAMS, **spec.params})])
    return entry[1]


def prefilter(text: str, steps: Iterable[tuple[StepSpec, type]]) -> list[tuple[StepSpec, type]]:
    """The steps whose trigger patterns all match ``text``; a file no step wants is never parsed.

    A pattern several steps share is searched once per file.
    """
    out = []
    seen: dict[int, bool] = {}
    for spec, cls in steps:
        for trigger in _triggers(spec, cls):
            hit = seen.get(id(trigger))
            if hit is None:
                hit = seen[id(trigger)] = trigger.found(text)
            if not hit:
                break
        else:
            out.append((spec, cls))
    return out


def prefilter_tree(text: str, steps: list[tuple[StepSpec, type]]) -> list[tuple[StepSpec, type]]:
    """Of ``steps``, those whose ``may_match`` holds on the file's stdlib ``ast``.

    The text is parsed by ``ast`` only if one of the steps checks a tree; a file ``ast``
    cannot parse keeps its steps, so that LibCST reports the error.
    """
    if not any(cls.may_match.__func__ is not Step.may_match.__func__ for _, cls in steps):
        return steps
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings of upstream code are not ours to print
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return steps
    return [(spec, cls) for spec, cls in steps if cls.may_match(tree, {**cls.PARAMS, **spec.params})]
