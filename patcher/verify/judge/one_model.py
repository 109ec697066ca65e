"""The checks on one model: ``verify_model`` runs the decode loop (``decode_loop``) and asks each oracle for its rows.

First the reference's own soundness (cached against no-cache greedy, a multi-token forward against token-by-token:
``tokens``) and the noise floor (``calibration``), then the warm-up; then, per method, each oracle of ``ORACLES``
judges the method's runs and returns its rows: token identity, the logits against one from-scratch forward, whether
the run could see a rollback bug, the drafter against a from-scratch drafter forward, acceptance against what a
correct decoder reaches, and under sampling the distribution of the second new token. Line coverage (``coverage``)
is recorded around each decode; the parent makes its rows."""

from __future__ import annotations

from . import distribution, logits, rollback, tokens
from .acceptance import verdict as acceptance
from .calibration import floor_row
from .decode_loop import DecodeLoop, decoder_row, sampling_of  # noqa: F401 (sampling_of: the worker's)
from .drafter import verdict as drafter

#: The oracles that judge a method's runs, in the order its rows are shown. Each has ``method_rows(loop, method,
#: earlier)``: its rows for the method (none where it does not apply), given the rows the oracles before it made.
ORACLES = (tokens, logits, rollback, drafter, acceptance, distribution)


def verify_model(label: str, cfg: dict, loaded, target, drafts: dict, mask_token_id, is_preset: bool, prompts,
                 scripted: bool = False, choose_mask: bool = False, notes: dict | None = None) -> dict:
    """The model's result: its check rows (``Check`` JSON rows) and figures. ``notes``: drafter classes the verifier
    could not build (``drafter class NAME`` rows)."""
    checks = [drafter.class_row(name, why, is_preset) for name, why in (notes or {}).items()]
    loop = DecodeLoop(label, cfg, loaded, target, drafts, mask_token_id, is_preset, prompts, scripted, choose_mask)
    checks += tokens.reference_rows(loop) + [floor_row(loop.cal, cfg)]
    checks += loop.drop_unsampleable() + loop.warm_up()
    if loop.methods:
        loop.decode_prompts()
        loop.distributions = distribution.sample(loop)
        loop.floors = acceptance.floors(loop)
        for method in loop.methods:
            rows: list[dict] = []
            for oracle in ORACLES:
                rows += oracle.method_rows(loop, method, rows)
            checks += [decoder_row(row, method) for row in rows]
    return loop.result(checks)
