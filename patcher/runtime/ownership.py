"""The commit belongs to the cache.

verify_forward makes the recorded cache's own ``crop`` (and its linear layers' ``crop``)
commit the record, so every way of cutting the cache back is exact, whatever the calling
code looks like: a native 5.x ``cache.crop(-n)``, a helper of any shape that ends in it,
``crop_cache``, ``compact_cache`` or ``@tree_commit``. Anything that shortens the cache
without a crop (slicing key/value tensors by hand) is caught at the next crop or verify and
raises, because the recurrent state can no longer be made exact."""

from __future__ import annotations

import weakref


from .caches import _crop_keys, _linear_layer_ids, _shift_linear_count
from .record import _get_record, _usable
from .commit import _commit_for_drop, _cut, _trim_conv


_OWNED_ATTR = "_ddpatch_owned"


class _OwnedCrop:
    """A recorded cache's ``crop``: transformers 5.x's (a negative count of tokens to drop),
    committed exactly by ddpatch. An object, not a closure, so that a copy of the cache
    (``copy.deepcopy``, pickle) gets a crop bound to the copy, never to the original."""

    def __init__(self, cache):
        self._ref = weakref.ref(cache)

    def __reduce_ex__(self, protocol):
        return (_OwnedCrop, (self._ref(),))

    def __call__(self, tokens_to_remove: int) -> None:
        cache = self._ref()
        count = int(tokens_to_remove)
        if count > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{count}`) is not supported. Please use a negative "
                "integer to remove that number of tokens from the cache instead."
            )
        _cut(cache, -count)


class _OwnedLayerCrop:
    """A linear layer's 5.x ``crop``, reached directly: commit the whole record once, then trim."""

    def __init__(self, cache, index: int, layer):
        self._ref, self._index, self._layer = weakref.ref(cache), index, weakref.ref(layer)

    def __reduce_ex__(self, protocol):
        return (_OwnedLayerCrop, (self._ref(), self._index, self._layer()))

    def __call__(self, tokens_to_remove: int) -> None:
        cache, layer = self._ref(), self._layer()
        layers = getattr(cache, "layers", None)
        if cache is None or layers is None or self._index >= len(layers) or layers[self._index] is not layer:
            raise RuntimeError(
                f"ddpatch: linear-attention layer {self._index} was cropped through a cache it no longer belongs to "
                "(two caches sharing layer objects?); its recurrent state cannot be committed exactly"
            )
        drop = -int(tokens_to_remove)
        if drop < 0:
            raise RuntimeError(
                "Linear attention layers can only be cropped by passing a negative int, to specify how many "
                "tokens to remove"
            )
        record = _usable(cache, _get_record(cache))
        if record is not None and record.settled is None:
            _commit_for_drop(cache, record, drop)
        _shift_linear_count(layer, -drop)
        _crop_keys(layer, drop)
        _trim_conv(cache)


def _own_crop(cache) -> None:
    """Make ``cache.crop`` (and each linear layer's ``crop``) commit a recorded verify. Idempotent.

    A layer already owned by another live cache (two caches sharing layer objects) raises:
    whichever cache crops it, the other's record would be committed on it."""
    crop = cache.__dict__.get("crop")
    if cache.__dict__.get(_OWNED_ATTR) and isinstance(crop, _OwnedCrop) and crop._ref() is cache:
        return
    cache.crop = _OwnedCrop(cache)
    for i in _linear_layer_ids(cache):
        layer = cache.layers[i]
        owned = layer.__dict__.get("crop")
        if isinstance(owned, _OwnedLayerCrop) and owned._ref() is not None and owned._ref() is not cache:
            other = owned._ref()
            if i < len(getattr(other, "layers", ())) and other.layers[i] is layer:
                raise RuntimeError(
                    f"ddpatch: linear-attention layer {i} of this cache is shared with another cache that ddpatch "
                    "records; their verifies cannot both be committed exactly (give each cache its own layers)"
                )
        layer.crop = _OwnedLayerCrop(cache, i, layer)
    setattr(cache, _OWNED_ATTR, True)
