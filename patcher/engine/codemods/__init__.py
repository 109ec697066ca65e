"""codemods: the steps recipes are built from, one small, general, parametrised LibCST transform per module (``CODEMODS`` by id).
May import: each other, patcher.results, libcst and the stdlib (libcst_recipe also the engine's recipe loader, for ``python -m libcst.tool``).
"""

from __future__ import annotations

from .accessor import UseAccessor
from .attn_fallback import AttnFallback
from .base import Step
from .cache_surgery import CacheSurgery
from .crop import CropCompat
from .decorate import DecorateFunction
from .guard import GuardCall
from .lazy_import import LazyImport
from .removed_api import RemovedApi
from .target_cache_config import TargetCacheConfig
from .wrap_call import WrapCall

CODEMODS: dict[str, type[Step]] = {
    cls.ID: cls
    for cls in (TargetCacheConfig, UseAccessor, CropCompat, GuardCall, AttnFallback, LazyImport, WrapCall, DecorateFunction,
                RemovedApi, CacheSurgery)
}

__all__ = ["CODEMODS", "Step"]
