"""What ``lossless`` puts on a model instance for the duration of the context, and takes off again.

* a recording forward: every forward of the instance that carries a cache goes through
  ``runtime.verify_forward`` (the control, ``record=False``, only lifts the refusals);
* the instance attribute ``_is_stateful = False`` (5.21 - 5.23 refuse a stateful class);
* a cache such a forward recorded reports ``is_croppable`` (5.24 refuses assisted decoding otherwise): its
  class is swapped for a subclass that says so, and swapped back when the innermost context ends.

A model given after the first one (``lossless(target, assistant)``) is a drafter: transformers cuts its cache
back across several of its own forwards (it drafts token by token, then the target rejects some), so its
recording spans forwards until a cut (``DRAFTER_SPAN`` tokens at most) instead of one forward.
"""

from __future__ import annotations

import functools
import threading

_MISSING = object()
_STATE = threading.local()

#: Tokens an assistant's recording may span across its forwards: a cut back within them is exact. transformers
#: drafts up to ``num_assistant_tokens`` (20 by default, +2 after each fully accepted round) per round.
DRAFTER_SPAN = 256


def family(model) -> str:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return str(getattr(config, "model_type", None) or type(model).__name__)


def cache_of(args, kwargs):
    """The transformers cache a forward was given, found by type (5.23 ``past_key_values=``, 5.25 ``cache=``)."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a dependency of every caller
        return None
    for value in (*kwargs.values(), *args):
        if isinstance(value, Cache):
            return value
    return None


def _install(model, record: bool, drafter: bool = False):
    """Shadow the class's refusal and the forward (recording, or for the control only lifting), on this instance only."""
    vars_ = vars(model)
    saved = (model, vars_.get("_is_stateful", _MISSING), vars_.get("forward", _MISSING))
    if getattr(model, "_is_stateful", False):
        object.__setattr__(model, "_is_stateful", False)
    wrap = functools.partial(_recording_forward, drafter=drafter) if record else _lifting_forward
    object.__setattr__(model, "forward", wrap(model, model.forward))
    return saved


_CROPPABLE: dict = {}  # a cache class -> its subclass that reports is_croppable (the runtime commits its crop exactly)


def _croppable(cache) -> None:
    """Make ``cache`` report ``is_croppable`` while the context lasts (transformers 5.24 refuses assisted decoding
    on a cache whose linear-attention layers hold a recurrent state; the runtime recorded this one, so its crop is
    exact). Releases whose ``is_croppable`` already says so, or that have none, are left alone."""
    if cache is None or getattr(cache, "is_croppable", True):
        return
    cls = type(cache)
    sub = _CROPPABLE.get(cls)
    if sub is None:
        sub = _CROPPABLE[cls] = type(cls.__name__, (cls,), {"is_croppable": True, "__module__": cls.__module__,
                                                           "__ddpatch_croppable__": cls})
    cache.__class__ = sub
    stack = getattr(_STATE, "swapped", None)
    if stack:  # the innermost context of this thread swaps it back on exit
        stack[-1].append(cache)


def _restore_caches(caches: list) -> None:
    for cache in caches:
        original = getattr(type(cache), "__ddpatch_croppable__", None)
        if original is not None:
            cache.__class__ = original


def _uninstall(model, stateful, forward) -> None:
    for name, value in (("_is_stateful", stateful), ("forward", forward)):
        if value is _MISSING:
            vars(model).pop(name, None)
        else:
            object.__setattr__(model, name, value)


def _depth(model):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return getattr(config, "num_hidden_layers", None)


def _mark(cache, model, drafter: bool) -> None:
    """Tell the runtime whose cache this is, and for an assistant how far back its record must reach."""
    if cache is None or getattr(cache, "_ddpatch_owner", None) is not None:
        return
    try:
        cache._ddpatch_owner = f"assistant ({family(model)})" if drafter else f"target ({family(model)})"
        if drafter:
            cache._ddpatch_span = DRAFTER_SPAN
    except AttributeError:  # a cache class with __slots__: the runtime's defaults (one forward, "target")
        pass


def _recording_forward(model, original, drafter: bool = False):
    """``original`` with every cached call routed through ``runtime.verify_forward``, signature kept."""
    from patcher import runtime as rt

    depth = _depth(model)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        inside = getattr(_STATE, "inside", None)
        if inside is None:
            inside = _STATE.inside = set()
        # verify_forward calls model(...) again, which lands here: that inner call is the real forward.
        # An early-exit draft is this same model run with fewer layers (transformers lowers the config's
        # num_hidden_layers for it): its own cache is the draft's business, the target's is untouched.
        if id(model) in inside or cache_of(args, kwargs) is None or _depth(model) != depth:
            return original(*args, **kwargs)
        _mark(cache_of(args, kwargs), model, drafter)
        inside.add(id(model))
        try:
            output = rt.verify_forward(model, *args, **kwargs)
        finally:
            inside.discard(id(model))
        _croppable(cache_of(args, kwargs))
        return output

    forward.__ddpatch_lossless__ = True
    return forward


def _lifting_forward(model, original):
    """The control's forward: ``original``, with the cache it was given made to report ``is_croppable`` (the
    refusal lifted) and nothing recorded, so transformers' own crop alone rolls the state back."""

    @functools.wraps(original)
    def forward(*args, **kwargs):
        output = original(*args, **kwargs)
        _croppable(cache_of(args, kwargs))
        return output

    forward.__ddpatch_lossless__ = True
    return forward
