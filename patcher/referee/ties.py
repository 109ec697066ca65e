"""Where the engine's tokens part from the target's float32 greedy: a near-tie in the engine's precision, or a loss.

An engine computes in its own dtype (vLLM's CPU build in bfloat16, a GGUF in its weights' type); ddpatch's reference
in float32. Where the target's two best logits lie closer than the engine's rounding can tell apart, a correct engine
may take the other one, and from there its sequence is its own. The target decides which: one from-scratch float32
forward over the prompt and the engine's tokens (teacher-forced) gives, at each emitted position, the target's logits
for that very prefix. Every emitted token within the tolerance of that position's argmax: a **near-tie**; the
referee then judges acceptance along the engine's tokens (a correct DFlash's acceptance is a function of the sequence
prefix). One token further from its argmax than every tolerance: a **loss**, not lossless.

The tolerance is the larger of two, both measured, never guessed:

- the referee's ε (``reference.references``: the verifier's drafter tolerance through the LM head, times the engine
  factor), which covers an engine computing in float32 with other kernels;
- the engine's dtype: the same target, cast to that dtype, over the same tokens; its largest |Δlogit| from the float32
  forward over the emitted positions, at least one unit in the last place of the largest logit in that dtype, times
  the verifier's ``calibration.MULTIPLE`` (the multiple it allows two exact computations in one dtype). Two logits
  that round to the same value in that dtype are within it by construction (one ulp).

When the engine's dtype is unknown (it does not say, and ``--engine-dtype`` was not given) or its weights are
quantized, a divergence outside ε but within what bfloat16 could explain cannot be decided: the prompt is
*undecided*, and the line names the flag (or the weights) that decides it. Torch is imported inside functions only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: the engine dtypes ``--engine-dtype`` takes; the coarsest is what an unknown dtype could be
ENGINE_DTYPES = ("float32", "float16", "bfloat16")
COARSEST = "bfloat16"


@dataclass
class Divergence:
    """One prompt's first divergence and what the target says of it. ``kind``: ``near-tie`` (every emitted token within
    the tolerance of its position's argmax), ``loss`` (one outside every tolerance), ``undecided`` (outside ε, within
    what an unknown or quantized engine's rounding could explain: ``reason`` says what decides it)."""

    kind: str
    at: int
    expected: int
    got: int
    margin: float  # the target's float32 top-1 logit minus the engine's token's, at the shared prefix
    epsilon: float  # the referee's ε
    dtype: str | None  # the engine's dtype (None: unknown)
    dtype_tolerance: float | None  # measured for that dtype (for an unknown one: for the coarsest)
    same_in_dtype: bool  # the two logits round to one value in the engine's dtype
    tolerance: float  # what the emitted tokens were held to
    reason: str = ""
    near_ties: list[dict] = field(default_factory=list)  # every emitted position off its argmax (position, gap)
    worst: dict | None = None
    dtype_measure: dict | None = None  # how the dtype's tolerance was measured (``dtype_tolerance``'s answer)

    @property
    def ok(self) -> bool:
        return self.kind == "near-tie"

    def as_dict(self) -> dict:
        return asdict(self)


def rounds_alike(a: float, b: float, dtype: str | None) -> bool:
    """Whether two float32 logits round to the same value in ``dtype``."""
    if dtype is None or dtype == "float32":
        return a == b
    import torch

    pair = torch.tensor([a, b], dtype=torch.float32).to(getattr(torch, dtype))
    return bool(pair[0] == pair[1])


def judge(teacher_forced, prompt_len: int, greedy: list[int], got: list[int], epsilon: float, *, dtype: str | None,
          dtype_tolerance: float | None, quantized: str | None = None, mask_token_id: int | None = None, stop_ids=(),
          max_new_tokens: int | None = None) -> Divergence:
    """The divergence of ``got`` from ``greedy`` judged on ``teacher_forced`` (the target's float32 logits over the prompt
    and ``got``, [len, vocab]). ``dtype_tolerance``: measured for ``dtype``, or for the coarsest dtype when ``dtype`` is
    None (unknown) or ``quantized`` names the engine's weight type."""
    from ..verify.judge.neartie import judge_ties

    at = next((i for i, (a, b) in enumerate(zip(greedy, got)) if a != b), min(len(greedy), len(got)))
    expected = greedy[at] if at < len(greedy) else -1
    token = got[at] if at < len(got) else -1
    margin = same = None
    if at < len(got) and at < len(greedy):
        row = teacher_forced[prompt_len - 1 + at]
        margin = float(row[expected] - row[token])
        same = rounds_alike(float(row[expected]), float(row[token]), dtype)
    known = dtype is not None and quantized is None
    tolerance = max(epsilon, dtype_tolerance or 0.0) if known else epsilon
    tie = judge_ties(greedy, got, teacher_forced, prompt_len, tolerance, mask_token_id, stop_ids, max_new_tokens)
    out = Divergence("near-tie" if tie.ok else "loss", at, expected, token, margin if margin is not None else float("nan"),
                     epsilon, dtype, dtype_tolerance, bool(same), tolerance, near_ties=tie.ties, worst=tie.worst)
    if tie.ok:
        out.reason = (f"margin {margin:.4g} within ε {epsilon:.4g}" if margin is not None and margin <= epsilon else
                      f"margin {margin:.4g} within {dtype}'s measured tolerance {tolerance:.4g}"
                      + (f" (the two logits round to one {dtype} value)" if same else ""))
        return out
    if tie.kind != "loss" or tie.worst is None:
        out.reason = tie.describe()
        return out
    worst = tie.worst["gap"]
    out.reason = tie.describe()
    if not known and dtype_tolerance is not None and worst <= max(epsilon, dtype_tolerance) and _complete(got, stop_ids, max_new_tokens):
        out.kind = "undecided"
        out.reason = (f"margin {worst:.4g} outside ε {epsilon:.4g} but within {COARSEST}'s measured tolerance "
                      f"{dtype_tolerance:.4g}: " + (f"the engine serves {quantized} weights, whose greedy tokens are not the "
                                                    "target's; serve float32, float16 or bfloat16 weights to judge its tokens"
                                                    if quantized else "the engine does not say its dtype: give --engine-dtype"))
    return out


