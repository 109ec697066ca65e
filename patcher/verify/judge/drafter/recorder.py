"""The drafter oracle: what the decode loop fed the drafter, against a from-scratch reference.

The target-side oracles (token identity, logits) cannot see a draft-side bug: the target
checks every proposal, so a drafter fed stale context still yields exact tokens, only fewer
of them accepted. ``DrafterRecorder`` hooks the drafter the verifier built (nothing in the tree
changes) and keeps, per top-level drafter call, its inputs (context features, noise embedding,
position ids, the draft cache's length before the call) and its raw output (before the
scripted draft's hook replaces it); hooks on the target tell each round's committed length
(the first position of the next decoding forward of the target).

``judge`` then rebuilds every round from scratch on the final committed sequence: (a) the
features must be the target's hidden states at the drafter's ``target_layer_ids``
(``hidden_states[layer_id + 1]``) for exactly the positions new since the draft cache's
length; (b) the noise embedding is the target's input embedding of ``[committed token, mask,
...]``; (c) the positions run from the cache's length through the block; (d) the output
equals one drafter forward over the whole committed context without a cache (windowed layers
masked ``q - k < window`` unless the drafter masks them itself), and so do its proposals.
Tolerances come from ``calibrate``: two exact computations of the features (no-cache
multi-token against token-by-token with a cache) and the drafter's output on each.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass

from ..calibration import MULTIPLE, ulp_of
from ..logits import BackboneCalls, cache_given

#: the drafter's parameters, by role: the spellings forks use (first found wins)
ROLES = {
    "features": ("target_hidden", "target_hidden_states", "context_features"),
    "noise": ("noise_embedding", "noise_embeds", "inputs_embeds"),
    "positions": ("position_ids",),
}
#: float32 keeps at least these (measured on correct runs of the presets: features <= 2e-6, output <= 2e-6)
FLOAT32_MIN = {"features": 1e-4, "output": 1e-4}
#: the drafter methods whose inputs the oracle reads (DFlash2's selector path, DFlash's logits path)
PROPOSAL_METHODS = ("propose", "compute_logits")


class Unbindable(Exception):
    """The oracle cannot read this drafter's calls: the reason goes into a visible ``skipped`` row."""


def roles_of(draft) -> dict[str, str]:
    """role -> the drafter forward's parameter name; ``Unbindable`` when one is missing."""
    try:
        params = inspect.signature(draft.forward).parameters
    except (TypeError, ValueError) as exc:
        raise Unbindable(f"the drafter's forward has no signature ({exc})") from None
    found = {}
    for role, names in ROLES.items():
        name = next((n for n in names if n in params), None)
        if name is None:
            raise Unbindable(f"the drafter's forward takes none of {', '.join(names)}")
        found[role] = name
    if not getattr(draft, "target_layer_ids", None):
        raise Unbindable("the drafter declares no target_layer_ids")
    found["cache"] = next((n for n in ("past_key_values", "cache", "past_key_value") if n in params), None)
    found["use_cache"] = "use_cache" if "use_cache" in params else None
    return found


