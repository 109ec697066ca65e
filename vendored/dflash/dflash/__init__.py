"""DFlash: block-diffusion drafts for speculative decoding.

Names resolve on first use so that ``import dflash`` stays cheap and does not pull in torch
(or ``datasets``, which only the benchmark needs).
"""

_LAZY_EXPORTS = {
    "DFlashDraftModel": ".model",
    "dflash_generate": ".model",
    "extract_context_feature": ".model",
    "sample": ".model",
    "load_and_process_dataset": ".benchmark",
}

__all__ = sorted(_LAZY_EXPORTS)


def __getattr__(name):
    try:
        module_name = _LAZY_EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module_name, __name__), name)
    globals()[name] = value
    return value
