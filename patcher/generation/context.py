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

Whether a model can be served is decided on entry by what it does, not by its signature: the probe
(``probe.py``) runs it once per class, configuration, dtype, device and release. A model it cannot serve
exactly is refused with ``runtime.UnsupportedModelError``, in one line naming the family and the reason.
A model given after the first (``lossless(target, assistant)``) is recorded as a drafter (``forwards.py``).
The points where this reaches into transformers are listed in docs/generate.md with the versions they
were checked on.

Forward hooks registered on the model see each cached forward twice (the call from ``generate()`` and
``verify_forward``'s own call of the model, with the same tensors); ``patcher.verify.judge.generate_mode``
drops the repeat.

``lossless(model, record=False)`` is the control: the refusals are lifted (5.23's flag, 5.24's
``is_croppable``) and nothing is recorded.
It exists so that tests can show that the recording, not the lifting, makes the output exact.
"""

from __future__ import annotations

import contextlib

from .forwards import _STATE, _install, _restore_caches, _uninstall, cache_of
from .probe import probe, refusal

__all__ = ["cache_of", "lossless", "probe", "refusal"]


class lossless(contextlib.ContextDecorator):
    """Inside ``with lossless(model):``, ``model.generate(...)`` accepts every speculative mode on a
    stateful model and its output equals plain ``generate()``'s; also usable as a decorator.

    Several models may be given (``lossless(target, assistant)``): each one's cached forwards are recorded, each
    cache by its own recording; the models after the first are drafters (their recordings span forwards).
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
            for i, model in enumerate(self.models):
                frame.append(_install(model, self.record, drafter=i > 0))
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
