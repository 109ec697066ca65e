"""The token oracle: a speculative greedy output must be token-identical to the target's own greedy decoding.

``compare`` is the verdict on one run (it names the first divergence); ``neartie`` tells a divergence that is a tie
under this dtype's rounding from a loss. ``reference_rows`` checks the reference itself (cached greedy against
no-cache greedy, a multi-token forward against token-by-token); ``method_rows`` is a method's ``lossless: METHOD``
row over its runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from . import neartie, routers
from ..check import Check
from ..models.load import greedy, multi_token_consistent


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


def lossless_check(name: str, runs: list[dict]) -> dict:
    """Token identity, with near-ties told from losses (``neartie``) and the mask-token event named."""
    kinds = [r.get("ties", {}).get("kind", "identical" if r["verdict"]["identical"] else "loss") for r in runs]
    identical = sum(r["verdict"]["identical"] for r in runs)
    lost = [r for r, k in zip(runs, kinds) if k == "loss" or "error" in r]
    masked = [r for r, k in zip(runs, kinds) if k == "mask-token"]
    tied = [r for r, k in zip(runs, kinds) if k in ("near-tie", "routing")]
    passed = bool(runs) and not lost and not masked
    if lost:
        first = lost[0]
        why = first.get("description") or first.get("error", "failed")
        if first.get("ties_description") and first["ties"]["kind"] == "loss":
            why += "; " + first["ties_description"]
        return Check.of(f"lossless: {name}", passed=passed,
                        evidence=f"{len(lost)}/{len(runs)} runs differ; prompt {first['prompt']}: {why}").to_json()
    if masked:
        return Check.of(f"lossless: {name}", passed=passed, inconclusive=True,
                        evidence=f"prompt {masked[0]['prompt']}: {masked[0]['ties_description']}").to_json()
    if tied:
        return Check.of(f"lossless: {name}", passed=passed, evidence=(
            f"{identical}/{len(runs)} runs token-identical, {len(tied)} within near-ties or routing flips; "
            f"prompt {tied[0]['prompt']}: {tied[0]['ties_description']}")).to_json()
    return Check.of(f"lossless: {name}", passed=passed, evidence=f"{len(runs)}/{len(runs)} runs token-identical").to_json()


def reference_rows(loop) -> list[dict]:
    """The reference itself is sound on this transformers version (within this dtype's near-ties): cached greedy equals
    no-cache greedy on prompt 0, and a multi-token forward equals token-by-token decoding."""
    from .logits import reference_logits

    target, prompt, stop_ids, cal = loop.target, loop.prompts[0], loop.stops, loop.cal
    ref0 = loop.references[0][:16]
    nocache = greedy(target, prompt, len(ref0), stop_ids, use_cache=False)
    v = compare(nocache, ref0)
    tie = neartie.judge_ties(nocache, ref0, reference_logits(target, prompt[0].tolist() + ref0), prompt.shape[1],
                             cal.epsilon, None, stop_ids, len(ref0))
    same, diff = multi_token_consistent(target, prompt, ref0[: min(6, len(ref0))] or [0])
    tolerance = cal.tolerance
    return [
        Check.of("cached greedy == no-cache greedy", passed=tie.ok,
                 evidence=v.describe() + ("" if v.identical else f"; {tie.describe()}")).to_json(),
        Check.of("multi-token forward == token-by-token", passed=same or diff <= tolerance,
                 evidence=f"argmax {'equal' if same else 'DIFFERS'}, max |logit diff| {diff:.2e}"
                          + ("" if same else f" (tolerance {tolerance:.2e}: {'a near-tie' if diff <= tolerance else 'not a tie'})")
                 ).to_json(),
    ]


def method_rows(loop, method, earlier: list) -> list[dict]:
    """``lossless: METHOD`` over the method's runs (greedy only: sampled tokens have no greedy reference)."""
    if loop.sampling:
        return []
    runs = loop.stats[method.name].runs
    return [routers.inconclusive(lossless_check(method.name, runs), runs, loop.dtype, loop.f32)]
