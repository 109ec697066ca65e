"""The verifier's oracle and the scripted draft that makes its test able to fail.

``compare`` is the lossless check: speculative greedy output must be token-identical to
the target's own greedy decoding; when it is not, it names the first divergence.

``ScriptedDraft`` makes rollback happen. A random draft is rejected at the first token
almost every round, so a broken rollback is never exercised. The scripted draft knows
the target's greedy continuation and, per proposed position, puts the true token at rank
0, rank 1, or nowhere (probabilities about 0.6 / 0.25 / 0.15): partial acceptances, and
for trees, accepted siblings. It still runs the draft model (so the draft's own cache
path is exercised) and only replaces its output hidden states with ones that the
target's ``lm_head`` maps to the scripted logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

RANK_PROBS = (0.6, 0.25, 0.15)


@dataclass(frozen=True)
class Verdict:
    identical: bool
    first_divergence: int | None = None  # index into the new tokens
    expected: int | None = None  # target greedy token there (None: speculative output is longer)
    got: int | None = None  # speculative token there (None: speculative output is shorter)
    expected_len: int = 0
    got_len: int = 0

    def describe(self) -> str:
        if self.identical:
            return f"token-identical ({self.got_len} tokens)"
        i = self.first_divergence
        if self.expected is None:
            return f"longer than target greedy: {self.got_len} vs {self.expected_len} tokens (extra token {self.got} at {i})"
        if self.got is None:
            return f"shorter than target greedy: {self.got_len} vs {self.expected_len} tokens (missing {self.expected} at {i})"
        return f"diverges at new token {i}: target greedy {self.expected}, speculative {self.got}"

    def as_dict(self) -> dict:
        return {
            "identical": self.identical,
            "first_divergence": self.first_divergence,
            "expected": self.expected,
            "got": self.got,
            "expected_len": self.expected_len,
            "got_len": self.got_len,
        }


def compare(expected: Sequence[int], got: Sequence[int]) -> Verdict:
    """Token-identity of two greedy continuations; the first divergence if they differ."""
    expected, got = list(expected), list(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return Verdict(False, i, a, b, len(expected), len(got))
    if len(expected) == len(got):
        return Verdict(True, None, None, None, len(expected), len(got))
    i = min(len(expected), len(got))
    return Verdict(
        False,
        i,
        expected[i] if i < len(expected) else None,
        got[i] if i < len(got) else None,
        len(expected),
        len(got),
    )


class ScriptedDraft:
    """Forward hook on a draft model that proposes the target's greedy continuation with scripted ranks.

    ``reference`` is the full greedy sequence (prompt + continuation) as a list of ids.
    The hook reads the block's positions from the draft call's ``position_ids``: the last
    ``q_len`` positions are the block, whose first token is already committed.
    """

    def __init__(self, target, reference: Sequence[int], seed: int, forbidden: Sequence[int] = (), margin: float = 8.0):
        import torch

        self.reference = list(reference)
        weight = target.get_output_embeddings().weight.detach().float()
        self.vocab = weight.shape[0]
        self.solve = torch.linalg.pinv(weight)  # [hidden, vocab]: h = pinv(W) @ z gives W h = z on W's range
        self.gen = torch.Generator().manual_seed(10_007 + seed)
        self.forbidden = set(int(t) for t in forbidden)
        self.margin = margin
        self.ranks: list[int] = []

    def _other(self, avoid: set[int]) -> int:
        import torch

        while True:
            t = int(torch.randint(0, self.vocab, (1,), generator=self.gen))
            if t not in avoid and t not in self.forbidden:
                return t

    def logits_for(self, position: int):
        """Scripted logits for the token at absolute ``position``."""
        import torch

        z = torch.zeros(self.vocab)
        z += 0.01 * torch.randn(self.vocab, generator=self.gen)
        true = self.reference[position] if position < len(self.reference) else self._other(set())
        roll = float(torch.rand((), generator=self.gen))
        rank = 0 if roll < RANK_PROBS[0] else 1 if roll < RANK_PROBS[0] + RANK_PROBS[1] else 2
        self.ranks.append(rank)
        other = self._other({true})
        if rank == 0:
            z[true], z[other] = self.margin, self.margin / 2
        elif rank == 1:
            z[other], z[true] = self.margin, self.margin * 0.75
        else:
            z[other], z[self._other({true, other})] = self.margin, self.margin * 0.75
            z[true] = -self.margin
        for t in self.forbidden:
            z[t] = 0.0
        return z

    def __call__(self, module, args, kwargs, output):
        import torch

        hidden = output[0] if isinstance(output, tuple) else output
        positions = kwargs.get("position_ids")
        if positions is None or hidden.dim() != 3:
            return output
        q_len = hidden.shape[1]
        block = positions[0, -q_len:].tolist()
        rows = [self.logits_for(p) for p in block[1:]]
        scripted = (self.solve @ torch.stack(rows).T).T.to(hidden.dtype).to(hidden.device)
        new = hidden.clone()
        new[0, 1:, :] = scripted
        return (new, *output[1:]) if isinstance(output, tuple) else new

    def attach(self, draft):
        return draft.register_forward_hook(self, with_kwargs=True)
