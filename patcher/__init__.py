"""ddpatch: compatibility recipes for speculative-decoding research code, and a verifier that proves them lossless.

Layers, top down (each imports only those below it): ``cli`` (click) -> ``api`` (the Python API)
-> ``ci`` -> ``engine`` and ``verify`` -> ``report`` (renderers) -> ``results`` and ``errors``
(plain data). ``runtime`` stands alone: it is copied into patched trees.
"""

from pathlib import Path

__version__ = "0.1.0"


def shipped(name: str) -> Path:
    """The folder ``name`` that ships with ddpatch (``recipes``: the built-in recipes, ``vendored``:
    the built-in upstream-shaped trees): ``patcher/data/<name>`` in an installed wheel (setup.py copies
    it there), else ``<name>/`` at the root of the source checkout this package lies in (an editable
    install, ``python -m patcher`` from a clone). The path is returned even where neither exists."""
    package = Path(__file__).resolve().parent
    installed = package / "data" / name
    checkout = package.parent
    if not installed.is_dir() and (checkout / "pyproject.toml").is_file() and (checkout / name).is_dir():
        return checkout / name
    return installed


def __getattr__(name: str):
    # ``patcher.lossless`` imports torch and the runtime: only when asked for, never on ``import patcher``.
    # It is the module ``patcher/lossless.py``, which is callable: the same object however it is imported.
    if name == "lossless":
        from .lossless import lossless as _context  # noqa: F401  (importing the submodule binds patcher.lossless)

        return globals()["lossless"]
    raise AttributeError(f"module 'patcher' has no attribute {name!r}")
