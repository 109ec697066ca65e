"""Draft: sliding-window layers without flash-attn."""

from __future__ import annotations

import contextvars
import inspect
import weakref
from typing import Any

import torch

from .caches import _layers
from .discovery import _cache_of, _is_cache
from .probes import _check_draft_reads
from .strategies import _swapped_forwards


# model -> tuple of attention modules that declare a sliding window
_WINDOWED: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _windowed_modules(model) -> tuple:
    try:
        return _WINDOWED[model]
    except (KeyError, TypeError):
        pass
    found = tuple(
        m
        for m in model.modules()
        if isinstance(getattr(m, "sliding_window", None), int) and isinstance(getattr(m, "layer_idx", None), int)
    )
    try:
        _WINDOWED[model] = found
    except TypeError:
        pass
    return found


# set while a draft_forward call runs: a draft_forward nested inside it (upstream's drafter forward
# calling its own layers through the helper) is a plain call, since the outer call already routes
# every windowed module below it, and routing a module twice would make its route call itself
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("ddpatch_draft_forward_active", default=False)


# attention module -> whether it builds a mask of its own when it is given none
_MASKS_ITSELF: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _masks_itself(module, original, bound) -> bool:
    """Whether ``module`` builds its own mask when it is given none (DFlash's newest drafter: causal
    and windowed on its sliding layers), so that ``draft_forward`` must leave it alone.

    Probed once per module on the call's own inputs with the cache left out (nothing is written):
    its output given no mask against its output given a mask that hides nothing, while its
    ``sliding_window`` is narrowed to 1 so that a mask built from the window shows even on a
    short context. A module whose probe cannot run is taken as not masking itself.
    """
    try:
        return _MASKS_ITSELF[module]
    except (KeyError, TypeError):
        pass
    hidden = bound.arguments.get("hidden_states", next(iter(bound.arguments.values()), None))
    found = False
    if isinstance(hidden, torch.Tensor):
        args = dict(bound.arguments)
        for name, value in list(args.items()):
            if isinstance(value, dict):  # **kwargs
                args[name] = {k: (None if _is_cache(v) else v) for k, v in value.items()}
            elif _is_cache(value):
                args[name] = None
        window = module.sliding_window
        try:
            module.sliding_window = 1
            with torch.no_grad():
                outputs = []
                for mask in (None, torch.zeros((1, 1, 1, 1), dtype=hidden.dtype, device=hidden.device)):
                    probe = inspect.BoundArguments(bound.signature, {**args, "attention_mask": mask})
                    out = original(*probe.args, **probe.kwargs)
                    outputs.append((out[0] if isinstance(out, tuple) else out).float())
            scale = float(outputs[1].abs().max()) + 1e-6
            found = float((outputs[0] - outputs[1]).abs().max()) > 1e-4 * scale
        except Exception:  # a layout the probe cannot drive: keep draft_forward's own mask
            found = False
        finally:
            module.sliding_window = window
    try:
        _MASKS_ITSELF[module] = found
    except TypeError:
        pass
    return found


def draft_forward(model, *args, **kwargs):
    """``model(*args, **kwargs)`` for a DFlash-style draft, with its sliding windows honoured.

    Qwen3.6 drafters have sliding-window layers (4 of 5, window 2048). Upstream's draft
    passes no mask and hands ``sliding_window=`` to the attention function: flash-attn
    applies it, but sdpa and eager ignore it, so once flash-attn is absent (the fallback
    that makes the code run) every layer silently attends to the whole context. Here each
    windowed attention module gets an explicit mask for the call: a query at position q
    sees a key at position k when ``q - k < window`` (the block itself stays
    bidirectional). With flash-attn, without windowed layers, or when the caller passes
    its own mask, this is exactly ``model(...)``; so is every module the drafter masks
    itself -- one its parent hands a mask, or one that builds its own when given none
    (``_masks_itself``): a mask the drafter was trained with is never replaced.
    """
    if _ACTIVE.get():
        return model(*args, **kwargs)
    _check_draft_reads(model, kwargs)
    modules = _windowed_modules(model)
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "")
    positions = kwargs.get("position_ids")
    if not modules or impl.startswith("flash") or kwargs.get("attention_mask") is not None or positions is None:
        return model(*args, **kwargs)
    _, cache = _cache_of(kwargs)
    cached = int(cache.get_seq_length()) if cache is not None else 0
    layers = _layers(cache) if cache is not None else None
    key_positions = torch.cat([torch.arange(cached, device=positions.device), positions[0]])

    def masked(original, module):
        signature = inspect.signature(original)

        def forward(*f_args, **f_kwargs):
            bound = signature.bind(*f_args, **f_kwargs)
            hidden = bound.arguments.get("hidden_states", f_args[0] if f_args else None)
            if "attention_mask" not in signature.parameters or hidden is None:
                return original(*f_args, **f_kwargs)
            if bound.arguments.get("attention_mask") is not None or _masks_itself(module, original, bound):
                return original(*f_args, **f_kwargs)  # the drafter masks this layer itself: never replace its mask
            layer = layers[module.layer_idx] if layers is not None and module.layer_idx < len(layers) else None
            keys = key_positions
            if layer is not None and getattr(layer, "is_sliding", False):
                # a sliding cache layer (a cache built from the drafter's config) hands attention the last
                # `window - 1` keys it kept and then the new ones: that trims, it does not window a query
                # of several tokens, so the mask covers exactly those keys
                seen = int(layer.get_seq_length())
                kept = min(seen, int(getattr(layer, "sliding_window", module.sliding_window)) - 1)
                keys = torch.cat([torch.arange(seen - kept, seen, device=positions.device), positions[0]])
            q_pos = positions[0, -hidden.shape[1] :]
            visible = (q_pos[:, None] - keys[None, :]) < module.sliding_window
            mask = torch.zeros(visible.shape, dtype=hidden.dtype, device=hidden.device)
            mask.masked_fill_(~visible, torch.finfo(hidden.dtype).min)
            bound.arguments["attention_mask"] = mask[None, None]
            return original(*bound.args, **bound.kwargs)

        return forward

    token = _ACTIVE.set(True)
    try:
        with _swapped_forwards([(module, masked(module.forward, module)) for module in modules]):
            return model(*args, **kwargs)
    finally:
        _ACTIVE.reset(token)

