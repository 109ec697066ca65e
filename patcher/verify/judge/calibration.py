"""The noise floor of the target in this run's dtype and device, and the tolerance it sets.

A speculative decoder scores several tokens in one forward; the reference scores them from
scratch. Both are exact, so in float32 they agree to about 1e-7; in bfloat16 and float16 the
two kernel shapes round differently. The floor is measured, not guessed: the same prefix is
computed two exact ways, one multi-token forward without a cache against token-by-token
decoding with a cache, over the run's prompts and their greedy continuations. Its largest
|Δlogit| (never less than one unit in the last place of the largest logit) is the floor.

The logits oracle then allows ``MULTIPLE`` times the floor, and two tokens within that much
(``epsilon``) are a near-tie. The multiple was picked from measurements
(docs/verify-precision.md): correct bf16/fp16 runs of the fully patched tree reach at most
1.1 floors, a broken rollback (the code-shape-only control) 30 to 750.

On a mixture-of-experts target the two ways may pick different experts for a token (a routing
flip: a tie between two experts under this rounding, see ``routers``). The multi-token way then
follows the token-by-token way's experts there, so that the floor measures rounding, not a
discrete jump; the same comparison gives the routers' own floor (their logits' largest |Δ|),
and ``MULTIPLE`` times it is the router tolerance the logits oracle's reference uses to tell a
tie from a router input that already differs.

When the floor is so high that a lossy commit would not stand out (discrete choices that are
not followed, a top-k indexer flipping under half-precision rounding), the verdict is
*inconclusive in this dtype*: ``conclusive`` says so, and the report names the float32 command.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import routers
from ..check import Check

#: Tolerance = MULTIPLE x floor (see the module docstring and docs/verify-precision.md).
MULTIPLE = 4.0
#: In float32 the presets keep their measured fixed tolerance when it is larger (it was set to see a
#: broken Mamba2 rollback under transformers' default init): max(FLOAT32_MIN_TOLERANCE, MULTIPLE x floor).
FLOAT32_MIN_TOLERANCE = 3e-5
#: A lossy commit moves logits by a sizeable fraction of their spread (the controls measured 0.9 to 6
#: standard deviations of a position's logits). A tolerance above this fraction of the spread could
#: hide one: the run cannot judge this model in this dtype.
CONCLUSIVE_FRACTION = 0.5


@dataclass(frozen=True)
class Calibration:
    dtype: str
    floor: float  # largest |Δlogit| between two exact computations (at least one ulp)
    measured: float  # the measured part, before the ulp minimum
    ulp: float  # one unit in the last place of the largest logit, in this dtype
    spread: float  # mean standard deviation of a position's logits
    positions: int
    multiple: float
    tolerance: float
    override: float | None = None  # --logit-tolerance
    router_floor: float | None = None  # largest |Δ router logits| the two ways (None: no top-k router)
    router_tolerance: float | None = None  # MULTIPLE x router floor: a routing flip within it is a tie
    router_flips: int = 0  # routing flips the multi-token way followed

    @property
    def epsilon(self) -> float:
        """How close two logits may lie and still be a tie under this rounding."""
        return self.tolerance

    @property
    def conclusive(self) -> bool:
        return self.override is not None or self.tolerance <= CONCLUSIVE_FRACTION * self.spread or self.dtype == "float32"

    def describe(self) -> str:
        text = (f"noise floor {self.floor:.2e} ({self.dtype}, {self.positions} positions: multi-token forward vs "
                f"token-by-token with a cache; one ulp {self.ulp:.1e}), logit spread {self.spread:.2e}")
        if self.router_floor is not None:
            text += (f"; router floor {self.router_floor:.1e}, router tolerance {self.router_tolerance:.1e}"
                     f" ({self.router_flips} routing flip(s) followed)")
        if self.override is not None:
            return f"{text}; tolerance {self.tolerance:.2e} set by --logit-tolerance"
        return f"{text}; tolerance {self.multiple:g} x floor = {self.tolerance:.2e}"

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "floor": self.floor, "measured": self.measured, "ulp": self.ulp, "spread": self.spread,
                "positions": self.positions, "multiple": self.multiple, "tolerance": self.tolerance, "epsilon": self.epsilon,
                "override": self.override, "conclusive": self.conclusive, "router_floor": self.router_floor,
                "router_tolerance": self.router_tolerance, "router_flips": self.router_flips}


def ulp_of(value: float, dtype) -> float:
    import math

    import torch

    eps = torch.finfo(dtype).eps
    return eps * 2.0 ** math.floor(math.log2(max(abs(value), 1e-30)))


def two_ways(target, prompt, continuation: list[int]):
    """(multi-token forward logits, token-by-token logits) at the positions that decide ``continuation``."""
    full, stepped, _ = routed_two_ways(target, prompt, continuation)
    return full, stepped


def routed_two_ways(target, prompt, continuation: list[int], stepped_rows: list | None = None):
    """``two_ways``, and on a target with top-k routers ``(largest |Δ router logits|, flips followed, largest |router
    logit|)`` (else None): the multi-token way follows the token-by-token way's experts where they part.
    ``stepped_rows``: the token-by-token way's rows as the greedy reference computed them (``models.greedy(rows=)``,
    the same cached forwards); used on a target without routers, whose multi-token way is then the from-scratch
    forward the oracles share (``logits.plain_forward``)."""
    import torch
    from transformers import DynamicCache

    from ..models.context import with_cache
    from .logits import plain_forward

    n, p = len(continuation), prompt.shape[1]
    if stepped_rows is not None and len(stepped_rows) >= n:
        shared = plain_forward(target, prompt[0].tolist() + list(continuation), hidden_states=True)
        if shared is not None:
            return shared[0][p - 1 : p - 1 + n], torch.stack(list(stepped_rows[:n])), None
    cont = torch.tensor([continuation], device=prompt.device)
    with routers.Trace(target) as trace, torch.inference_mode():
        full = target(torch.cat([prompt, cont], dim=1), use_cache=False).logits[0, p - 1 : p - 1 + n]
        trace.take()
        cache = DynamicCache(config=target.config)
        rows = [target(prompt, **with_cache(target, cache), use_cache=True).logits[0, -1]]
        stepped = routers.rows(trace.take(), list(enumerate(range(p))))
        for i in range(n - 1):
            rows.append(target(cont[:, i : i + 1], **with_cache(target, cache), use_cache=True).logits[0, -1])
            stepped.update(routers.rows(trace.take(), [(0, p + i)]))
    routed = None
    if trace.routers:
        sequence = prompt[0].tolist() + list(continuation)
        logits, flips, _, followed = routers.reference(target, sequence, stepped, float("inf"))
        full = logits[p - 1 : p - 1 + n]
        top = max((float(r[0].float().abs().max()) for r in stepped.values()), default=0.0)
        routed = (routers.largest_delta(stepped, followed), len(flips.followed), top)
    return full.float().cpu(), torch.stack(rows).float().cpu(), routed


def calibrate(target, prompts, continuations, override: float | None = None, stepped: list | None = None) -> Calibration:
    """The noise floor over ``prompts`` and their greedy ``continuations``; ``stepped``: each one's token-by-token
    logits rows as the greedy reference computed them (``models.greedy(rows=)``), else computed here."""
    import torch

    dtype = target.dtype
    name = str(dtype).replace("torch.", "")
    measured, top, spreads, positions = 0.0, 0.0, [], 0
    router_floor, router_top, flips = None, 0.0, 0
    for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
        if not cont:
            continue
        a, b, routed = routed_two_ways(target, prompt, list(cont), stepped[i] if stepped else None)
        if routed is not None:
            router_floor = max(router_floor or 0.0, routed[0])
            flips, router_top = flips + routed[1], max(router_top, routed[2])
        measured = max(measured, float((a - b).abs().max()))
        top = max(top, float(a.abs().max()))
        spreads += a.std(dim=-1).tolist()
        positions += a.shape[0]
    ulp = ulp_of(top, dtype)
    floor = max(measured, ulp)
    tolerance = MULTIPLE * floor
    if dtype == torch.float32:
        tolerance = max(tolerance, FLOAT32_MIN_TOLERANCE)
    if override is not None:
        tolerance = override
    spread = sum(spreads) / len(spreads) if spreads else 0.0
    router_tolerance = None
    if router_floor is not None:
        router_floor = max(router_floor, ulp_of(router_top, dtype))
        router_tolerance = MULTIPLE * router_floor
    routers.set_tolerance(target, router_tolerance)
    return Calibration(name, floor, measured, ulp, spread, positions, MULTIPLE, tolerance, override, router_floor,
                       router_tolerance, flips)


def float32_command(cfg: dict) -> str:
    """The command that judges this target in float32 (the inconclusive verdict names it)."""
    parts = ["ddpatch verify", cfg.get("tree", "PATCHED")]
    if cfg.get("target"):
        parts += ["--target", cfg["target"]]
    if cfg.get("draft"):
        parts += ["--draft", cfg["draft"]]
    if cfg.get("scripted_draft"):
        parts.append("--scripted-draft")
    if cfg.get("device_map"):
        parts += ["--device-map", cfg["device_map"]]
    return " ".join(parts + ["--dtype", "float32"])


def floor_row(cal: Calibration, cfg: dict) -> dict:
    """The ``noise floor`` row: inconclusive where the tolerance is too wide against the logit spread for a lossy
    commit to show, naming the float32 command that judges it."""
    if cal.conclusive:
        return Check.of("noise floor", passed=True, evidence=cal.describe(), calibration=cal.as_dict()).to_json()
    command = float32_command(cfg)
    return Check.of("noise floor", passed=False, evidence=(
        f"inconclusive in {cal.dtype}: tolerance {cal.tolerance:.2e} exceeds {CONCLUSIVE_FRACTION:g} x the logit "
        f"spread {cal.spread:.2e}, a lossy commit could hide under it; judge it in float32: {command}; {cal.describe()}"),
        calibration=cal.as_dict(), inconclusive=True, float32_command=command).to_json()
