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

from . import routers
from .context import DecodeContext

RANK_PROBS = (0.6, 0.25, 0.15)
#: Under sampling the scripted draft proposes from the target's logits times this (its temperature halved).
SAMPLING_SHARPEN = 4.0


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


def cache_given(kwargs: dict):
    """The transformers cache a forward was called with, found by type, not by keyword: decoders pass
    ``past_key_values=``, and transformers 5.24+ names it ``cache=`` (``past_key_values=`` is deprecated)."""
    from transformers.cache_utils import Cache

    return next((v for v in kwargs.values() if isinstance(v, Cache)), None)


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

    def __init__(self, target, reference: Sequence[int], seed: int, forbidden: Sequence[int] = (), margin: float = 8.0,
                 from_distribution: bool = False):
        import torch

        self.reference = list(reference)
        # after a near-tie the reference is the target's greedy continuation of the decoder's path, as far as
        # ``horizon``; it is computed lazily (``_extend``), as far as a block asks: every position holds the
        # token a whole computation would give (a cacheless greedy is a function of its prefix alone)
        self.horizon = len(self.reference)
        weight = target.get_output_embeddings().weight.detach().float()
        self.vocab = weight.shape[0]
        self.solve = torch.linalg.pinv(weight)  # [hidden, vocab]: h = pinv(W) @ z gives W h = z on W's range
        self.gen = torch.Generator().manual_seed(10_007 + seed)
        self.forbidden = set(int(t) for t in forbidden)
        self.margin = margin
        self.ranks: list[int] = []
        # under sampling: propose from the target's own next-token logits on the decoder's actual context, sharpened,
        # so the draft is confident, the target's samples part from it now and then, and partial acceptances happen
        self.target = target
        self.from_distribution = from_distribution
        self.rows = None
        self.context = DecodeContext(target)  # the decoder's committed path: the script follows it after a near-tie

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

    def __call__(self, module, args, kwargs, output):
        import torch

        hidden = output[0] if isinstance(output, tuple) else output
        positions = kwargs.get("position_ids")
        if positions is None or hidden.dim() != 3:
            return output
        q_len = hidden.shape[1]
        block = positions[0, -q_len:].tolist()
        if self.from_distribution:
            self.rows = self._target_rows(block)
        else:
            self._follow(block[0], max(block) + 1)
        rows = [self.logits_for(p) for p in block[1:]]
        scripted = (self.solve @ torch.stack(rows).T).T.to(hidden.dtype).to(hidden.device)
        new = hidden.clone()
        new[0, 1:, :] = scripted
        return (new, *output[1:]) if isinstance(output, tuple) else new

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

        from .models import greedy

        end = min(end, self.horizon)
        if len(self.reference) >= end:
            return
        device = self.target.get_input_embeddings().weight.device
        block_ids = self.context.block_ids  # greedy's forwards go through the embeddings too: keep the draft block's
        # without a cache: the logits oracle records only the decoder's cached forwards
        self.reference += greedy(self.target, torch.tensor([self.reference], device=device), end - len(self.reference), use_cache=False)
        self.context.block_ids = block_ids

    def _target_rows(self, block: list[int]):
        """The target's sharpened logits for the block's positions, on the decoder's context (where known, else
        the reference), each proposal assumed to be the previous row's argmax; indexed by position - 1."""
        import torch

        ids = self.context.prefix(block[0], self.reference)
        rows = {}
        device = self.target.get_input_embeddings().weight.device
        with torch.inference_mode():
            for p in block[1:]:
                z = self.target(torch.tensor([ids], device=device), use_cache=False).logits[0, -1].float().cpu() * SAMPLING_SHARPEN
                rows[p - 1] = z
                ids.append(int(z.argmax()))
        return rows

    def attach(self, draft):
        return _Handles([draft.register_forward_hook(self, with_kwargs=True), self.context.attach()])


class _Handles:
    def __init__(self, handles):
        self.handles = handles

    def remove(self):
        for h in self.handles:
            h.remove()


# ----------------------------------------------------------------------------- the logits oracle
#: Fixed tolerances for callers that run no calibration (``verify --generate``); ``ddpatch verify``
#: calibrates its tolerance on the target in each run (``calibration``), float32 keeping 3e-5 as a minimum.
#: Largest |logit difference| allowed against one from-scratch forward, per dtype. Measured on
#: known-good runs (full recipe, chain and tree): float32 at most 2.7e-07 on the five presets of
#: the time (default verify), 3.6e-06 with the sampling presets' sharper logits; on tiny-qwen3_5
#: (3 seeds x 24 tokens) bfloat16 2.0e-03, float16 3.7e-04.
#: float32 is "a few 1e-5": about 8x the worst known-good run, and low enough to see a broken
#: Mamba2 rollback under transformers' default init, which moves logits by about 1e-5 to 1e-4.
#: The half-precision tolerances leave a wide margin for real models, whose logits are larger
#: (not measured: override with --logit-tolerance); a broken GDN rollback measures 1e-01 and more.
LOGIT_TOLERANCE = {"float32": 3e-5, "bfloat16": 0.25, "float16": 0.05}


