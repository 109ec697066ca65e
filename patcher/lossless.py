"""``patcher.lossless``: transformers' own speculative ``generate()`` on a stateful model, made exact.

``with patcher.lossless(model): model.generate(..., prompt_lookup_num_tokens=8)`` (docs/generate.md). The code
lives in ``patcher.generation``; this module is the documented name, and it is itself callable: however it
was imported (``import patcher.lossless`` binds the package's attribute to this module, ``from patcher import
lossless``, ``from patcher.lossless import refusal``), ``patcher.lossless(model)`` is ``lossless(model)``.
"""

from __future__ import annotations

import sys
import types

from patcher.generation.context import cache_of, lossless, probe, refusal
from patcher.generation.forwards import DRAFTER_SPAN
from patcher.generation.probe import Verdict
from patcher.runtime import UnsupportedModelError

__all__ = ["DRAFTER_SPAN", "UnsupportedModelError", "Verdict", "cache_of", "lossless", "probe", "refusal"]


class _CallableModule(types.ModuleType):
    """This module's class: calling the module calls ``lossless``, so that no way of importing it can leave
    ``patcher.lossless`` bound to something that cannot be called."""

    def __call__(self, *models, **kwargs):
        return self.lossless(*models, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
