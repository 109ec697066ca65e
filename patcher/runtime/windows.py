"""Window-limited (sliding) and indexed attention layers.

A sliding-window cache layer (gpt-oss) keeps only its last ``window - 1`` keys, so after the
window is crossed (1) transformers refuses to crop it unless past recording is on, (2) a
custom 4D tree mask, which transformers hands to every layer as is, is wider than the keys
the layer returns and is never windowed, and (3) its verify rows do not sit at
``past_length + i``, where upstream compaction looks for them. An indexed-attention layer
(GLM-5's DSA, Qwen4-Exp) also keeps indexer keys per token, which upstream compaction does not
move. The functions below handle each layer by what its cache layer is, whatever the model."""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch

from .routing import _own_forward
from .errors import UnsupportedModelError
from .caches import _is_indexed_layer, _is_window_layer, _layers
from .discovery import _cache_keyword, _model_type, _text_config, _writes_state


def _record_window_past(cache) -> None:
    """Sliding layers keep a verify's keys until the crop that commits it (5.x's past recording)."""
    for layer in _layers(cache) or ():
        if _is_window_layer(layer) and not getattr(layer, "record_past", True):
            layer.activate_past_recording()
        if getattr(layer, "record_past", False) and "recurrent_states_to_keep" in vars(layer):
            # 5.25's activate_past_recording() leaves None, which its own GDN forward cannot compare
            # (min(None, seq_len)); None means "keep none": the runtime commits the state itself.
            if layer.recurrent_states_to_keep is None:
                layer.recurrent_states_to_keep = 0


def _shrink_recorded(cache) -> None:
    """After a verify was kept whole, drop what past recording kept for it: a sliding layer's keys beyond its
    window, a linear layer's conv inputs beyond its kernel (what transformers' own ``crop(0)`` does). Without
    this, forwards that are never cut back (plain greedy inside ``lossless``) grow them by one entry a token."""
    for layer in _layers(cache) or ():
        if not getattr(layer, "record_past", False):
            continue
        keys = getattr(layer, "keys", None)
        if _is_window_layer(layer) and isinstance(keys, torch.Tensor) and keys.dim() >= 2 \
                and keys.shape[-2] > layer.sliding_window - 1 and layer.get_seq_length() >= layer.sliding_window:
            layer.keys = keys[..., -layer.sliding_window + 1:, :]
            layer.values = layer.values[..., -layer.sliding_window + 1:, :]
        kernels = getattr(layer, "conv_kernel_size", None)
        for k, conv in (getattr(layer, "conv_states", None) or {}).items():
            kernel = kernels.get(k) if isinstance(kernels, dict) else None
            if isinstance(conv, torch.Tensor) and kernel and conv.shape[-1] > kernel:
                layer.conv_states[k] = conv[..., -kernel:].contiguous()


def _windowed_tree_mask(mask: torch.Tensor, window: int, kwargs: dict) -> torch.Tensor:
    """The 4D tree ``mask`` as a sliding layer must see it: cut to the keys the layer returns
    (its last ``window - 1`` prefix keys, then the verify's) and windowed (a query at position
    q sees a key at k when ``q - k < window``)."""
    L = mask.shape[-2]
    past = mask.shape[-1] - L
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor):
        q_pos = positions.reshape(-1, positions.shape[-1])[0, -L:].to(mask.device)
    else:
        q_pos = torch.arange(past, past + L, device=mask.device)
    held = min(past, window - 1)
    k_pos = torch.cat([torch.arange(past - held, past, device=mask.device), q_pos])
    too_far = (q_pos[:, None] - k_pos[None, :]) >= window
    part = mask[..., past - held :]
    if part.dtype == torch.bool:
        return part & ~too_far
    return part.masked_fill(too_far, torch.finfo(part.dtype).min)


