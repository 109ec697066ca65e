"""Nothing heavy is computed twice per verify: the greedy reference's own forwards give the noise floor's
token-by-token rows and the drafter oracle's token-by-token features, and one from-scratch forward over a committed
sequence serves the mask-id search, the noise floor, every method's logits oracle and its drafter oracle
(``oracle.plain_forward``). Each shared figure must be exactly the one computed apart; a routed target's forwards
(which may follow a decode's experts) are never shared."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from patcher.verify.judge import calibration, logits as oracle
from patcher.verify.judge.drafter import recorder as drafter_oracle
from patcher.verify.models import load as models
from patcher.verify.models.presets import build_target


def _draft_class():
    """vendored/dflash's drafter class (its package set aside again: other tests import their own ``dflash``)."""
    root = str(Path(__file__).resolve().parent.parent / "vendored" / "dflash")
    saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] == "dflash"}
    sys.path.insert(0, root)
    try:
        from dflash.model import DFlashDraftModel

        return DFlashDraftModel
    finally:
        sys.path.remove(root)
        for m in [m for m in sys.modules if m.split(".")[0] == "dflash"]:
            del sys.modules[m]
        sys.modules.update(saved)


def _reference(name="tiny-qwen3_5", n=2):
    target = build_target(name)
    prompts = models.random_prompts(n, 8, 0, 60)
    return target, prompts


def test_greedy_hands_out_the_rows_and_hidden_states_it_computed_and_decodes_the_same():
    target, prompts = _reference()
    rows, hidden = [], []
    plain = models.greedy(target, prompts[0], 12)
    shared = models.greedy(target, prompts[0], 12, rows=rows, hidden=hidden)
    assert shared == plain and len(rows) == 12
    # one hidden-states tuple per forward: the prompt, then every new token, the last one too (the features the
    # drafter sees at the end of the sequence)
    assert len(hidden) == 1 + 12 and sum(h[0].shape[1] for h in hidden) == prompts[0].shape[1] + 12
    assert [int(r.argmax()) for r in rows] == plain


def test_the_floor_from_greedys_rows_is_the_floor_computed_apart():
    target, prompts = _reference()
    stepped = [[] for _ in prompts]
    refs = [models.greedy(target, p, 12, rows=r) for p, r in zip(prompts, stepped)]
    oracle.forget_plain()
    apart = calibration.calibrate(target, prompts, refs)
    shared = calibration.calibrate(target, prompts, refs, stepped=stepped)
    assert shared.as_dict() == apart.as_dict()
    assert apart.measured > 0, "float32: the two ways differ by a few ulps, a floor that is not measured would miss it"


def test_the_drafter_floor_from_greedys_hidden_states_is_the_floor_computed_apart():
    target, prompts = _reference()
    draft = models.build_drafter(_draft_class(), target, 4, 63)
    hidden: list = []
    ref = models.greedy(target, prompts[0], 12, hidden=hidden)
    apart = drafter_oracle.calibrate(target, draft, prompts[0], ref, 63, 4)
    shared = drafter_oracle.calibrate(target, draft, prompts[0], ref, 63, 4, hidden)
    assert shared.as_dict() == apart.as_dict()
    # hidden states of another sequence are not taken for this one's
    other = drafter_oracle.calibrate(target, draft, prompts[0], ref, 63, 4, hidden[:-1])
    assert other.as_dict() == apart.as_dict()


def test_one_from_scratch_forward_serves_every_oracle_of_a_committed_sequence():
    target, prompts = _reference()
    sequence = prompts[0][0].tolist() + models.greedy(target, prompts[0], 12)
    oracle.forget_plain()
    with torch.inference_mode():
        direct = target(torch.tensor([sequence]), use_cache=False, output_hidden_states=True)
    before = dict(oracle.plain_stats)
    logits = oracle.reference_logits(target, sequence)
    again = oracle.reference_logits(target, sequence)  # a second method's logits oracle
    shared = oracle.plain_forward(target, sequence, hidden_states=True)  # the drafter oracle's Reference asks for this
    assert oracle.plain_stats["ran"] - before["ran"] == 1 and oracle.plain_stats["shared"] - before["shared"] == 2
    assert torch.equal(logits, direct.logits[0].float()) and again is logits
    assert all(torch.equal(a, b) for a, b in zip(shared[1], direct.hidden_states))
    # another sequence is another forward; the oldest is forgotten past PLAIN_KEEP
    for extra in range(oracle.PLAIN_KEEP):
        oracle.reference_logits(target, sequence[: -1 - extra])
    ran = oracle.plain_stats["ran"]
    oracle.reference_logits(target, sequence)
    assert oracle.plain_stats["ran"] == ran + 1


def test_a_routed_targets_forwards_are_never_shared():
    target = build_target("tiny-qwen3_5-moe")
    prompts = models.random_prompts(1, 8, 0, 60)
    sequence = prompts[0][0].tolist() + [1, 2, 3]
    assert oracle.plain_forward(target, sequence) is None
    before = dict(oracle.plain_stats)
    oracle.reference_logits(target, sequence)
    assert oracle.plain_stats == before
