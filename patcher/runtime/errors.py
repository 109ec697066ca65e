"""Refusals: the one-line error for what cannot be served exactly, and the transformers version gate."""

from __future__ import annotations

import re
import warnings

from . import options


class UnsupportedModelError(RuntimeError):
    """A target whose state ddpatch cannot roll back or verify exactly; the message says why, in one line."""


_BEFORE_45513 = "5.7.0"  # transformers#45513: multi-token GDN forwards read the cached state from here on


def _min_reason(version: tuple) -> str:
    if version < _release(_BEFORE_45513):
        return (f"it predates {_BEFORE_45513} (transformers#45513): its Gated DeltaNet layers ignore the cached state on "
                "multi-token forwards, so a speculative verify would be lossy")
    return ("its Gated DeltaNet layers read the cache's internals (cache.layers[i]) instead of Cache.get_conv_state / "
            "get_recurrent_state / is_recording_past, which the ddpatch runtime's state views implement")


_VERSION_CHECKED: list = []


def _release(version: str) -> tuple:
    parts = []
    for piece in str(version).split(".")[:3]:
        digits = re.match(r"\d+", piece)
        parts.append(int(digits.group()) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def _check_transformers_version() -> None:
    """Refuse, once and at first use (never at import), a transformers older than options.MIN_TRANSFORMERS."""
    if _VERSION_CHECKED:
        return
    try:
        import transformers
    except ImportError:
        _VERSION_CHECKED.append(None)
        return
    version = str(getattr(transformers, "__version__", "0"))
    if _release(version) < _release(options.MIN_TRANSFORMERS):
        raise UnsupportedModelError(
            f"ddpatch: transformers {version} is older than {options.MIN_TRANSFORMERS}, the oldest release the ddpatch "
            f"runtime supports: {_min_reason(_release(version))}; install transformers>={options.MIN_TRANSFORMERS}"
        )
    _VERSION_CHECKED.append(version)



def _uncertain(message: str) -> None:
    """Where the runtime cannot be sure a commit is exact: raise (``options.ON_UNCERTAIN = "raise"``,
    the default: a decode never goes on after a possibly wrong commit), or warn when the user
    chose ``"warn"``."""
    if options.ON_UNCERTAIN == "warn":
        warnings.warn(f"{message} (options.ON_UNCERTAIN is 'warn': decoding goes on, possibly lossy)", RuntimeWarning,
                      stacklevel=3)
        return
    if options.ON_UNCERTAIN != "raise":
        raise ValueError(f"ddpatch: unknown ON_UNCERTAIN {options.ON_UNCERTAIN!r} (use 'raise' or 'warn')")
    raise RuntimeError(message)