def _complete(got: list[int], stop_ids, max_new_tokens: int | None) -> bool:
    return (max_new_tokens is not None and len(got) >= max_new_tokens) or bool(got and got[-1] in set(stop_ids))


def dtype_tolerance(target, sequence: list[int], prompt_len: int, dtype: str, full=None) -> dict:
    """The engine dtype's tolerance, measured: the target cast to ``dtype`` over ``sequence`` against its float32 forward
    (``full``, computed if None) at the emitted positions; ``MULTIPLE`` x max(largest |Δlogit|, one ulp of the largest
    logit in ``dtype``). A float32 engine: 0 (the referee's ε covers other float32 kernels)."""
    import copy

    import torch

    from ..verify.judge.calibration import MULTIPLE, ulp_of

    if dtype == "float32":
        return {"dtype": dtype, "tolerance": 0.0, "delta": 0.0, "ulp": 0.0, "multiple": MULTIPLE}
    if full is None:
        full = forward(target, sequence)
    low = copy.deepcopy(target).to(getattr(torch, dtype))
    rows = slice(prompt_len - 1, len(sequence) - 1)
    cast = forward(low, sequence)
    del low
    delta = float((cast[rows] - full[rows]).abs().max()) if len(sequence) > prompt_len else 0.0
    ulp = ulp_of(float(full[rows].abs().max()), getattr(torch, dtype)) if len(sequence) > prompt_len else 0.0
    return {"dtype": dtype, "tolerance": MULTIPLE * max(delta, ulp), "delta": delta, "ulp": ulp, "multiple": MULTIPLE}


def forward(target, sequence: list[int]):
    """The target's from-scratch logits over ``sequence``, float32 on the CPU ([len, vocab])."""
    import torch

    device = target.get_input_embeddings().weight.device
    with torch.inference_mode():
        return target(torch.tensor([list(sequence)], device=device), use_cache=False).logits[0].float().cpu()


def check_divergences(target, draft, refs, answers, epsilon: float, budgets, stop_ids=(), max_new_tokens: int | None = None, *,
                      dtype: str | None = None, quantized: str | None = None, mask_token_id: int | None = None,
                      progress=None) -> tuple[list, list]:
    """(per prompt a ``Divergence`` or None, per prompt the reference along the engine's tokens or None): for each
    prompt whose engine tokens part from the target's greedy, the target's verdict on them and, at a near-tie, what a
    correct DFlash accepts along them (``reference.along``). The dtype's tolerance is measured once, on the first
    divergent prompt, and reused (it is a property of the target in that dtype)."""
    from .engines import first_difference
    from .reference import along

    found: list = [None] * len(refs)
    walks: list = [None] * len(refs)
    measured = None
    for i, (ref, answer) in enumerate(zip(refs, answers)):
        got = answer.output_ids
        if got is None:
            continue
        at = first_difference(list(got[: len(ref.greedy)]), list(ref.greedy[: len(got)]))
        if at is None:
            continue
        sequence = list(ref.ids) + list(got)
        full = forward(target, sequence)
        if measured is None:
            measured = dtype_tolerance(target, sequence, len(ref.ids), dtype if dtype and not quantized else COARSEST, full)
        div = judge(full, len(ref.ids), list(ref.greedy), list(got), epsilon, dtype=dtype, dtype_tolerance=measured["tolerance"],
                    quantized=quantized, mask_token_id=mask_token_id, stop_ids=stop_ids, max_new_tokens=max_new_tokens)
        div.dtype_measure = measured
        found[i] = div
        if div.ok:
            walks[i] = along(target, draft, list(ref.ids), list(got), budgets, epsilon, stop_ids)
        if progress is not None:
            progress(f"prompt {i}: parts from the target's greedy at token {div.at}: {div.kind}")
    return found, walks
