"""A target's cache, laid out for the target at its first use (``adopt_forward``; ``verify_forward`` adopts too).

Patched code may hand a hybrid target a cache whose owner its text does not say: one factory
for both models, caches kept in a dict or a namespace, ``DynamicCache() if ... else ...``. On
transformers 5.x a cache built without a config has no linear-attention slots, and the target's
first forward fails in ``get_conv_state``. Here the object decides, not the spelling: a
``DynamicCache`` built without a config that holds nothing yet gets the layers
``DynamicCache(config=model.config)`` would have, before any state is written. A cache that
already holds state (another model used it), or that was built with another model's layout,
is refused in one line: nothing can lay it out for the target any more.
"""

from __future__ import annotations

from .caches import _is_linear_layer
from .discovery import _cache_of, _call_kwargs, _model_type, hybrid_linear_modules
from .errors import UnsupportedModelError


def _held_tokens(cache) -> int:
    layers = cache.layers
    if not any(getattr(layer, "is_initialized", False) for layer in layers):
        return 0
    try:
        return max(1, int(cache.get_seq_length()))
    except Exception:  # a layer type that cannot say: it holds something
        return 1


def adopt_cache(model, cache) -> None:
    """Give ``cache`` ``model``'s layer layout if it was built without a config and holds nothing yet.

    A model without recurrent state runs on any ``DynamicCache``, and a cache whose stateful
    layers are already linear-attention layers is laid out for a hybrid model: both are left
    as they are. A layer type ddpatch does not know is left to the caller's own refusal.
    """
    if cache is None or not isinstance(getattr(cache, "layers", None), list):
        return
    try:
        modules = hybrid_linear_modules(model)
    except UnsupportedModelError:
        return
    layers = cache.layers
    if not modules or all(i < len(layers) and _is_linear_layer(layers[i]) for i, _ in modules):
        return
    from transformers import DynamicCache

    who = _model_type(model)
    held = _held_tokens(cache)
    if held:
        raise UnsupportedModelError(
            f"ddpatch: the cache handed to the {who} target was built without its config and already holds {held} "
            "token(s) of another model's state; build the target's cache with DynamicCache(config=target.config)"
        )
    if not isinstance(cache, DynamicCache) or getattr(cache, "layer_class_to_replicate", None) is None:
        raise UnsupportedModelError(
            f"ddpatch: the cache handed to the {who} target ({type(cache).__name__}, {len(layers)} layers) is laid "
            "out for another model; build the target's cache with DynamicCache(config=target.config)"
        )
    fresh = DynamicCache(config=model.config)
    cache.layers = fresh.layers
    cache.layer_class_to_replicate = fresh.layer_class_to_replicate


def adopt_forward(model, *args, **kwargs):
    """``model(*args, **kwargs)`` after ``adopt_cache`` on the cache it is given (the target's prefill);
    ``past_key_values=`` goes in as ``cache=`` where the model's forward takes that (transformers 5.24+)."""
    kwargs = _call_kwargs(model, kwargs)
    _, cache = _cache_of(kwargs)
    adopt_cache(model, cache)
    return model(*args, **kwargs)