# ----------------------------------------------------------------------------- recording
class DrafterRecorder:
    """Hooks (read-only) on the drafter and the target during one decode."""

    def __init__(self, draft, target):
        self.draft, self.target = draft, target
        self.roles = roles_of(draft)
        self.signature = inspect.signature(draft.forward)
        self.calls: list[dict] = []
        self._wrapped: list[str] = []
        self.target_starts: list[tuple[int, int]] = []  # (events seen before, first position) per decoding forward
        self._events = 0
        self._depth = 0
        self._handles = []

    def __enter__(self):
        self._wrapped = [name for name in PROPOSAL_METHODS if callable(getattr(self.draft, name, None))]
        for name in self._wrapped:
            setattr(self.draft, name, self._proposal(name, getattr(self.draft, name)))
        self._handles = [
            self.draft.register_forward_pre_hook(self._before, with_kwargs=True),
            # first of the forward hooks: the raw output, before the scripted draft replaces it
            self.draft.register_forward_hook(self._after, with_kwargs=True, prepend=True, always_call=True),
            # last of them: what the decode loop really got (the scripted draft's hidden-state mode changes it)
            self.draft.register_forward_hook(self._delivered, with_kwargs=True),
            self.target.register_forward_pre_hook(self._target, with_kwargs=True),
            *BackboneCalls(self.target, self._target, lambda *_: None).install(),  # a fork that verifies on target.model
        ]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        for name in self._wrapped:
            vars(self.draft).pop(name, None)
        self._wrapped = []

    def _proposal(self, name: str, method):
        """``method`` that records, for the last drafter call, the hidden rows and anchor ids it was given."""
        import functools

        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            values = [*args, *kwargs.values()]
            hidden = next((v for v in values if hasattr(v, "is_floating_point") and v.is_floating_point() and v.dim() == 3), None)
            anchor = next((v for v in values if hasattr(v, "is_floating_point") and not v.is_floating_point()), None)
            if self.calls and self._depth == 0:
                self.calls[-1].setdefault("proposals", []).append({
                    "method": name, "hidden": hidden.detach().clone() if hidden is not None else None,
                    "anchor": anchor.detach().clone() if anchor is not None else None})
            return method(*args, **kwargs)

        return wrapper

    def _arguments(self, args, kwargs) -> dict:
        try:
            bound = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = dict(kwargs)
        for name, p in self.signature.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD and isinstance(bound.get(name), dict):
                bound.update(bound.pop(name))
        return bound

    def _before(self, module, args, kwargs):
        self._depth += 1
        if self._depth > 1:  # the drafter calling itself (a nested helper): only the decode loop's call counts
            return
        got = self._arguments(args, kwargs)
        cache = cache_given(got)
        call = {"event": self._events, "cache_len": int(cache.get_seq_length()) if cache is not None else 0,
                "has_cache": cache is not None}
        for role in ("features", "noise", "positions"):
            value = got.get(self.roles[role])
            call[role] = value.detach().clone() if hasattr(value, "detach") else None
        self._events += 1
        self.calls.append(call)

    def _after(self, module, args, kwargs, output):
        self._depth -= 1
        if self._depth or not self.calls or "output" in self.calls[-1]:
            return
        hidden = output[0] if isinstance(output, tuple) else getattr(output, "last_hidden_state", output)
        self.calls[-1]["output"] = hidden.detach().clone() if hasattr(hidden, "detach") else None

    def _delivered(self, module, args, kwargs, output):
        if self._depth or not self.calls or "delivered" in self.calls[-1]:
            return
        hidden = output[0] if isinstance(output, tuple) else getattr(output, "last_hidden_state", output)
        if hasattr(hidden, "detach") and self.calls[-1].get("output") is not None and hidden is not self.calls[-1]["output"]:
            if not torch_equal(hidden, self.calls[-1]["output"]):
                self.calls[-1]["delivered"] = hidden.detach().clone()

    def _target(self, module, args, kwargs):
        cache = cache_given(kwargs)
        if cache is None:  # not a decoding step (a probe, a reference forward)
            return
        positions = kwargs.get("position_ids")
        first = int(positions.reshape(-1)[0]) if positions is not None else int(cache.get_seq_length())
        self.target_starts.append((self._events, first))
        self._events += 1

    def start_of(self, call: dict) -> int | None:
        """The committed length at a drafter call: where the next decoding forward of the target begins."""
        return next((pos for event, pos in self.target_starts if event > call["event"]), None)


# ----------------------------------------------------------------------------- the reference drafter forward
_MASKS_ITSELF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _masks_itself(module, original, bound, torch) -> bool:
    """Whether ``module`` builds a mask of its own when given none: its output given none differs from its
    output given an all-visible mask once its window is narrowed to 1 (probed once per module)."""
    if module in _MASKS_ITSELF:
        return _MASKS_ITSELF[module]
    hidden = next((v for v in bound.arguments.values() if isinstance(v, torch.Tensor)), None)
    found = False
    if hidden is not None:
        window = module.sliding_window
        try:
            module.sliding_window = 1
            outs = []
            for mask in (None, torch.zeros((1, 1, 1, 1), dtype=hidden.dtype, device=hidden.device)):
                probe = inspect.BoundArguments(bound.signature, {**bound.arguments, "attention_mask": mask})
                out = original(*probe.args, **probe.kwargs)
                outs.append((out[0] if isinstance(out, tuple) else out).float())
            found = float((outs[0] - outs[1]).abs().max()) > 1e-4 * (float(outs[1].abs().max()) + 1e-6)
        except Exception:  # a layout the probe cannot drive: mask it here
            found = False
        finally:
            module.sliding_window = window
    _MASKS_ITSELF[module] = found
    return found


