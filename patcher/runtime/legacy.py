"""The legacy cache format transformers 5.x removed, for a cache whose every layer holds keys and values.

transformers 4.x had ``DynamicCache.to_legacy_cache()`` (a tuple of ``(keys, values)`` per layer),
``DynamicCache.from_legacy_cache(...)`` and ``cache[i]``; 5.0 removed them with the tuple format.
These functions do what 4.57 did, on 5.x caches. A layer without keys (a Gated DeltaNet layer's
conv and recurrent state) has no place in a tuple of keys and values: they refuse it in one line
rather than drop its state. The recipe only rewrites a draft's cache to call them (a drafter is
pure attention); a target's is refused before anything is written.
"""

from __future__ import annotations


def _kv_layers(cache, what: str) -> list:
    layers = list(getattr(cache, "layers", None) or [])
    for i, layer in enumerate(layers):
        if not hasattr(layer, "keys") or not hasattr(layer, "values"):
            raise TypeError(f"{what}: layer {i} of the cache ({type(layer).__name__}) holds no keys and values (a linear-attention "
                            "state): the legacy tuple format cannot hold it; keep the cache object")
    return layers


def to_legacy_cache(cache) -> tuple:
    """``cache.to_legacy_cache()`` as transformers 4.57 had it: ``((keys, values), ...)``, one pair per layer."""
    return tuple((layer.keys, layer.values) for layer in _kv_layers(cache, "to_legacy_cache"))


def legacy_layer(cache, index: int) -> tuple:
    """``cache[index]`` as transformers 4.57 had it: layer ``index``'s ``(keys, values)``."""
    layers = _kv_layers(cache, "cache[i]")
    if not -len(layers) <= index < len(layers):
        raise KeyError(f"Cache only has {len(layers)} layers, attempted to access layer with index {index}")
    return layers[index].keys, layers[index].values


def from_legacy_cache(past_key_values):
    """``DynamicCache.from_legacy_cache(past_key_values)`` as transformers 4.57 had it: a new ``DynamicCache`` with each
    layer's keys and values (``None``: an empty cache)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if past_key_values is not None:
        for layer_idx, (keys, values, *_) in enumerate(past_key_values):
            cache.update(keys, values, layer_idx)
    return cache
