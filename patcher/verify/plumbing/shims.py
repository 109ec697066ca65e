"""The first real failure behind an environment failure.

An unpatched tree on a CPU fails first where it times itself (``torch.cuda.synchronize()``) or
imports an optional package (``datasets``). That failure is real, and a recipe step fixes it, but
it hides the next one: the 5.25 recording crash, a cache without the target's config. When the
warm-up fails for the environment alone, the verifier shims exactly that (no-op CUDA timing, a
stub ``datasets``) for one more try, undoes it, and reports what the method does then: the first
failure of the code itself, or that it then runs. The verdict stays a failure either way.
"""

from __future__ import annotations

import contextlib
import sys
import types

from .events import error_summary

#: (what an error says, the environment it needs, the recipe step that makes the tree run without it)
ENVIRONMENT = (
    ("Torch not compiled with CUDA", "cuda", "cpu-safe-timing"),
    ("Found no NVIDIA driver", "cuda", "cpu-safe-timing"),
    ("CUDA", "cuda", "cpu-safe-timing"),
    ("No module named 'datasets'", "datasets", "lazy-datasets"),
)


def environment_failure(exc: BaseException) -> tuple[str, str] | None:
    """(environment, recipe step) when ``exc`` is a missing environment (CUDA, an optional package), else None."""
    text = f"{type(exc).__name__}: {exc}"
    for needle, env, step in ENVIRONMENT:
        if needle in text:
            return env, step
    return None


@contextlib.contextmanager
def _shimmed(env: str):
    import torch

    saved = []
    if env == "cuda":
        class _Event:  # torch.cuda.Event stand-in: a host clock
            def __init__(self, *args, **kwargs):
                self.t = 0.0

            def record(self, *args, **kwargs):
                import time

                self.t = time.perf_counter()

            def elapsed_time(self, other):
                return (other.t - self.t) * 1000.0

            def synchronize(self):
                return None

        for name, value in (("synchronize", lambda *a, **k: None), ("set_device", lambda *a, **k: None),
                            ("current_device", lambda: 0), ("Event", _Event)):
            saved.append((torch.cuda, name, getattr(torch.cuda, name, None)))
            setattr(torch.cuda, name, value)
    elif env == "datasets" and "datasets" not in sys.modules:
        stub = types.ModuleType("datasets")
        stub.load_dataset = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("datasets is a stub in the verifier"))
        sys.modules["datasets"] = stub
        saved.append((sys.modules, "datasets", None))
    try:
        yield
    finally:
        for owner, name, value in saved:
            if owner is sys.modules:
                sys.modules.pop(name, None)
            else:
                setattr(owner, name, value)


def retried_without(found: tuple[str, str], attempt, depth: int = 3) -> dict:
    """Run ``attempt`` with ``found``'s environment shimmed; the next failure (itself shimmed in turn, ``depth`` deep),
    or that it ran."""
    env, step = found
    shimmed = [(env, step)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_shimmed(env))
        for _ in range(depth):
            try:
                attempt()
            except Exception as exc:
                err = error_summary(exc)
                more = environment_failure(exc)
                if more is not None and more not in shimmed:
                    shimmed.append(more)
                    stack.enter_context(_shimmed(more[0]))
                    continue
                names = ", ".join(f"{e} ({s})" for e, s in shimmed)
                return {**err, "shimmed": [e for e, _ in shimmed],
                        "text": f"with {names} shimmed, it then fails: {err['error']}"
                                + (f" (hint: {err['hint']})" if err.get("hint") else "")}
            names = ", ".join(f"{e} ({s})" for e, s in shimmed)
            return {"shimmed": [e for e, _ in shimmed], "text": f"with {names} shimmed, it then runs"}
    return {"shimmed": [e for e, _ in shimmed], "text": "it kept failing for its environment"}
