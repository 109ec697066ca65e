"""``lossless(model)``: transformers' own speculative ``generate()`` on a stateful model, made exact.

transformers refuses every speculative mode (MTP, an assistant model, prompt lookup, early exit,
DFlash) on a model whose class sets ``_is_stateful``: a recurrent or conv state "can't reset to a
previous subset of generated text". ddpatch's runtime can. Its assisted loop verifies a block of
candidates with ONE target forward and then cuts the cache back with a native ``crop(-n)``; once
that forward went through ``runtime.verify_forward``, the cache's own crop commits exactly the
kept prefix. So, for the duration of the context and for the given model instances only:

* every target forward that carries a cache goes through ``verify_forward`` (the first forward of
  prompt lookup and of an assistant covers prompt + candidates at once and is cut right after, so
  prefills are recorded too);
* the instance attribute ``_is_stateful = False`` shadows the class's refusal (5.21 - 5.23);
* a cache such a forward recorded reports ``is_croppable`` (5.24 checks it after the prefill and
  refuses assisted decoding when a linear-attention layer holds a recurrent state): the runtime's
  commit makes its crop exact. The cache's class is swapped for a subclass that says so, for the
  duration of the context, and swapped back on exit.

All of these are per instance and undone on exit; nothing changes on import and nothing changes for
other instances. The forward keeps its signature (``functools.wraps``): transformers reads it to
decide which inputs to build, and MTP needs ``position_ids``.

A family the runtime cannot roll back is refused on entry with ``runtime.UnsupportedModelError``,
in one line naming the family and the reason. The points where this reaches into transformers are
listed in docs/generate.md with the versions they were checked on.

Forward hooks registered on the model see each cached forward twice (the call from ``generate()`` and
``verify_forward``'s own call of the model, with the same tensors); ``patcher.verify.generate_mode``
drops the repeat.

``lossless(model, record=False)`` is the control: the refusals are lifted (5.23's flag, 5.24's
``is_croppable``) and nothing is recorded.
It exists so that tests can show that the recording, not the lifting, makes the output exact.
"""

from __future__ import annotations

import contextlib
import functools
import threading

__all__ = ["cache_of", "lossless", "refusal"]

_MISSING = object()
_STATE = threading.local()


def _family(model) -> str:
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


def refusal(model) -> str | None:
    """Why ``lossless`` must refuse ``model`` (one line naming the family), or None when it serves it."""
    import inspect

    from patcher import runtime as rt

    try:
        parameters = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    if parameters and not {"past_key_values", "cache"} & set(parameters):
        # pure Mamba / Mamba2 / FalconMamba take ``cache_params=``: transformers' assisted loop needs a
        # ``past_key_values`` cache and raises "assisted decoding requires a cache"
        return (
            f"ddpatch: {_family(model)} takes its cache as {next((k for k in parameters if 'cache' in k), 'none')}=, "
            "not past_key_values=, and transformers' assisted loop only works on the latter; speculative "
            "generate() stays refused"
        )
    try:
        modules = rt.hybrid_linear_modules(model)
    except rt.UnsupportedModelError as exc:
        return str(exc)
    if getattr(type(model), "_is_stateful", False) and not modules:
        # stateful, yet no layer of the config maps to a cache layer the runtime rolls back
        # (mamba, rwkv, xlstm, recurrent_gemma: a cache class of their own)
        return (
            f"ddpatch: {_family(model)} keeps its state in a cache of its own, not in transformers' "
            "linear-attention cache layers; ddpatch cannot roll it back, so speculative generate() stays refused"
        )
    return None


class lossless(contextlib.ContextDecorator):
    """Inside ``with lossless(model):``, ``model.generate(...)`` accepts every speculative mode on a
    stateful model and its output equals plain ``generate()``'s; also usable as a decorator.

    Several models may be given (``lossless(target, other)``): each one's cached forwards are recorded.
    """

    def __init__(self, *models, record: bool = True):
        if not models:
            raise TypeError("lossless() needs the model whose generate() it makes exact")
        self.models = models
        self.record = record
        self._saved: list[list] = []  # one frame per (possibly nested) entry

    def __enter__(self):
        for model in self.models:
            reason = refusal(model)
            if reason is not None:
                from patcher import runtime as rt

                raise rt.UnsupportedModelError(reason)
        frame = []
        try:
            for model in self.models:
                frame.append(_install(model, self.record))
        except BaseException:
            for saved in reversed(frame):
                _uninstall(*saved)
            raise
        self._saved.append(frame)
        if getattr(_STATE, "swapped", None) is None:
            _STATE.swapped = []
        _STATE.swapped.append([])
        return self.models[0] if len(self.models) == 1 else self.models

    def __exit__(self, *exc):
        for saved in reversed(self._saved.pop()):
            _uninstall(*saved)
        _restore_caches(_STATE.swapped.pop())
        return False


def _install(model, record: bool):
    """Shadow the class's refusal and the forward (recording, or for the control only lifting), on this instance only."""
    vars_ = vars(model)
    saved = (model, vars_.get("_is_stateful", _MISSING), vars_.get("forward", _MISSING))
    if getattr(model, "_is_stateful", False):
        object.__setattr__(model, "_is_stateful", False)
    wrap = _recording_forward if record else _lifting_forward
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


def _recording_forward(model, original):
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