class LogitsRecorder:
    """Forward hooks on the target that keep what every target forward computed.

    Per call: the input ids, their positions, the tree mask (if any), the logits, and what each
    top-k router chose (``routers``). Nothing in the decoder changes: the hooks only read. ``positions`` falls back to the cache length
    before the call when the decoder passes no ``position_ids``. Only forwards that use a cache
    are decoding steps; others (a runtime's probe, a reference forward) are not recorded.
    """

    def __init__(self, target):
        self.target = target
        self.calls: list[dict] = []
        self._handles = []
        self._past = None
        self._routes = routers.Trace(target)

    def __enter__(self):
        routers.release(self.target)  # a new decode: no reference of the last one follows its experts any more
        self._handles = [
            self.target.register_forward_pre_hook(self._before, with_kwargs=True),
            self.target.register_forward_hook(self._after, with_kwargs=True),
        ]
        self._routes.__enter__()
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        self._routes.__exit__(*exc)
        routers.remember(self.target, self.calls)  # reference_logits follows this decode's experts where they tie

    def _before(self, module, args, kwargs):
        self._routes.take()
        cache = cache_given(kwargs)
        try:
            self._past = int(cache.get_seq_length()) if cache is not None else 0
        except Exception:  # a cache of another kind: positions must then come from position_ids
            self._past = None

    def _after(self, module, args, kwargs, output):
        import torch

        if cache_given(kwargs) is None:  # not a decoding step (a probe, a reference forward)
            return
        ids = args[0] if args else kwargs.get("input_ids")
        logits = getattr(output, "logits", None)
        if ids is None or logits is None or ids.dim() != 2:
            return
        q = ids.shape[1]
        positions = kwargs.get("position_ids")
        if positions is not None:
            positions = positions.reshape(-1, positions.shape[-1])[0, -q:]
        elif self._past is not None:
            positions = torch.arange(self._past, self._past + q)
        else:
            return
        mask = kwargs.get("attention_mask")
        visible = None
        if mask is not None and mask.dim() == 4:
            block = mask[0, 0, -q:, -q:]
            visible = (block == 0) if block.dtype != torch.bool else block
            visible = visible.cpu()
        self.calls.append(
            {
                "ids": ids[0].detach().cpu().tolist(),
                "positions": positions.detach().cpu().tolist(),
                "visible": visible,
                "logits": logits[0].detach().float().cpu(),
                "routes": self._routes.take(),
            }
        )


def _committed(call: dict, final: list) -> list[int]:
    """The rows of one recorded call whose context is the final sequence (itself and what it attends to among the
    call's inputs: all earlier inputs for a chain, its ancestors from the 4D mask for a tree)."""
    ids, pos, visible = call["ids"], call["positions"], call["visible"]
    ok = [0 <= p < len(final) and t == final[p] for t, p in zip(ids, pos)]

    def context(i: int):
        return [j for j in range(len(ids)) if bool(visible[i, j])] if visible is not None else range(i + 1)

    return [i for i in range(len(ids)) if all(ok[j] for j in context(i))]


def committed_rows(calls: list[dict], final: Sequence[int]) -> list[tuple[int, "object"]]:
    """(position, logits row) for every recorded node whose context is the final sequence.

    A node's context is itself and what it attends to among the call's inputs: all earlier
    inputs for a chain, its ancestors (from the 4D mask) for a tree. Its logits are the ones
    the decoder used to decide the token at ``position + 1``. Logits kept only for the last
    inputs (``logits_to_keep``) align to the end.
    """
    final = list(final)
    rows = []
    for call in calls:
        pos, logits, q = call["positions"], call["logits"], len(call["ids"])
        kept = logits.shape[0]
        rows += [(pos[i], logits[i - (q - kept)]) for i in _committed(call, final) if i >= q - kept]
    return rows


@dataclass(frozen=True)
class LogitsVerdict:
    max_abs: float
    at: int | None  # index into the new tokens of the position with the largest difference
    first_over: int | None  # index into the new tokens of the first position over the tolerance
    tolerance: float
    positions: int  # committed positions compared
    trace: tuple = ()  # (new-token index, |Δlogit|) per committed position, for plots
    routing: dict | None = None  # the routing flips the reference followed, or could not (``routers.Flips``)
    routing_text: str = ""

    @property
    def passed(self) -> bool:
        return self.first_over is None and self.positions > 0

    def describe(self) -> str:
        if not self.positions:
            return "no committed position was recorded (the target forward was not seen)"
        text = f"max |Δlogit| {self.max_abs:.2e} at new token {self.at}, {self.positions} positions"
        if self.first_over is not None:
            text = f"{text}; first over {self.tolerance:.0e} at new token {self.first_over}"
        else:
            text = f"{text} (tolerance {self.tolerance:.0e})"
        return f"{text}; {self.routing_text}" if self.routing_text else text

    def as_dict(self) -> dict:
        return {"max_abs": self.max_abs, "at": self.at, "first_over": self.first_over,
                "tolerance": self.tolerance, "positions": self.positions, "passed": self.passed,
                "trace": [[i, float(f"{d:.3g}")] for i, d in self.trace], "routing": self.routing}


