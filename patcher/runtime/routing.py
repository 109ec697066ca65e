"""Call-scoped forwards: a verify's replacement forwards act only inside its own call.

A verify gives some modules another ``forward`` (a GDN mixer's tree strategy, a sliding layer's
windowed mask, a draft's window mask). Setting it on the module would change the *model*: a
forward of the same model in another thread would run this verify's closures and fill its
record, and two interleaved restores could leave a closure installed for good. Instead each
module gets one dispatcher while any verify uses it (counted, so the last user puts back what
was there), and the dispatcher routes through a ``ContextVar`` that holds the replacements of
the call running in this thread. Everywhere else the module's own forward runs, untouched.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from contextvars import ContextVar
from typing import Any, Callable

# id(module) -> (module, replacement forward), for the verify running in this context
_ROUTES: ContextVar = ContextVar("ddpatch_routes", default=None)
_lock = threading.Lock()
_installed: dict = {}  # id(module) -> [users, module, had_own, previous, dispatcher]
# model -> the thread running a verify on it
_VERIFYING: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _dispatcher(module, fallback: Callable) -> Callable:
    key = id(module)

    def forward(*args, **kwargs):
        routes = _ROUTES.get()
        route = routes.get(key) if routes else None
        if route is not None and route[0] is module:
            return route[1](*args, **kwargs)
        return fallback(*args, **kwargs)

    forward._ddpatch_dispatcher = True  # type: ignore[attr-defined]
    return forward


def _own_forward(module) -> Callable:
    """The forward ``module`` has without any verify's dispatcher: what a replacement calls."""
    with _lock:
        entry = _installed.get(id(module))
        if entry is not None and entry[1] is module:
            return entry[3] if entry[2] else type(module).forward.__get__(module)
    return module.forward


@contextlib.contextmanager
def _swapped_forwards(replacements):
    """Route each module's ``forward`` to its replacement for calls made in this context only."""
    keys = []
    with _lock:
        for module, _ in replacements:
            entry = _installed.get(id(module))
            if entry is None or entry[1] is not module:
                had_own = "forward" in module.__dict__
                previous = module.__dict__.get("forward")
                fallback = previous if had_own else type(module).forward.__get__(module)
                entry = [0, module, had_own, previous, _dispatcher(module, fallback)]
                _installed[id(module)] = entry
                module.forward = entry[4]
            entry[0] += 1
            keys.append(id(module))
    outer = _ROUTES.get() or {}
    token = _ROUTES.set({**outer, **{id(module): (module, forward) for module, forward in replacements}})
    try:
        yield
    finally:
        _ROUTES.reset(token)
        with _lock:
            for key in keys:
                entry = _installed[key]
                entry[0] -= 1
                if entry[0] == 0:
                    module = entry[1]
                    if module.__dict__.get("forward") is entry[4]:
                        if entry[2]:
                            module.forward = entry[3]
                        else:
                            module.__dict__.pop("forward", None)
                    del _installed[key]


@contextlib.contextmanager
def _one_verify(model):
    """Refuse a verify of ``model`` while another thread verifies it: their records, kernels
    and caches would be told apart only by luck."""
    me = threading.get_ident()
    with _lock:
        try:
            holder = _VERIFYING.get(model)
        except TypeError:  # not weak-referenceable: cannot be tracked
            holder = None
        if holder is not None and holder != me:
            raise RuntimeError(
                "ddpatch: another thread is verifying this model right now; verify one model from one thread at a "
                "time (give each thread its own model copy)"
            )
        nested = holder == me
        if not nested:
            try:
                _VERIFYING[model] = me
            except TypeError:
                pass
    try:
        yield
    finally:
        if not nested:
            with _lock:
                try:
                    _VERIFYING.pop(model, None)
                except TypeError:
                    pass
