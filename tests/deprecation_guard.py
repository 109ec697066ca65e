"""A pytest plugin (loaded by conftest.py): no ``past_key_values`` deprecation warning from ddpatch's own code.

transformers 5.24+ warns (FutureWarning, "will be removed in version 5.40.0") when a model call passes its
cache as ``past_key_values=``; ddpatch's runtime and verifier pass ``cache=`` where the forward takes it
(``patcher.runtime.discovery._call_kwargs``, ``patcher.verify.models.context.with_cache``). Tests and the
upstream-shaped ``vendored/`` code may still call the old way, so the warning as such proves nothing: this
plugin looks at who made the call. Every such warning whose model call was made by ``patcher/`` (the
runtime, the verifier, ``lossless``) or a patched tree's ``_ddpatch_runtime/`` copy fails the test that
raised it, naming the frame.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

import pytest

PATCHER = str(Path(__file__).resolve().parent.parent / "patcher") + "/"
_found: list[str] = []
_original_warn = warnings.warn


def _library(filename: str) -> bool:
    """A frame of an installed package (transformers, torch, accelerate) or of the standard library."""
    return "/site-packages/" in filename or filename.startswith(_STDLIB) or filename.startswith("<")


_STDLIB = str(Path(traceback.__file__).resolve().parent) + "/"


def _ours(frame) -> str | None:
    """``file:line in function`` of the code that made the model call (the first frame out of transformers,
    torch and the standard library), when that code is ddpatch's: ``patcher/`` or a patched tree's
    ``_ddpatch_runtime/`` copy. None when an upstream-shaped tree or a test made the call."""
    while frame is not None and _library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    name = frame.f_code.co_filename
    if name.startswith(PATCHER) or "/_ddpatch_runtime/" in name:
        return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
    return None


def _warn(message, category=None, stacklevel=1, source=None, **kwargs):
    text = str(message)
    if "past_key_values" in text and "deprecated" in text:
        where = _ours(sys._getframe(1))
        if where is not None:
            _found.append(f"{text.splitlines()[0]} -- called from {where}\n" + "".join(traceback.format_stack(limit=12)[:-1]))
    return _original_warn(message, category, stacklevel + 1, source, **kwargs)


def pytest_configure(config):
    warnings.warn = _warn


def pytest_unconfigure(config):
    warnings.warn = _original_warn


@pytest.fixture(autouse=True)
def _no_cache_keyword_deprecation_from_ddpatch():
    _found.clear()
    yield
    if _found:
        first = _found[0]
        _found.clear()
        pytest.fail(f"ddpatch's own code passed past_key_values= where transformers takes cache=: {first}", pytrace=False)
