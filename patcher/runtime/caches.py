"""Reading and writing transformers 5.x cache layers: linear (conv, recurrent) and key/value layers, snapshots."""

from __future__ import annotations

from dataclasses import dataclass

import torch



def _is_window_layer(layer) -> bool:
    return bool(getattr(layer, "is_sliding", False)) and isinstance(getattr(layer, "sliding_window", None), int)


def _is_indexed_layer(layer) -> bool:
    return isinstance(getattr(layer, "indexer_keys", None), torch.Tensor)


def _layers(cache):
    return getattr(cache, "layers", None)


def _is_linear_layer(layer) -> bool:
    # LinearAttentionCacheLayerMixin, duck-typed so this works across minor versions.
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


def _linear_layer_ids(cache) -> list[int]:
    layers = _layers(cache)
    if layers is None:
        return []
    return [i for i, layer in enumerate(layers) if _is_linear_layer(layer)]


def _cache_length(cache) -> int:
    """Tokens in the cache as its key/value layers count them. From 5.25 a linear layer counts
    tokens too (``cumulative_length_linear``) and ``cache.get_seq_length()`` reads layer 0, which
    is linear in Qwen3.5; the runtime moves that count itself, so it reads the attention layers."""
    linear = None
    for layer in _layers(cache) or ():
        # a sliding layer hidden during compaction (windows._CompactedHere) was cut already: skip it;
        # so are layers that hold nothing (transformers' DummyLayer, for MLP and MoE blocks: no get_seq_length)
        if getattr(type(layer), "stands_in", False) or not callable(getattr(layer, "get_seq_length", None)):
            continue
        if not _is_linear_layer(layer):
            return int(layer.get_seq_length())
        linear = linear or layer
    return int(linear.get_seq_length()) if linear is not None else int(cache.get_seq_length())


def _crop_keys(layer, drop: int) -> None:
    """Drop the last ``drop`` tokens of the key/value part of a layer that is linear attention and attention at
    once (Falcon-H1's, Zaya's hybrid layers), with that part's own class crop: a sliding part (Zaya's
    ``hybrid_sliding``) also moves its token count and keeps its window, which slicing the keys would not."""
    keys = getattr(layer, "keys", None)
    if drop <= 0 or not isinstance(keys, torch.Tensor) or keys.dim() < 2 or keys.shape[-2] == 0:
        return
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin as linear
    except ImportError:  # pragma: no cover - every 5.x release has it
        linear = ()
    for klass in type(layer).__mro__[1:]:
        crop = vars(klass).get("crop")
        if crop is not None and klass is not object and not (linear and issubclass(klass, linear)):
            return crop(layer, -drop)
    layer.keys = keys[..., :-drop, :]
    layer.values = layer.values[..., :-drop, :]


def _linear_count(layer):
    """A 5.25+ linear layer's token count, as it is kept (a tensor: reading it as an int would be
    a host sync per layer); None before 5.25."""
    count = getattr(layer, "cumulative_length_linear", None)
    if count is None:
        return None
    return count.clone() if isinstance(count, torch.Tensor) else int(count)


def _set_linear_count(layer, value) -> None:
    """Set a 5.25+ linear layer's token count (in place: its address may be marked static)."""
    count = getattr(layer, "cumulative_length_linear", None)
    if value is None or count is None:
        return
    if isinstance(count, torch.Tensor):
        count.copy_(value) if isinstance(value, torch.Tensor) else count.fill_(int(value))
    else:
        layer.cumulative_length_linear = int(value)


def _shift_linear_count(layer, delta: int) -> None:
    """Add ``delta`` to a 5.25+ linear layer's token count, floored at 0, without a host sync."""
    count = getattr(layer, "cumulative_length_linear", None)
    if isinstance(count, torch.Tensor):
        count.add_(delta).clamp_(min=0)
    elif count is not None:
        layer.cumulative_length_linear = max(0, int(count) + delta)


@dataclass
class _Snapshot:
    conv: dict
    recurrent: dict
    has_previous: dict


def _state_context(tensors):
    """no_grad, or inference_mode when the cache holds inference tensors (in-place writes to
    those are only legal inside inference mode)."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode()
    if any(t is not None and t.is_inference() for t in tensors):
        return torch.inference_mode()
    return torch.no_grad()


def _real_state(cache, layer_idx: int, kernel: int):
    layer = cache.layers[layer_idx]
    if not layer.has_previous_state.get(0, False):
        return None, None
    conv = layer.conv_states[0]
    if conv is not None:
        conv = conv[..., -kernel:]  # with past recording the conv state holds more than the kernel
    return conv, layer.recurrent_states[0]


def _kernel_size(module, cache, layer_idx) -> int:
    kernel = getattr(module, "conv_kernel_size", None)
    if kernel is None:
        kernel = cache.layers[layer_idx].conv_kernel_size[0]
    return int(kernel)


def _snapshot(cache, layer_idx: int) -> _Snapshot:
    layer = cache.layers[layer_idx]
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return _Snapshot(
        conv={k: clone(v) for k, v in layer.conv_states.items()},
        recurrent={k: clone(v) for k, v in layer.recurrent_states.items()},
        has_previous=dict(layer.has_previous_state),
    )


def _restore(cache, layer_idx: int, snap: _Snapshot) -> None:
    layer = cache.layers[layer_idx]
    for store, saved in ((layer.conv_states, snap.conv), (layer.recurrent_states, snap.recurrent)):
        for k, value in saved.items():
            current = store.get(k)
            if value is None:
                continue  # was never initialised: has_previous_state below makes it ignored
            if current is not None and current.shape == value.shape:
                current.copy_(value)  # keep the tensor's address (cudagraph-friendly, like transformers)
            else:
                store[k] = value
    for k, flag in snap.has_previous.items():
        layer.has_previous_state[k] = flag


def _kv_tensors(cache):
    if _layers(cache) is not None:
        for layer in cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor):
                    yield tensor
    else:  # transformers 4.x DynamicCache
        yield from getattr(cache, "key_cache", [])
        yield from getattr(cache, "value_cache", [])



def _takes_a_count(cache) -> bool:
    """Whether this transformers' linear cache layers take ``activate_past_recording(recurrent_states_to_keep=)``
    (5.25 and newer; 5.21 to 5.24 take no argument)."""
    import inspect

    for layer in _layers(cache) or ():
        method = getattr(layer, "activate_past_recording", None)
        if method is not None and _is_linear_layer(layer):
            try:
                return "recurrent_states_to_keep" in inspect.signature(method).parameters
            except (TypeError, ValueError):
                return False
    return False


def record_past(cache, recurrent_states_to_keep=None, **kwargs) -> None:
    """``cache.activate_past_recording(...)`` as the installed transformers wants it.

    Upstream code written against 5.23 calls ``activate_past_recording()`` bare; on 5.25 that
    leaves ``recurrent_states_to_keep = None``, and the Gated DeltaNet forward then fails on
    ``min(None, seq_len)``. Code written against 5.25 passes a count, which 5.21 to 5.24 do not
    take. Here a bare call means what it meant on 5.23 (record the conv past, keep no recurrent
    states: 0), a count is passed where the release takes one and dropped where it does not. On
    every release the runtime's own record (``verify_forward``) is what makes the commit exact;
    with a count, 5.25 also rolls a chain back by itself.
    """
    method = getattr(cache, "activate_past_recording", None)
    if method is None:
        return None
    if _takes_a_count(cache):
        keep = 0 if recurrent_states_to_keep is None else int(recurrent_states_to_keep)
        return method(recurrent_states_to_keep=keep, **kwargs)
    return method(**kwargs)
