"""The logits oracle: the logits a decoder used at every committed position against one from-scratch forward.

``LogitsRecorder`` watches the target's forwards during a decode (its recorder), ``reference_logits`` is the
teacher-forced forward over the emitted tokens (its reference, shared with the other oracles through
``plain_forward``), ``judge_logits`` the verdict, and ``method_rows`` the ``logits == from-scratch: METHOD`` row.
``observed_acceptance`` reads a run's acceptance lengths off its forwards when the decoder keeps none.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

from . import routers
from ..check import Check


def cache_given(kwargs: dict):
    """The transformers cache a forward was called with, found by type, not by keyword: decoders pass
    ``past_key_values=``, and transformers 5.24+ names it ``cache=`` (``past_key_values=`` is deprecated)."""
    from transformers.cache_utils import Cache

    return next((v for v in kwargs.values() if isinstance(v, Cache)), None)


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


def backbones(target) -> list:
    """The modules a decoder may call in place of the full target: its ``get_decoder()``, ``target.model`` and the
    ``language_model`` inside it (a ``ForConditionalGeneration``), each once."""
    found = []
    inner = getattr(target, "model", None)
    for get in (getattr(target, "get_decoder", None), lambda: inner, lambda: getattr(inner, "language_model", None)):
        try:
            module = get() if get is not None else None
        except Exception:  # a model whose get_decoder() cannot say
            module = None
        if hasattr(module, "register_forward_hook") and module is not target and all(module is not f for f in found):
            found.append(module)
    return found


class BackboneCalls:
    """Hooks that report a decoding forward a fork runs on the target's backbone (``target.model(...)``, then its own
    ``lm_head``) as if it were a call of the target: only the outermost call among the target and its backbones,
    never one inside the target's own forward, and with the logits the target's head gives on its last hidden state."""

    def __init__(self, target, before, after):
        self.target, self.before, self.after = target, before, after
        self.depth = 0

    def install(self) -> list:
        handles = []
        for module in (self.target, *backbones(self.target)):
            handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            handles.append(module.register_forward_hook(self._exit, with_kwargs=True, always_call=True))
        return handles

    def _enter(self, module, args, kwargs):
        self.depth += 1
        if self.depth == 1 and module is not self.target:
            self.before(module, args, kwargs)

    def _exit(self, module, args, kwargs, output):
        self.depth -= 1
        hidden = getattr(output, "last_hidden_state", None)
        if self.depth or module is self.target or hidden is None or cache_given(kwargs) is None:
            return  # inside another hooked call, the target's own, or not a decoding step
        import torch

        with torch.no_grad():
            logits = self.target.get_output_embeddings()(hidden)
        self.after(module, args, kwargs, SimpleNamespace(logits=logits, hidden_states=getattr(output, "hidden_states", None)))


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
            *BackboneCalls(self.target, self._before, self._after).install(),
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
                # in the run's own dtype (exact; float32 of a bfloat16 row is twice its bytes, a real vocabulary's
                # 1 MB a row), a copy (a decoder may scale its logits in place)
                "logits": logits[0].detach().to("cpu", copy=True),
                "routes": self._routes.take(),
            }
        )


def _committed(call: dict, final: list) -> list[int]:
    """The rows of one recorded call whose context is the final sequence (itself and what it attends to among the
    call's inputs: all earlier inputs for a chain, its ancestors from the 4D mask for a tree)."""
    ids, pos, visible = call["ids"], call["positions"], call["visible"]
    ok = [0 <= p < len(final) and t == final[p] for t, p in zip(ids, pos)]
    if visible is None:  # a chain: every input up to the first one off the final sequence
        return list(range(next((i for i, good in enumerate(ok) if not good), len(ok))))
    # a tree: no input it sees is off the final sequence (one tensor operation: a 1,025-node tree is 1M pairs)
    import torch

    seen = torch.as_tensor(visible, dtype=torch.bool)[: len(ids), : len(ids)]
    off = ~torch.tensor(ok, dtype=torch.bool)
    return torch.nonzero(~(seen & off).any(dim=1)).flatten().tolist()


def observed_acceptance(calls: list[dict], prompt_len: int, final_len: int) -> list[int]:
    """A decode's acceptance lengths read off the target's decoding forwards, for a decoder that returns none: a
    round's verify starts at its block's first (committed) position, so the committed tokens of a round are the
    distance to the next round's start; the last round's reach the final sequence's last token."""
    starts = []
    for call in calls:
        first = call["positions"][0] if call["positions"] else None
        if first is not None and first >= prompt_len and (not starts or first != starts[-1]):
            starts.append(first)
    out = [b - a for a, b in zip(starts, starts[1:])]
    if starts and final_len - 1 > starts[-1]:
        out.append(final_len - 1 - starts[-1])
    return [a for a in out if a > 0]


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
    shared = plain_forward(target, sequence, hidden_states=True)  # the drafter oracle's Reference asks for them next
    if shared is not None:
        return shared[0]
    device = target.get_input_embeddings().weight.device
    with torch.inference_mode():
        ids = torch.tensor([list(sequence)], device=device)
        return target(ids, use_cache=False).logits[0].float().cpu()


#: The last plain from-scratch forwards (``plain_forward``): (id of the target, sequence) -> (weakref to the target,
#: logits, hidden states or None), at most ``PLAIN_KEEP``.
_PLAIN: dict = {}
PLAIN_KEEP = 2
#: How many plain forwards ran and how many were answered from memory (the tests and benchmarks read it).
plain_stats = {"ran": 0, "shared": 0}


def plain_forward(target, sequence: Sequence[int], hidden_states: bool = False):
    """One forward of the target over ``sequence`` without a cache: (logits [len, vocab] float32 on the CPU, the hidden
    states or None); None for a target with top-k routers, whose from-scratch forwards may follow a decode's experts
    (``routers.following_reference``) and are never shared. Remembered for the last ``PLAIN_KEEP`` sequences: the
    mask-id search, the noise floor's multi-token way, each method's logits oracle and its drafter oracle all ask for
    the same committed sequence (a lossless decode emits the reference), and the same forward on the same input gives
    the same numbers. The caller only reads what it gets."""
    import weakref

    import torch

    if not isinstance(target, torch.nn.Module) or routers.routers(target):
        return None
    key = (id(target), tuple(int(t) for t in sequence))
    hit = _PLAIN.get(key)
    if hit is not None and hit[0]() is target and (hit[2] is not None or not hidden_states):
        plain_stats["shared"] += 1
        return hit[1], hit[2]
    device = target.get_input_embeddings().weight.device
    with torch.inference_mode():
        out = target(torch.tensor([list(sequence)], device=device), use_cache=False, output_hidden_states=hidden_states)
    plain_stats["ran"] += 1
    value = (weakref.ref(target), out.logits[0].float().cpu(), out.hidden_states if hidden_states else None)
    _PLAIN.pop(key, None)
    _PLAIN[key] = value
    while len(_PLAIN) > PLAIN_KEEP:
        _PLAIN.pop(next(iter(_PLAIN)))
    return value[1], value[2]


def forget_plain() -> None:
    """Drop the remembered forwards (a model is done with: its logits and hidden states are freed)."""
    _PLAIN.clear()


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


def method_rows(loop, method, earlier: list) -> list[dict]:
    """``logits == from-scratch: METHOD`` over the method's runs: every judged run within the calibrated tolerance."""
    runs = loop.stats[method.name].runs
    failed_runs = [r for r in runs if "error" in r]
    judged = [r for r in runs if "logits" in r]
    over = [r for r in judged if not r["logits"]["passed"]]
    worst = max(judged, key=lambda r: r["logits"]["max_abs"], default=None)
    if failed_runs and not judged:
        evidence = failed_runs[0].get("error", "failed")
    elif over:
        evidence = f"{len(over)}/{len(judged)} runs over tolerance; prompt {over[0]['prompt']}: {over[0]['logits_description']}"
    elif worst is not None:
        evidence = f"{len(judged)}/{len(judged)} runs within tolerance; worst: {worst['logits_description']}"
    else:
        evidence = "no run"
    row = Check.of(f"logits == from-scratch: {method.name}", passed=bool(judged) and not over and not failed_runs, evidence=evidence)
    return [routers.inconclusive(row.to_json(), runs, loop.dtype, loop.f32)]
