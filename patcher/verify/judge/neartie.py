"""Near-ties told from bugs.

When a speculative greedy output parts from the target's greedy output, the target itself
decides whether that says anything about the decoder: one teacher-forced, from-scratch forward
over the speculative sequence gives, at every emitted position, the target's own logits for
that prefix. If every emitted token lies within ``epsilon`` (from the run's calibration) of
that position's argmax, each choice was a tie under this dtype's rounding: a **near-tie**, not
a loss. One emitted token further than ``epsilon`` from its argmax is a failure, as before.

A divergence where the target's greedy token is the drafter's mask token is its own event:
upstream's decoders drop the mask id from their output, so the outputs differ with no
rollback involved.

On a mixture-of-experts target the teacher-forced forward may follow the decode's expert
choice at routing flips (ties under rounding, ``routers``; its ``routing`` attribute says
where). A divergence at or after a followed flip is the flip's consequence: the greedy token
came from the other experts, so only the emitted tokens are judged, each within ``epsilon`` of
that position's argmax on the decode's experts (kind **routing**, which passes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class TieVerdict:
    kind: str  # "identical", "near-tie", "routing", "mask-token", "loss"
    ties: list[dict] = field(default_factory=list)  # position, greedy/argmax token, emitted token, gap, epsilon
    worst: dict | None = None  # the emitted position furthest from its argmax
    mask_at: int | None = None
    flip_at: int | None = None  # routing: the new token of the first followed routing flip

    @property
    def ok(self) -> bool:
        return self.kind in ("identical", "near-tie", "routing")

    def describe(self) -> str:
        if self.kind == "mask-token":
            return f"the target emitted the drafter's mask token at new token {self.mask_at}; upstream's decoders drop it"
        if self.kind == "routing":
            first = min((t["position"] for t in self.ties), default=None)
            return (f"diverges at new token {first} after a routing flip at new token {self.flip_at} (a tie under rounding, "
                    "followed): every emitted token within ε of the target's argmax on the decode's experts")
        if self.kind == "near-tie":
            t = self.ties[0]
            return (f"{len(self.ties)} near-tie(s): first at new token {t['position']} (tokens {t['argmax']} and {t['emitted']}, "
                    f"gap {t['gap']:.2e} <= ε {t['epsilon']:.2e}); every emitted token within ε of the target's argmax")
        if self.kind == "loss" and self.worst is not None:
            w = self.worst
            return (f"new token {w['position']}: emitted {w['emitted']} lies {w['gap']:.2e} below the target's argmax "
                    f"{w['argmax']} (ε {w['epsilon']:.2e}): not a tie")
        return self.kind

    def as_dict(self) -> dict:
        return {"kind": self.kind, "near_ties": self.ties, "worst": self.worst, "mask_at": self.mask_at, "flip_at": self.flip_at}


def judge_ties(reference_tokens: Sequence[int], new: Sequence[int], teacher_forced, prompt_len: int, epsilon: float,
               mask_token_id: int | None = None, stop_ids: Sequence[int] = (), max_new_tokens: int | None = None) -> TieVerdict:
    """``teacher_forced``: the target's from-scratch logits over prompt + ``new`` ([len, vocab])."""
    reference_tokens, new = list(reference_tokens), list(new)
    if reference_tokens == new:
        return TieVerdict("identical")
    first = next((i for i, (a, b) in enumerate(zip(reference_tokens, new)) if a != b), min(len(reference_tokens), len(new)))
    if mask_token_id is not None and first < len(reference_tokens) and reference_tokens[first] == mask_token_id:
        return TieVerdict("mask-token", mask_at=first)
    flips = getattr(getattr(teacher_forced, "routing", None), "followed", None) or []
    flip_at = min((f["position"] + 1 - prompt_len for f in flips), default=None)
    after_flip = flip_at is not None and flip_at <= first
    ties, worst = [], None
    for i, token in enumerate(new):
        row = teacher_forced[prompt_len - 1 + i]
        top = int(row.argmax())
        gap = float(row[top] - row[token])
        entry = {"position": i, "argmax": top, "emitted": int(token), "gap": gap, "epsilon": epsilon}
        if top != token:
            ties.append(entry)
        if worst is None or gap > worst["gap"]:
            worst = entry
    if first < len(new) and first < len(reference_tokens) and not after_flip:  # the divergence: greedy's token against the emitted one
        row = teacher_forced[prompt_len - 1 + first]
        gap = abs(float(row[reference_tokens[first]] - row[new[first]]))
        entry = {"position": first, "argmax": reference_tokens[first], "emitted": new[first], "gap": gap, "epsilon": epsilon}
        if not any(t["position"] == first for t in ties):
            ties.insert(0, entry)
        if gap > worst["gap"]:
            worst = entry
    if worst is not None and worst["gap"] > epsilon:
        return TieVerdict("loss", ties, worst)
    # the output must end where the target would end it: the token limit, or a stop token
    complete = (max_new_tokens is not None and len(new) >= max_new_tokens) or bool(new and new[-1] in set(stop_ids))
    if not complete or first >= len(new):
        return TieVerdict("loss", ties, worst)
    if after_flip:
        return TieVerdict("routing", sorted(ties, key=lambda t: t["position"]), worst, flip_at=flip_at)
    return TieVerdict("near-tie", sorted(ties, key=lambda t: t["position"]), worst)
