"""ddpatch: compatibility recipes for speculative-decoding research code, and a verifier that proves them lossless.

Layers, top down (each imports only those below it): ``cli`` (click) -> ``api`` (the Python API)
-> ``ci`` -> ``engine`` and ``verify`` -> ``report`` (renderers) -> ``results`` and ``errors``
(plain data). ``runtime`` stands alone: it is copied into patched trees.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``patcher.lossless`` imports torch and the runtime: only when asked for, never on ``import patcher``.
    # It is the module ``patcher/lossless.py``, which is callable: the same object however it is imported.
    if name == "lossless":
        from .lossless import lossless as _context  # noqa: F401  (importing the submodule binds patcher.lossless)

        return globals()["lossless"]
    raise AttributeError(f"module 'patcher' has no attribute {name!r}")
