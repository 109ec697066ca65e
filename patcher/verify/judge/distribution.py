"""The distribution oracle: under sampling, the second new token's distribution over many short runs against the
target's exact one (a chi-square goodness-of-fit test).

``sample`` runs each method ``sampling_runs`` times (two new tokens each) through the decode loop and tests the
counts against ``second_token_distribution`` (the reference: the target's own sampling, computed exactly);
``chi_square_test`` is the verdict, ``method_rows`` the ``sampling distribution: METHOD`` row.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..check import Check
from ..models.load import greedy
from ..plumbing.events import emit


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


def second_token_distribution(target, prompt, sampling: dict, max_first: int = 256, mass: float = 0.9999) -> dict[int, float]:
    """Exact P(second new token) under the target's own sampling:
    sum over the first token x0 of p(x0 | prompt) * p(x1 | prompt, x0)."""
    import torch

    with torch.inference_mode():
        p0 = sampling_distribution(target(prompt, use_cache=False).logits[0, -1], **sampling)
        probs, order = p0.sort(descending=True)
        keep = int(min(max_first, int((probs.cumsum(0) < mass).sum()) + 1))
        firsts, weights = order[:keep], probs[:keep] / probs[:keep].sum()
        total = torch.zeros_like(p0)
        for chunk in range(0, keep, 32):
            xs = firsts[chunk : chunk + 32]
            batch = torch.cat([prompt.expand(len(xs), -1), xs[:, None].to(prompt.device)], dim=1)
            p1 = sampling_distribution(target(batch, use_cache=False).logits[:, -1], **sampling)
            total += (weights[chunk : chunk + 32, None].to(p1.device) * p1).sum(0).to(total.device)
    return {int(t): float(p) for t, p in enumerate(total.tolist()) if p > 0}


def sample(loop) -> dict[str, dict]:
    """Per method, the chi-square test of its second new token over ``sampling_runs`` decodes of prompt 0 (empty when
    the run is greedy or asks for no sampling runs)."""
    cfg, sampling = loop.cfg, loop.sampling
    distributions: dict[str, dict] = {}
    if not sampling or cfg.get("sampling_runs", 0) <= 0:
        return distributions
    prompt = loop.prompts[0]
    expected = second_token_distribution(loop.target, prompt, {k: v for k, v in sampling.items() if v is not None})
    reference = greedy(loop.target, prompt, max(2, loop.block_size), loop.stops)
    for method in loop.methods:
        counts: dict[int, int] = {}
        for i in range(cfg["sampling_runs"]):
            new = loop.decode(method, prompt, reference, seed=50_000 + i, max_new_tokens=2, judge=False).new
            if len(new) > 1:
                counts[new[1]] = counts.get(new[1], 0) + 1
        test = chi_square_test(counts, expected, alpha=cfg.get("alpha", 1e-3))
        distributions[method.name] = test.as_dict()
        emit("progress", done=loop.done, total=loop.total, label=f"{loop.label}: {method.name} sampled {cfg['sampling_runs']} times")
    return distributions


def method_rows(loop, method, earlier: list) -> list[dict]:
    """``sampling distribution: METHOD``, where ``sample`` tested the method."""
    d = loop.distributions.get(method.name)
    if d is None:
        return []
    test = DistributionVerdict(d["statistic"], d["dof"], d["p_value"], d["samples"], d["alpha"])
    return [Check.of(f"sampling distribution: {method.name}", passed=test.passed,
                     evidence="2nd new token vs the target's exact distribution: " + test.describe()).to_json()]