@contextlib.contextmanager
def windowed(draft, positions):
    """Windowed attention modules of ``draft`` see a key at k from a query at q when ``q - k < window``,
    unless they are handed a mask or build their own: the drafter as trained, without a cache."""
    import torch

    modules = [m for m in draft.modules()
               if isinstance(getattr(m, "sliding_window", None), int) and isinstance(getattr(m, "layer_idx", None), int)]
    keys = positions[0]

    def masking(module, original):
        signature = inspect.signature(original)

        def forward(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            hidden = next((v for v in bound.arguments.values() if isinstance(v, torch.Tensor)), None)
            if "attention_mask" not in signature.parameters or hidden is None or bound.arguments.get("attention_mask") is not None:
                return original(*args, **kwargs)
            if _masks_itself(module, original, bound, torch):
                return original(*args, **kwargs)
            queries = keys[-hidden.shape[1]:]
            visible = (queries[:, None] - keys[None, :]) < module.sliding_window
            mask = torch.zeros(visible.shape, dtype=hidden.dtype, device=hidden.device)
            bound.arguments["attention_mask"] = mask.masked_fill(~visible, torch.finfo(hidden.dtype).min)[None, None]
            return original(*bound.args, **bound.kwargs)

        return forward

    own = [(m, m.__dict__.get("forward")) for m in modules]
    try:
        for m in modules:
            m.forward = masking(m, m.forward)
        yield
    finally:
        for m, before in own:
            if before is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = before


def reference_output(draft, roles: dict, features, noise, positions):
    """One drafter forward over the whole committed context, no cache."""
    import torch

    kwargs = {roles["features"]: features, roles["noise"]: noise, roles["positions"]: positions}
    if roles.get("cache"):
        kwargs[roles["cache"]] = None
    if roles.get("use_cache"):
        kwargs[roles["use_cache"]] = False
    with torch.inference_mode(), windowed(draft, positions):
        out = draft(**kwargs)
    out = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)
    return out[0].float().cpu()


class Reference:
    """The from-scratch target over the final committed sequence: features, embeddings, lm_head."""

    def __init__(self, target, draft, sequence, hidden_states=None):
        import torch

        self.target, self.draft = target, draft
        self.embed = target.get_input_embeddings()
        self.device = self.embed.weight.device
        self.sequence = list(sequence)
        if hidden_states is None:
            from ..logits import plain_forward

            shared = plain_forward(target, self.sequence, hidden_states=True)  # the logits oracle's forward, shared
            if shared is not None:
                hidden_states = shared[1]
            else:  # a routed target: its forward may follow the decode's experts (routers.following_reference)
                with torch.inference_mode():
                    ids = torch.tensor([self.sequence], device=self.device)
                    hidden_states = target(ids, use_cache=False, output_hidden_states=True).hidden_states
        self.hidden_states = hidden_states
        self.layer_ids = list(draft.target_layer_ids)
        self.features = self.pick(self.layer_ids, 1)  # [seq, F] in the target's dtype and device

    def pick(self, layer_ids, offset: int):
        import torch

        # on the embeddings' device: under a device_map the layers' hidden states live on their own devices
        return torch.cat([self.hidden_states[i + offset][0].to(self.device) for i in layer_ids], dim=-1)

    def block(self, start: int, q: int, mask_id: int):
        import torch

        ids = torch.tensor([[self.sequence[start]] + [mask_id] * (q - 1)], device=self.device)
        with torch.inference_mode():
            return self.embed(ids) * embedding_scale(self.draft)


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a.detach().to(b.device), b))


