"""Models that cannot be served exactly: found by probing, refused in one line."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .errors import UnsupportedModelError
from .discovery import _layer_kinds, _model_type, _text_config


_MASK_PROBED: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _check_mask_honoured(model, mask: torch.Tensor) -> None:
    """Refuse a model that ignores a custom 4D attention mask: no tree verify can be exact on it.

    Probed once per model, on three tokens without a cache: hiding the first two tokens from
    the third must change the third's logits (its last hidden state, for a backbone handed in
    without its LM head: ``target.model``, ``get_decoder()``). A model with no attention layer is
    not probed.
    """
    try:
        if _MASK_PROBED[model]:
            return
    except (KeyError, TypeError):
        pass
    config = _text_config(model)
    kinds = _layer_kinds(config) if config is not None else []
    if kinds and all(kind == "state" for kind in kinds):
        return
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else mask.device
    dtype = mask.dtype if mask.dtype != torch.bool else (param.dtype if param is not None else torch.float32)
    vocab = int(getattr(config, "vocab_size", 3) or 3)
    ids = torch.tensor([[1 % vocab, 2 % vocab, 3 % vocab]], device=device)
    low = torch.finfo(dtype).min if dtype.is_floating_point else 0
    causal = torch.full((3, 3), low, dtype=dtype, device=device).triu(1)
    alone = torch.full((3, 3), low, dtype=dtype, device=device)
    alone.fill_diagonal_(0)
    alone[1, 0] = 0
    with torch.no_grad():
        seen = _last_scores(model(ids, attention_mask=causal[None, None], use_cache=False))
        hidden = _last_scores(model(ids, attention_mask=alone[None, None], use_cache=False))
    # Logits pinned at the dtype's minimum (suppressed vocabulary entries) carry no signal and
    # would swamp a tolerance scaled by the largest magnitude: compare only the others.
    floor = torch.finfo(seen.dtype).min / 2 if seen.dtype.is_floating_point else float("-inf")
    seen, hidden = seen.float(), hidden.float()
    live_seen = torch.isfinite(seen) & (seen > floor)
    live_hidden = torch.isfinite(hidden) & (hidden > floor)
    live = live_seen & live_hidden
    scale = float(seen[live].abs().max()) if bool(live.any()) else 1.0
    diff = float((seen - hidden)[live].abs().max()) if bool(live.any()) else 0.0
    if torch.equal(live_seen, live_hidden) and diff <= 1e-6 * max(1.0, scale):
        raise UnsupportedModelError(
            f"ddpatch: {_model_type(model)} ignores a custom 4D attention mask (hiding earlier tokens did not "
            "change the logits), so a tree verify cannot be exact on it; use a chain (DFlash) verify"
        )
    try:
        _MASK_PROBED[model] = True
    except TypeError:
        pass


def _last_scores(output) -> torch.Tensor:
    """The last token's output of a probe forward: logits from a model with an LM head, the last
    hidden state from a backbone (whose output has no ``logits``), the first tensor of a tuple."""
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value[0, -1]
    first = output[0] if isinstance(output, (tuple, list)) else None
    if isinstance(first, torch.Tensor):
        return first[0, -1]
    raise UnsupportedModelError(
        f"ddpatch: the probe forward returned {type(output).__name__}, with neither logits nor a last hidden "
        "state, so ddpatch cannot tell whether the model honours a 4D attention mask"
    )


def _checked_hidden_states(model, output):
    """Refuse hidden states a DFlash draft cannot read: not ``[batch, tokens, hidden_size]``
    (e.g. 4D hyper-connection streams, or several streams concatenated)."""
    states = getattr(output, "hidden_states", None)
    if not states:
        return output
    size = getattr(_text_config(model), "hidden_size", None)
    for h in states:
        if isinstance(h, torch.Tensor) and (h.dim() != 3 or (size is not None and h.shape[-1] != size)):
            raise UnsupportedModelError(
                f"ddpatch: {_model_type(model)} returns hidden states of shape {tuple(h.shape)} for hidden size "
                f"{size} (hyper-connection streams?); a DFlash draft cannot read them as they are"
            )
    return output


def _check_draft_reads(model, kwargs: dict) -> None:
    """Refuse target features whose width the draft's input projection does not take."""
    features = kwargs.get("target_hidden")
    fc = getattr(model, "fc", None)
    if isinstance(features, torch.Tensor) and features.dim() != 3:
        raise UnsupportedModelError(
            f"ddpatch: the target's hidden states reach the draft as shape {tuple(features.shape)}, not "
            "[batch, tokens, features] (hyper-connection streams?); a DFlash draft cannot read them as they are"
        )
    # a fork may project the features itself first (``model.project_target_hidden(...)``: the draft's own fc and norm)
    # and hand the draft what its fc gives: that width is read as it is, never refused
    widths = (fc.in_features, fc.out_features) if isinstance(fc, torch.nn.Linear) else ()
    if isinstance(features, torch.Tensor) and widths and features.shape[-1] not in widths:
        raise UnsupportedModelError(
            f"ddpatch: the target's hidden states give {features.shape[-1]} features per token where the draft "
            f"reads {fc.in_features} (target hidden states of another width, e.g. hyper-connection streams); "
            "a DFlash draft cannot read them as they are"
        )

