"""Anchors a tree does not define, for the steps that only tidy a benchmark (after stage 5, ``classify``).

A layout names its decoder functions among its own anchors (``[upstreams.X] anchors``); a step may also be
anchored to a benchmark's helper (``cuda_time``, ``main``, ``_prepare_dataset``). A fork that dropped or
renamed such a helper has not broken the decoder: the step still runs on every file and reports the sites
it finds wherever they are. So an anchor that is absent, is not one of the layout's own, and belongs to a
step that does not keep the tree lossless is settled here rather than failed:

* the step found sites elsewhere: they answer for it (the anchor is dropped from the step's rows);
* it found none, and no file of the tree passes the step's prefilter (``Step.triggers`` and
  ``Step.may_match``, which never turn away a file with a site): ``fixed-upstream``, nothing to do;
* it found none, but a file passes the prefilter: the step's form is there in a shape it did not
  match, and the anchor stays ``no-match``, naming that file.

A decoder anchor (``dflash_generate``, DDTree's ``compact_dynamic_cache``) and every anchor of a lossless
step stays required: its absence is a ``no-match``, as ``classify`` said.
"""

from __future__ import annotations

import re

from ..results import (
    ALREADY_APPLIED,
    APPLIED,
    FIXED_UPSTREAM,
    NO_MATCH,
    SKIPPED,
    Report,
    Site,
)
from .prefilter import prefilter, prefilter_tree
from .recipe import StepSpec


def settle_absent_anchors(report: Report, specs: list[tuple[StepSpec, type]], texts: dict[str, str]) -> None:
    """Settle, in place, each absent benchmark anchor of ``report`` (see the module docstring)."""
    recipe, upstream = report.recipe, report.upstream
    if upstream is None:
        return
    required = set(recipe.upstreams[upstream].anchors)
    by_id = {spec.id: (spec, cls) for spec, cls in specs}
    for step in report.steps:
        if step.spec.id in recipe.lossless or step.spec.id not in by_id:
            continue
        absent = [a for a in step.anchors if a.status == NO_MATCH and a.path is None and a.function not in required]
        if not absent:
            continue
        found = [s for s in step.sites if s.status != NO_MATCH]
        if found:
            step.anchors = [a for a in step.anchors if a not in absent]
        else:
            spec, cls = by_id[step.spec.id]
            shaped = sorted(p for p, t in texts.items() if prefilter_tree(t, prefilter(t, [(spec, cls)])))
            for a in absent:
                if shaped:
                    a.message = (f"`{a.function}` is not in the tree, and {', '.join(shaped[:3])} "
                                 f"{'has' if len(shaped) == 1 else 'have'} {cls.looks_for({**cls.PARAMS, **spec.params})} in a "
                                 "form this step did not match: edit it by hand, or leave the file out with --exclude if no "
                                 "decoder imports it")
                else:
                    a.status = FIXED_UPSTREAM
                    a.message = (f"`{a.function}` is not in the tree, and no file has "
                                 f"{cls.looks_for({**cls.PARAMS, **spec.params})}: nothing to do")
        step.status = _status([a.status for a in step.anchors] + [s.status for s in step.sites])


def settle_unanchored(report: Report, specs: list[tuple[StepSpec, type]], texts: dict[str, str]) -> None:
    """With no layout detected, no anchor says where a step must act: a step that only tidies a benchmark and found no
    site is no finding. No file passes its prefilter: ``fixed-upstream``, nothing to do (the tree has no form it
    rewrites); a file does: ``no-match`` naming that file, as for an absent anchor. A lossless step keeps its no-match."""
    if report.upstream is not None:
        return
    by_id = {spec.id: (spec, cls) for spec, cls in specs}
    for step in report.steps:
        if step.spec.id in report.recipe.lossless or step.spec.id not in by_id or step.sites or step.anchors:
            continue
        spec, cls = by_id[step.spec.id]
        shaped = sorted(p for p, t in texts.items() if prefilter_tree(t, prefilter(t, [(spec, cls)])))
        if shaped:
            what = cls.looks_for({**cls.PARAMS, **spec.params})
            step.sites = [Site(NO_MATCH, _first_line(texts[p], cls.triggers({**cls.PARAMS, **spec.params})), 0, None,
                               f"no layout was detected, and {p} has {what} in a form this step did not match: edit it by "
                               "hand, or leave the file out with --exclude if no decoder imports it", step.spec.id, p)
                          for p in shaped[:3]]
            step.status = NO_MATCH
        else:
            step.status = FIXED_UPSTREAM  # no site in the tree: no file has what the step rewrites, nothing to do


def place_unplaced(report: Report) -> None:
    """A lossless step's no-match that names no file and line (its layout's function is not in the tree, or no layout was
    detected and it found no site) names the decoders it found no site in, at the line where another step acts on them:
    the call a user routes by hand is there."""
    decoders = sorted(set(report.decoders))
    for step in report.steps:
        if step.status != NO_MATCH or step.spec.id not in report.recipe.lossless:
            continue
        own = {s.path for s in step.sites if s.status != NO_MATCH}
        bare = [a for a in step.anchors if a.status == NO_MATCH and a.path is None]
        if not decoders or not bare and (step.anchors or step.sites):
            continue
        where = []
        for path in (d for d in decoders if d not in own):
            near = sorted((s for t in report.steps if t is not step for s in t.sites if s.path == path), key=lambda s: s.line)
            line, fn = (near[0].line, near[0].function) if near else (1, None)
            said = (f" (where {near[0].step} acts, in `{fn}`)" if fn else f" (where {near[0].step} acts)") if near else ""
            where.append((path, line, fn, f"{path}:{line}{said}"))
        if not where:
            continue
        shown = "; ".join(w for *_, w in where[:3])
        for a in bare:  # the anchor keeps no file (its function is not in the tree); its message says where to look
            a.message += f"; this step found no call to route in the decoders: {shown}"
        if not step.anchors and not step.sites:
            step.sites = [Site(NO_MATCH, line, 0, fn, f"no site of this step in the decoder {path}{w[len(path) + len(str(line)) + 1:]}: "
                               "the call it routes is not one data flow reads (route it by hand)", step.spec.id, path)
                          for path, line, fn, w in where[:3]]


def _first_line(text: str, patterns) -> int:
    """The line of the first match of any of the step's trigger ``patterns`` in ``text`` (1 if none)."""
    hits = [m.start() for m in (re.search(p, text) for p in patterns) if m]
    return text.count("\n", 0, min(hits)) + 1 if hits else 1


def _status(statuses: list[str]) -> str:
    for status in (NO_MATCH, SKIPPED, APPLIED, ALREADY_APPLIED, FIXED_UPSTREAM):
        if status in statuses:
            return status
    return NO_MATCH
