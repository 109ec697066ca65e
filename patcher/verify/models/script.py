"""The scripted draft: a drafter whose proposals the verifier decides, so that rollback happens.

A random draft is rejected at the first token almost every round, so a broken rollback is never
exercised. The scripted draft knows the target's greedy continuation and, per proposed position,
puts the true token at rank 0, rank 1, or nowhere (probabilities about 0.6 / 0.25 / 0.15): partial
acceptances, and for trees, accepted siblings. It still runs the tree's drafter (its cache path,
its features, its own class: DFlash2's selector included) and only decides the drafter's logits.

Where it writes: at the logits. The decoder turns the drafter's hidden states into logits with the
target's output head (``target.lm_head(hidden)``, ``model.compute_logits(hidden, head)``,
``_output_head(target)``); a forward hook on that head, outside any target forward and right after
a drafter call, returns the scripted rows. The margins are exact at any vocabulary size: nothing
solves for hidden states, so nothing grows with vocabulary x hidden^2 (a pseudo-inverse of a
248,320 x 5,120 head took hours). A decoder that never calls the head module on the drafter's
output (``F.linear`` on its weight) gets hidden states instead (``hidden`` mode): for each row the
least-norm hidden state that gives the scripted logits on the rows that matter (the true token,
the scripted competitors, and any token that would otherwise outrank them), solved on those few
rows only.

How it knows the block: the drafter's own inputs. Its position ids name the block's positions; the
block's first token (the round's bonus token, committed, not yet seen by any target forward) is
read off the drafter's noise embedding, row 0, which is the target's input embedding of that token
(times a scale), however the tree computed it (``embed_tokens(ids)``, ``F.embedding(ids, weight)``,
``weight[ids]``): the candidates are the best tokens of the target's last logits row for that
position (``DecodeContext.candidates``), then, if none matches, the whole table in chunks.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Sequence

from .context import DecodeContext

RANK_PROBS = (0.6, 0.25, 0.15)
#: Under sampling the scripted draft proposes from the target's own logits times this (its temperature halved): close to
#: the target's distribution, so that the rejection rule accepts most proposals, but sharp enough that its later rows
#: (computed for the previous rows' argmax) mostly meet the tokens it really proposes.
SAMPLING_SHARPEN = 2.0
#: Under sampling, the share of positions where the draft is confidently wrong (a rejection): rounds then accept
#: 1, 2, 3... proposals, as a rollback bug needs to show.
MISLEAD = 0.15
#: the drafter forward's parameter names for its inputs (``drafter_oracle.ROLES`` spells the same)
NOISE_NAMES = ("noise_embedding", "noise_embeds", "inputs_embeds")
POSITION_NAMES = ("position_ids",)
#: the least margin of a scripted token's logit over the rest (``ScriptedDraft.margin`` grows with the vocabulary)
MARGIN = 8.0
#: rows of the embedding table compared at once when the first token is searched in the whole table
SEARCH_CHUNK = 8192
#: sampled-mode rows kept per target (``_target_rows``)
ROWS_MEMO = 256
_ROWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class ScriptedDraft:
    """Hooks on a drafter (and the target's output head) that propose the target's greedy continuation
    with scripted ranks. ``reference`` is the full greedy sequence (prompt + continuation) as a list of ids."""

    def __init__(self, target, reference: Sequence[int], seed: int, forbidden: Sequence[int] = (), margin: float | None = None,
                 from_distribution: bool = False):
        import math

        import torch

        self.reference = list(reference)
        # after a near-tie the reference is the target's greedy continuation of the decoder's path, as far as
        # ``horizon``; it is computed lazily (``_extend``), as far as a block asks: every position holds the
        # token a whole computation would give (a cacheless greedy is a function of its prefix alone)
        self.horizon = len(self.reference)
        self.target = target
        self.head = target.get_output_embeddings()
        self.vocab = int(self.head.weight.shape[0])
        self.gen = torch.Generator().manual_seed(10_007 + seed)
        self.forbidden = set(int(t) for t in forbidden)
        # the scripted token's logit over the rest: its probability must dominate the whole vocabulary's noise floor, or a
        # tree's cumulative log-probabilities stay flat and its budget goes to siblings (a real vocabulary, 248,320 ids,
        # needs ln(vocab) more than a tiny one)
        self.margin = margin if margin is not None else max(MARGIN, math.log(self.vocab) + 4.0)
        self.ranks: list[int] = []
        # under sampling: propose from the target's own next-token logits on the decoder's actual context, sharpened,
        # so the draft is confident, the target's samples part from it now and then, and partial acceptances happen
        self.from_distribution = from_distribution
        self.rows = None
        self.context = DecodeContext(target)  # the decoder's committed path: the script follows it after a near-tie
        self.mode = "logits"  # "hidden" once a drafter call's logits never went through the head module
        # (block positions, scripted rows [q - 1, vocab]) from the last drafter call: every call of the head on the
        # drafter's output gets them (a tree may call it twice: its own logits, then DFlash2's propose), until the
        # next target forward begins; ``written`` says whether any head call took them
        self.pending = None
        self.written = False
        self.stats = {"drafter_calls": 0, "scripted_at_logits": 0, "scripted_at_hidden": 0, "unscripted": 0,
                      "first_token": {"candidates": 0, "table": 0, "unknown": 0}}
        self._names = None

    # ------------------------------------------------------------------ hooks
    def attach(self, draft):
        from .context import target_modules

        self._names = _input_names(draft)
        self.context.attach()
        return _Handles([
            draft.register_forward_pre_hook(self._before_draft, with_kwargs=True),
            draft.register_forward_hook(self._after_draft, with_kwargs=True),
            self.head.register_forward_hook(self._after_head),
            *[m.register_forward_pre_hook(self._target_begins) for m in target_modules(self.target)],
        ], self.context)

    def _target_begins(self, module, args):
        """A target forward: the rows of the last drafter call are spent (a head call after it is the target's)."""
        self._spend()

    def _spend(self):
        if self.pending is not None and not self.written:  # the last call's logits never went through the head module
            self.stats["unscripted"] += 1
            self.mode = "hidden"
        self.pending, self.written = None, False

    def _before_draft(self, module, args, kwargs):
        if self.context.depth:  # the drafter inside a target forward: not a proposal
            return
        self._spend()
        bound = _bind(self._names["signature"], args, kwargs)
        positions = bound.get(self._names["positions"]) if self._names["positions"] else None
        noise = bound.get(self._names["noise"]) if self._names["noise"] else None
        if positions is None or noise is None or noise.dim() != 3 or noise.shape[1] < 2:
            return
        q = noise.shape[1]
        block = positions.reshape(-1, positions.shape[-1])[0, -q:].tolist()
        start = block[0]
        self.stats["drafter_calls"] += 1
        self.context.tokens[start] = self._first_token(noise[0, 0], start)
        if self.from_distribution:
            self.rows = self._target_rows(block)
        else:
            self._follow(start, max(block) + 1)
        import torch

        self.pending = (block, torch.stack([self.logits_for(p) for p in block[1:]]))

    def _after_draft(self, module, args, kwargs, output):
        if self.mode != "hidden" or self.pending is None or self.written or self.context.depth:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        if not hasattr(hidden, "dim") or hidden.dim() != 3 or hidden.shape[1] < 2:
            return output
        rows = self.pending[1]
        n = min(rows.shape[0], hidden.shape[1] - 1)
        new = hidden.clone()
        new[0, -n:, :] = self._hidden_for(rows[-n:]).to(hidden.dtype).to(hidden.device)
        self.stats["scripted_at_hidden"] += 1
        return (new, *output[1:]) if isinstance(output, tuple) else new

    def _after_head(self, module, args, output):
        if self.context.depth or self.pending is None or not hasattr(output, "dim") or output.dim() not in (2, 3):
            return output
        rows = self.pending[1]
        view = output[0] if output.dim() == 3 else output  # [rows, vocab]: the tree may pass hidden[0, 1:] or hidden[:, 1:]
        n = min(rows.shape[0], view.shape[0])
        if n == 0 or view.shape[-1] != rows.shape[-1]:
            return output
        new = output.clone()
        (new[0] if new.dim() == 3 else new)[-n:, :] = rows[-n:].to(output.dtype).to(output.device)
        if not self.written:
            self.stats["scripted_at_logits"] += 1
            if self.mode == "hidden" and self.stats["scripted_at_hidden"]:
                self.stats["scripted_at_hidden"] -= 1  # written at the logits after all
        self.written = True
        return new

    # ------------------------------------------------------------------ the block's first token
    def _first_token(self, row, start: int) -> int:
        """The token whose input embedding (times a scale) ``row`` is: the target's best candidates for ``start``
        first, then the whole table; the reference's token where nothing matches."""
        import torch

        table = self.target.get_input_embeddings().weight
        row = row.detach().float().to(table.device)
        candidates = list(dict.fromkeys(self.context.candidates.get(start, []) + self.reference[start:start + 1]))
        if candidates:
            found = _proportional(row, table[torch.tensor(candidates, device=table.device)].float())
            if found is not None:
                self.stats["first_token"]["candidates"] += 1
                return candidates[found]
        best = None
        for lo in range(0, table.shape[0], SEARCH_CHUNK):
            found = _proportional(row, table[lo:lo + SEARCH_CHUNK].float())
            if found is not None:
                best = lo + found
                break
        if best is not None:
            self.stats["first_token"]["table"] += 1
            return best
        self.stats["first_token"]["unknown"] += 1
        return self.reference[start] if start < len(self.reference) else 0

    # ------------------------------------------------------------------ the scripted rows
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
        if self.rows is not None:
            z += self.rows[position - 1]
            if float(torch.rand((), generator=self.gen)) < MISLEAD:  # a confident wrong proposal now and then: a rejection
                other = self._other({int(z.argmax())})
                z[other] = float(z.max()) + self.margin / 2
            for t in self.forbidden:
                z[t] = z.min() - self.margin
            return z
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

    def _hidden_for(self, rows):
        """Least-norm hidden states whose head logits equal ``rows`` on the rows that matter: the scripted ones (far
        from the noise floor), then any token that outranks them, added until none does (a few rounds)."""
        import torch

        weight = self.head.weight.detach()
        out = []
        for z in rows:
            z = z.float()
            keep = set((z.abs() > 1.0).nonzero().flatten().tolist()) | set(self.forbidden)
            top = float(z.max())
            h = None
            for _ in range(6):
                idx = sorted(keep)
                w = weight[torch.tensor(idx, device=weight.device)].float().cpu()
                h = torch.linalg.lstsq(w, z[idx][:, None], driver="gelsd").solution[:, 0]  # the least-norm solution
                got = (weight @ h.to(weight.device, weight.dtype)).float().cpu()
                over = set((got > top - self.margin / 4).nonzero().flatten().tolist()) - keep
                if not over:
                    break
                z = z.clone()
                z[list(over)] = 0.0
                keep |= over
            out.append(h)
        return torch.stack(out)

    def _follow(self, start: int, end: int) -> None:
        """Greedy: if the decoder's committed path has left the reference (a near-tie), continue the reference
        with the target's greedy decoding from that path; the block reads positions up to ``end``."""
        self._extend(start + 1)
        prefix = self.context.prefix(start, self.reference)
        if prefix != self.reference[: len(prefix)]:
            self.horizon = max(self.horizon, len(prefix)) + 8
            self.reference = prefix
        self._extend(end)

    def _extend(self, end: int) -> None:
        """Compute the followed reference up to position ``end`` (not past ``horizon``)."""
        import torch

        from .load import greedy

        end = min(end, self.horizon)
        if len(self.reference) >= end:
            return
        device = self.target.get_input_embeddings().weight.device
        # without a cache: the logits oracle records only the decoder's cached forwards
        self.reference += greedy(self.target, torch.tensor([self.reference], device=device), end - len(self.reference), use_cache=False)

    def _target_rows(self, block: list[int]):
        """The target's sharpened logits for the block's positions, on the decoder's context (where known, else
        the reference), each proposal assumed to be the previous row's argmax; indexed by position - 1. Memoised per
        target and context: the distributional test decodes the same prompt hundreds of times."""
        import torch

        ids = self.context.prefix(block[0], self.reference)
        key = (tuple(ids), tuple(block))
        memo = _ROWS.setdefault(self.target, {})
        if key in memo:
            return memo[key]
        rows = {}
        device = self.target.get_input_embeddings().weight.device
        with torch.inference_mode():
            for p in block[1:]:
                z = self.target(torch.tensor([ids], device=device), use_cache=False).logits[0, -1].float().cpu() * SAMPLING_SHARPEN
                rows[p - 1] = z
                ids.append(int(z.argmax()))
        if len(memo) >= ROWS_MEMO:
            memo.pop(next(iter(memo)))
        memo[key] = rows
        return rows

    def describe(self) -> str:
        s = self.stats
        where = (f"{s['scripted_at_logits']} at the logits" + (f", {s['scripted_at_hidden']} at the hidden states" if s["scripted_at_hidden"] else "")
                 + (f", {s['unscripted']} unscripted" if s["unscripted"] else ""))
        return f"{s['drafter_calls']} drafter calls scripted ({where})"


def _proportional(row, table) -> int | None:
    """The index of the first row of ``table`` that ``row`` is a positive multiple of (within rounding), or None."""
    import torch

    norms = table.pow(2).sum(-1)
    scale = (table @ row) / norms.clamp_min(1e-30)
    err = (row[None, :] - scale[:, None] * table).abs().amax(-1)
    tol = 1e-2 * float(row.abs().max()) + 1e-12
    ok = (err <= tol) & (scale > 0) & (norms > 0)
    hits = ok.nonzero().flatten()
    if not len(hits):
        return None
    return int(hits[torch.argmin(err[hits])])


def _input_names(draft) -> dict:
    try:
        params = inspect.signature(draft.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return {"noise": next((n for n in NOISE_NAMES if n in params), None),
            "positions": next((n for n in POSITION_NAMES if n in params), None),
            "signature": inspect.signature(draft.forward) if params else None}


def _bind(signature, args, kwargs) -> dict:
    if signature is None:
        return dict(kwargs)
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return dict(kwargs)
    for name, p in signature.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and isinstance(bound.get(name), dict):
            bound.update(bound.pop(name))
    return bound


class _Handles:
    def __init__(self, handles, context):
        self.handles, self.context = handles, context

    def remove(self):
        for h in self.handles:
            h.remove()
        self.context.remove()
