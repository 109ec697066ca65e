"""Which layers keep a recurrent/conv state, which module updates it, and how it takes the cache.

Everything here is found by what a thing is (a parameter annotated with a ``Cache`` type, code that
updates a conv/recurrent state), not by names that change between transformers releases."""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from typing import Any, Callable

import torch

from .errors import UnsupportedModelError, _check_transformers_version


# model -> tuple of (layer_idx, stateful mixer); an empty tuple for a model without such layers.
_MODEL_INFO: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


# mixer -> the keyword its forward takes the cache under ("cache_params", "cache" or "past_key_values")
_CACHE_KEYWORD: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


_CACHE_KEYWORDS = ("cache_params", "cache", "past_key_values")  # only for forwards without annotations


def _text_config(model):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return config


def _model_type(model) -> str:
    config = _text_config(model)
    return str(getattr(config, "model_type", None) or type(model).__name__)


def _layer_kinds(config) -> list:
    """Per layer: "state" (a recurrent/conv state a crop cannot undo), "keys" (per-token keys and
    values only: crop and compaction handle it), or the class name of a cache layer this runtime
    does not know. Read from what the cache would be built from: the config's ``layer_types``
    and transformers' own layer-type -> cache-layer mapping."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    if not layer_types:
        return []
    try:
        from transformers import cache_utils
    except ImportError:  # no transformers: judge by the names 5.x uses
        stateful = {"linear_attention", "conv", "hybrid", "hybrid_sliding"}
        return ["state" if t in stateful else "keys" for t in layer_types]
    mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", {})
    linear = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
    keyed = tuple(
        getattr(cache_utils, name)
        for name in ("DynamicLayer", "DynamicSlidingWindowLayer", "DynamicIndexedLayer", "DummyLayer")
        if hasattr(cache_utils, name)
    )
    kinds = []
    for kind in layer_types:
        if kind in ("moe", "mlp"):  # transformers turns these into DummyLayer
            kinds.append("keys")
            continue
        cls = mapping.get(kind)
        if cls is None:
            kinds.append(f"layer type {kind!r}")
        elif linear and issubclass(cls, linear):
            kinds.append("state")
        elif cls in keyed:
            kinds.append("keys")
        else:
            kinds.append(f"{cls.__name__} ({kind!r})")
    return kinds


def _names_a_cache(annotation) -> bool:
    """Whether a parameter annotation names a cache type: ``Cache``, ``DynamicCache | None``,
    ``Optional["Qwen3_5DynamicCache"]``, or the same as a string (``from __future__ import annotations``)."""
    if annotation is inspect.Parameter.empty or annotation is None:
        return False
    if isinstance(annotation, str):
        return any(name.rsplit(".", 1)[-1].endswith("Cache") for name in re.findall(r"[A-Za-z_][\w.]*", annotation))
    if isinstance(annotation, type):
        return any(klass.__name__.endswith("Cache") for klass in annotation.__mro__)
    return any(_names_a_cache(arg) for arg in getattr(annotation, "__args__", None) or ())


def _cache_keyword(module) -> str | None:
    """The keyword under which ``module``'s forward takes the cache, found by what the parameter
    is (annotated with a ``Cache`` type: ``cache_params`` up to 5.23, ``cache`` from 5.24), and by
    name only for a forward whose parameters carry no annotation at all."""
    forward = getattr(type(module), "forward", None)
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    named = [p for p in parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    annotated = [p.name for p in named if _names_a_cache(p.annotation)]
    if annotated:
        return annotated[0]
    if any(p.annotation is not inspect.Parameter.empty for p in named):
        return None
    return next((k for k in _CACHE_KEYWORDS if k in parameters), None)


def _cache_of(kwargs: dict):
    """``(keyword, cache)`` of a model call: the cache given under any keyword (``past_key_values``
    up to 5.23, ``cache`` from 5.24), found by what it is; ``(None, None)`` without one."""
    for name in ("past_key_values", "cache"):
        value = kwargs.get(name)
        if value is not None and not isinstance(value, (torch.Tensor, bool, int, float, str)):
            return name, value
    for name, value in kwargs.items():
        if _is_cache(value):
            return name, value
    return None, None


# class -> whether its forward takes the cache as ``cache=`` (transformers 5.24+; ``past_key_values=`` is deprecated there)
_TAKES_CACHE: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _takes_cache_keyword(model) -> bool:
    """Whether ``model``'s class forward has a ``cache`` parameter (a ``Cache`` annotation or none at
    all): transformers 5.24+ models do, 5.21-5.23 and drafters written with ``past_key_values`` do not."""
    cls = type(model)
    try:
        return _TAKES_CACHE[cls]
    except (KeyError, TypeError):
        pass
    try:
        parameter = inspect.signature(getattr(cls, "forward", None)).parameters.get("cache")
    except (TypeError, ValueError):
        parameter = None
    found = parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and (
        parameter.annotation is inspect.Parameter.empty or _names_a_cache(parameter.annotation)
    )
    try:
        _TAKES_CACHE[cls] = found
    except TypeError:
        pass
    return found


def _call_kwargs(model, kwargs: dict) -> dict:
    """``kwargs`` with ``past_key_values=`` renamed ``cache=`` where ``model``'s forward takes ``cache``
    (transformers 5.24+ warns on the old name, 5.40 drops it); unchanged for a forward that takes only
    ``past_key_values`` (5.21-5.23, a custom drafter) or a call that already names ``cache``."""
    if "past_key_values" not in kwargs or "cache" in kwargs or not _takes_cache_keyword(model):
        return kwargs
    return {("cache" if k == "past_key_values" else k): v for k, v in kwargs.items()}


def _is_cache(value) -> bool:
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str, tuple, list, dict)):
        return False
    return any(klass.__name__ == "Cache" for klass in type(value).__mro__) or (
        hasattr(value, "get_seq_length") and hasattr(value, "layers")
    )


_STATE_WRITERS: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


_STATE_UPDATES = ("update_conv_state", "update_recurrent_state")


def _writes_state(module) -> bool:
    """Whether the module's class has code that updates a conv/recurrent cache state (read
    from the bytecode of its own methods, so attention modules, which only ``update`` keys and
    values, are told apart from Mamba, short-conv and linear-attention mixers)."""
    cls = type(module)
    try:
        return _STATE_WRITERS[cls]
    except KeyError:
        pass
    found = False
    for klass in cls.__mro__:
        if klass is torch.nn.Module or klass is object:
            continue
        for value in vars(klass).values():
            function = inspect.unwrap(value) if callable(value) else None
            code = getattr(function, "__code__", None)
            if code is None:
                continue
            # the method itself, or a modeling-file helper it calls (5.25: causal_conv1d_forward,
            # mamba2_scan_forward take the cache and update its state)
            namespace = getattr(function, "__globals__", {})
            codes = [code] + [
                getattr(_raw_function(namespace[name], namespace), "__code__", None)
                for name in code.co_names
                if callable(namespace.get(name)) and not isinstance(namespace.get(name), type)
            ]
            if any(c is not None and any(name in c.co_names for name in _STATE_UPDATES) for c in codes):
                found = True
                break
        if found:
            break
    _STATE_WRITERS[cls] = found
    return found


def _state_mixer(model, layer_idx: int, candidates: list):
    """The one module of layer ``layer_idx`` that reads and writes its recurrent/conv state.

    ``candidates`` are the innermost modules of that layer that take a cache; the owner is the
    one whose code updates a conv/recurrent state (in a hybrid layer, Mamba next to attention).
    """
    writers = [m for m in candidates if _writes_state(m)]
    if len(writers) == 1:
        return writers[0]
    names = ", ".join(sorted(type(m).__name__ for m in candidates)) or "none"
    raise UnsupportedModelError(
        f"ddpatch: {_model_type(model)} layer {layer_idx} keeps a recurrent/conv state, but ddpatch finds "
        f"{'no' if not writers else 'more than one'} module there that updates it (modules that take the "
        f"cache: {names}); its rollback is not supported"
    )


def hybrid_linear_modules(model) -> tuple:
    """``((layer_idx, stateful_mixer), ...)`` of ``model`` in layer order; empty without such layers.

    Which layers are stateful is read from what the cache says: the text config's
    ``layer_types`` mapped through transformers' own cache-layer classes (every layer type
    whose cache layer is a ``LinearAttentionCacheLayerMixin``: linear attention, short conv,
    Mamba, hybrid). The mixer of such a layer is the innermost module with that ``layer_idx``
    whose forward takes the cache (``cache_params=`` or ``past_key_values=``), whatever its
    attribute is called (``linear_attn``, ``self_attn``, ``mixer``, ``mamba``, ``conv``). A
    layer type without a known cache layer, or a stateful layer without exactly one owner,
    raises ``UnsupportedModelError``: guessing would make the output lossy.
    """
    try:
        return _MODEL_INFO[model]
    except (KeyError, TypeError):
        pass
    _check_transformers_version()
    config = _text_config(model)
    kinds = _layer_kinds(config) if config is not None else []
    unknown = [(i, kind) for i, kind in enumerate(kinds) if kind not in ("state", "keys")]
    if unknown:
        i, kind = unknown[0]
        raise UnsupportedModelError(
            f"ddpatch: {_model_type(model)} layer {i} uses {kind}, a cache layer ddpatch cannot roll back "
            "or compact; this model is not supported"
        )
    stateful = {i for i, kind in enumerate(kinds) if kind == "state"}
    info: tuple = ()
    if stateful:
        by_layer: dict[int, list] = {i: [] for i in stateful}
        for module in model.modules():
            idx = getattr(module, "layer_idx", None)
            if isinstance(idx, int) and idx in by_layer and _cache_keyword(module):
                _CACHE_KEYWORD[module] = _cache_keyword(module)
                by_layer[idx].append(module)
        for idx, found in by_layer.items():
            # innermost only: a decoder layer that passes the cache on to its mixer is not the owner
            by_layer[idx] = [m for m in found if not any(o is not m and any(o is d for d in m.modules()) for o in found)]
        info = tuple(sorted((i, _state_mixer(model, i, by_layer[i])) for i in stateful))
    try:
        _MODEL_INFO[model] = info
    except TypeError:  # not weak-referenceable: just don't cache
        pass
    return info


def _cache_kwargs(module, cache) -> dict:
    """``{keyword: cache}`` the way ``module`` takes its cache (LFM2's short conv: ``past_key_values``)."""
    return {_CACHE_KEYWORD.get(module) or _cache_keyword(module) or "cache_params": cache}


def _keyword_adapted(make: Callable) -> Callable:
    """A tree-forward builder for mixers that take the cache under another keyword.

    The builders call ``original(hidden, cache_params=scratch, ...)`` and are called with
    ``cache_params=``; for a ``past_key_values=`` mixer both ends are renamed here."""

    @functools.wraps(make)
    def build(original: Callable, module, *rest):
        keyword = _CACHE_KEYWORD.get(module) or _cache_keyword(module)
        if keyword in (None, "cache_params"):
            return make(original, module, *rest)

        def inner(hidden_states, *args, cache_params=None, **kwargs):
            return original(hidden_states, *args, **{keyword: cache_params}, **kwargs)

        forward = make(inner, module, *rest)

        def outer(hidden_states, *args, **kwargs):
            if keyword in kwargs:
                kwargs["cache_params"] = kwargs.pop(keyword)
            return forward(hidden_states, *args, **kwargs)

        return outer

    return build


def _raw_function(function, namespace):
    """The plain function of the modeling file behind ``function``: unwrapped, and for a function
    turned into a module by a kernel hub (``kernels``' ``Func``), the function its forward closes
    over. None when it is not defined in ``namespace``."""
    candidates = [inspect.unwrap(function)]
    forward = getattr(type(function), "forward", None) if isinstance(function, torch.nn.Module) else None
    if forward is not None:
        cells = getattr(inspect.unwrap(forward), "__closure__", None) or ()
        for cell in cells:
            try:
                candidates.append(inspect.unwrap(cell.cell_contents))
            except ValueError:
                continue
    for raw in candidates:
        if getattr(raw, "__code__", None) is not None and getattr(raw, "__globals__", None) is namespace:
            return raw
    return None