def reference_logits(target, sequence: Sequence[int]):
    """One from-scratch forward of the target over ``sequence``: no cache, nothing speculative.

    On a target with top-k routers whose last decode (``LogitsRecorder``) committed ``sequence``, the forward takes
    the decoder's experts at the routing flips that are ties under this dtype's rounding (``routers.reference``;
    the tensor's ``routing`` attribute says which), and until the next decode is recorded, the target's other
    from-scratch forwards over ``sequence`` (the drafter oracle's features) take them too."""
    import torch

    followed = routers.following_reference(target, sequence, _committed)
    if followed is not None:
        return followed
    device = target.get_input_embeddings().weight.device
    with torch.inference_mode():
        ids = torch.tensor([list(sequence)], device=device)
        return target(ids, use_cache=False).logits[0].float().cpu()


def judge_logits(calls: list[dict], final: Sequence[int], reference, prompt_len: int, tolerance: float) -> LogitsVerdict:
    """Compare the logits the decoder used at committed positions with the from-scratch ones.

    Positions are reported as new-token indices: the logits at position p decide new token
    ``p + 1 - prompt_len``. The prompt's own positions (prefill) are compared too.
    """
    worst, at, first, trace = 0.0, None, None, {}
    flips = getattr(reference, "routing", None)
    routed = flips is not None and bool(flips.followed or flips.unexplained or flips.too_many)
    rows = committed_rows(calls, final)
    for pos, row in sorted(rows, key=lambda r: r[0]):
        diff = float((row - reference[pos]).abs().max())
        new_index = pos + 1 - prompt_len
        if new_index >= 0:
            trace[new_index] = max(trace.get(new_index, 0.0), diff)
        if diff > worst:
            worst, at = diff, new_index
        if diff > tolerance and first is None:
            first = new_index
    return LogitsVerdict(worst, at, first, tolerance, len(rows), tuple(sorted(trace.items())),
                         flips.as_dict() if routed else None, flips.describe(prompt_len) if routed else "")


# ----------------------------------------------------------------------------- the distributional check
def chi_square_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof), via the regularised upper incomplete gamma."""
    import torch

    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(statistic / 2.0, dtype=torch.float64)))


@dataclass(frozen=True)
class DistributionVerdict:
    statistic: float
    dof: int
    p_value: float
    samples: int
    alpha: float

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha

    def describe(self) -> str:
        return f"chi-square {self.statistic:.1f} on {self.dof} dof over {self.samples} runs, p = {self.p_value:.3g} (fail below {self.alpha:g})"

    def as_dict(self) -> dict:
        return {"statistic": self.statistic, "dof": self.dof, "p_value": self.p_value, "samples": self.samples,
                "alpha": self.alpha, "passed": self.passed}


def chi_square_test(observed: dict, expected_probs: dict, alpha: float = 1e-3, min_expected: float = 5.0) -> DistributionVerdict:
    """Goodness of fit of observed counts to exact probabilities.

    Tokens are binned, least likely first, until each bin expects at least ``min_expected``
    counts (so the chi-square approximation holds and rare tokens still count); a token
    outside ``expected_probs`` joins the least likely bin.
    """
    n = sum(observed.values())
    bins: list[list] = []  # [observed, expected]
    current = [0.0, 0.0]
    for token, p in sorted(expected_probs.items(), key=lambda kv: kv[1]):
        current[0] += observed.get(token, 0)
        current[1] += p * n
        if current[1] >= min_expected:
            bins.append(current)
            current = [0.0, 0.0]
    if bins:
        bins[-1][0] += current[0]
        bins[-1][1] += current[1]
    else:
        bins.append(current)
    bins[0][0] += sum(c for t, c in observed.items() if t not in expected_probs)
    cells = [(o, e) for o, e in bins if e > 0]
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return DistributionVerdict(statistic, dof, chi_square_sf(statistic, dof), n, alpha)


def sampling_distribution(logits, temperature: float, top_p: float | None = None, top_k: int | None = None):
    """The distribution a sampler draws from: temperature, then the ``top_k`` best tokens, then the
    smallest set of best tokens holding ``top_p`` of the mass. Used for the exact expectations of
    the distributional check; a decoder that defines top-p differently will fail it, rightly so
    if it claims to sample the target."""
    import torch

    scores = logits.float() / temperature
    if top_k and 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p is not None and top_p < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True)
        ranked = ranked.masked_fill(ranked.cumsum(dim=-1) - ranked >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ranked)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