def embedding_scale(draft) -> float:
    """The scale the drafter's config puts on the noise embedding (DFlash's newest: ``input_embedding_scale``), else 1."""
    config = getattr(draft, "config", None)
    value = (getattr(config, "dflash_config", None) or {}).get("input_embedding_scale", getattr(config, "input_embedding_scale", None))
    try:
        return float(value) if value is not None else 1.0
    except (TypeError, ValueError):
        return 1.0


# ----------------------------------------------------------------------------- tolerances
@dataclass(frozen=True)
class DrafterCalibration:
    dtype: str
    floors: dict  # field -> measured floor (at least one ulp)
    tolerances: dict  # field -> tolerance

    def describe(self) -> str:
        return ", ".join(f"{k} tolerance {self.tolerances[k]:.1e} (floor {self.floors[k]:.1e})" for k in ("features", "output"))

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "floors": self.floors, "tolerances": self.tolerances}


def calibrate(target, draft, prompt, continuation, mask_id: int, block_size: int, stepped_hidden: list | None = None) -> DrafterCalibration:
    """Two exact computations of the context features (one multi-token forward without a cache, token by
    token with a cache), and the from-scratch drafter output on each: their largest differences are the floors.
    ``stepped_hidden``: the token-by-token forwards' hidden states as the greedy reference computed them
    (``models.greedy(hidden=)``, the same forwards), else computed here."""
    import torch
    from transformers import DynamicCache

    from ...models.context import with_cache

    roles = roles_of(draft)
    seq = prompt[0].tolist() + list(continuation)
    ref = Reference(target, draft, seq)
    steps = list(stepped_hidden or [])
    if not steps or sum(s[0].shape[1] for s in steps) != len(seq):  # not given, or not this sequence's
        with torch.inference_mode():
            cache = DynamicCache(config=target.config)
            ids = torch.tensor([seq], device=ref.device)
            kw = dict(**with_cache(target, cache), use_cache=True, output_hidden_states=True)
            steps = [target(ids[:, : prompt.shape[1]], **kw).hidden_states]
            for i in range(prompt.shape[1], len(seq)):
                steps.append(target(ids[:, i : i + 1], **kw).hidden_states)
    stepped = tuple(torch.cat([s[j] for s in steps], dim=1) for j in range(len(steps[0])))
    other = Reference(target, draft, seq, hidden_states=stepped)
    a, b = ref.features.float().cpu(), other.features.float().cpu()
    dtype = ref.features.dtype
    measured, top, dtype_d = 0.0, 0.0, next(draft.parameters()).dtype
    head = target.get_output_embeddings()
    logit_gap, logit_top = 0.0, 0.0
    for start in sorted({prompt.shape[1], (prompt.shape[1] + len(seq)) // 2, len(seq) - 1}):  # blocks early, midway, last
        positions = torch.arange(start + block_size, device=ref.device)[None]
        noise = ref.block(start, block_size, mask_id).to(dtype_d)
        out_a = reference_output(draft, roles, ref.features[None, :start].to(dtype_d), noise, positions)
        out_b = reference_output(draft, roles, other.features[None, :start].to(dtype_d), noise, positions)
        measured, top = max(measured, float((out_a - out_b).abs().max())), max(top, float(out_a.abs().max()))
        with torch.inference_mode():  # the same two, through the LM head: what the proposals are read from
            la, lb = (head(o[1:].to(head.weight.device, head.weight.dtype)).float() for o in (out_a, out_b))
        logit_gap, logit_top = max(logit_gap, float((la - lb).abs().max())), max(logit_top, float(la.abs().max()))
    floors = {"features": max(float((a - b).abs().max()), ulp_of(float(a.abs().max()), dtype)),
              "output": max(measured, ulp_of(top, dtype_d)), "logits": max(logit_gap, ulp_of(logit_top, head.weight.dtype))}
    tolerances = {k: MULTIPLE * v for k, v in floors.items()}
    if dtype == torch.float32:
        tolerances = {k: max(v, FLOAT32_MIN.get(k, 0.0)) for k, v in tolerances.items()}
    return DrafterCalibration(str(dtype).replace("torch.", ""), floors, tolerances)

