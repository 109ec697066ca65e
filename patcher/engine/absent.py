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

from ..results import ALREADY_APPLIED, APPLIED, FIXED_UPSTREAM, NO_MATCH, SKIPPED, Report
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


def _status(statuses: list[str]) -> str:
    for status in (NO_MATCH, SKIPPED, APPLIED, ALREADY_APPLIED, FIXED_UPSTREAM):
        if status in statuses:
            return status
    return NO_MATCH