def _windowed_mask_forwards(model, cache, mask: torch.Tensor, kwargs: dict) -> list:
    """Forward replacements that give each attention module of a sliding cache layer its
    windowed tree mask. transformers hands a custom 4D mask to every layer as is, full width
    and unwindowed, while a sliding layer returns window-limited keys."""
    layers = _layers(cache)
    if layers is None:
        return []
    windows = {i: layer.sliding_window for i, layer in enumerate(layers) if _is_window_layer(layer)}
    if not windows:
        return []
    layer_types = list(getattr(_text_config(model), "layer_types", None) or [])
    chunked = [i for i in windows if i < len(layer_types) and layer_types[i] == "chunked_attention"]
    if chunked:  # same cache layer as a sliding one, but the mask follows chunk boundaries, not a window
        raise UnsupportedModelError(
            f"ddpatch: {_model_type(model)} layer {chunked[0]} uses chunked attention; ddpatch cannot build its "
            "tree mask, so a tree verify cannot be exact on it; use a chain (DFlash) verify"
        )
    found: dict[int, list] = {i: [] for i in windows}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and idx in found and _cache_keyword(module) and not _writes_state(module):
            try:
                if "attention_mask" in inspect.signature(type(module).forward).parameters:
                    found[idx].append(module)
            except (TypeError, ValueError):
                continue
    masks: dict[int, torch.Tensor] = {}
    replacements = []
    for idx, modules in found.items():
        inner = [m for m in modules if not any(o is not m and any(o is d for d in m.modules()) for o in modules)]
        if not inner:
            raise UnsupportedModelError(
                f"ddpatch: {_model_type(model)} layer {idx} has a sliding-window cache but no attention module "
                "ddpatch can give a windowed tree mask"
            )
        window = windows[idx]
        if window not in masks:
            masks[window] = _windowed_tree_mask(mask, window, kwargs)
        for module in inner:
            replacements.append((module, _with_mask(_own_forward(module), masks[window])))
    return replacements


def _with_mask(original: Callable, windowed: torch.Tensor) -> Callable:
    signature = inspect.signature(original)

    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["attention_mask"] = windowed
        return original(*bound.args, **bound.kwargs)

    return forward


class _CompactedHere:
    """Stands in for a sliding layer during upstream's compaction: no keys (so any compaction
    skips it), a crop that does nothing, everything else read from the real layer."""

    keys = values = None
    stands_in = True  # caches._cache_length reads the length from a real layer

    def __init__(self, layer):
        self._layer = layer

    def crop(self, tokens_to_remove: int) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._layer, name)


def _compact_keyed_layers(cache, past_length: int, keep: list[int]) -> dict:
    """Compact what upstream's row arithmetic gets wrong: the indexer keys of indexed layers, and
    sliding layers, whose verify rows start at ``len(keys) - verify length``. Sliding layers are
    also cropped here; returns ``{layer index: layer}`` of those, for ``_hide_layers``."""
    done = {}
    for i, layer in enumerate(_layers(cache) or ()):
        if _is_indexed_layer(layer) and layer.indexer_keys.shape[1] > past_length:
            rows = torch.tensor(keep, dtype=torch.long, device=layer.indexer_keys.device) + past_length
            layer.indexer_keys[:, past_length : past_length + len(keep)] = layer.indexer_keys.index_select(1, rows)
        if not _is_window_layer(layer) or not isinstance(layer.keys, torch.Tensor) or layer.keys.dim() < 2:
            continue
        verify_len = int(layer.get_seq_length()) - int(past_length)
        if verify_len <= 0:
            continue
        start = layer.keys.shape[-2] - verify_len
        if keep:
            rows = torch.tensor(keep, dtype=torch.long, device=layer.keys.device) + start
            for store in (layer.keys, layer.values):
                store[..., start : start + len(keep), :] = store.index_select(-2, rows)
        if not getattr(layer, "record_past", False) and layer.get_seq_length() >= layer.sliding_window:
            raise RuntimeError(
                f"ddpatch: sliding-window layer {i} crossed its window without past recording; call the target "
                "through verify_forward so that the verify can be committed"
            )
        type(layer).crop(layer, -(verify_len - len(keep)))
        done[i] = layer
    return done


@contextlib.contextmanager
def _hide_layers(cache, layers: dict):
    """Put ``_CompactedHere`` stand-ins in place of ``layers`` for the duration."""
    try:
        for i, layer in layers.items():
            cache.layers[i] = _CompactedHere(layer)
        yield
    finally:
        for i, layer in layers.items():
            cache.layers[i] = layer

