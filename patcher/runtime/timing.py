"""A decoder's own timing where there is no CUDA: ``torch.cuda.Event`` cannot be built without it.

Research decoders time their stages with CUDA events (``torch.cuda.Event(enable_timing=True)``, ``.record()``,
``.elapsed_time(...)``); on a machine without CUDA the constructor raises ("Tried to instantiate dummy base
class Event" on a CPU build), so the verifier could not run a decoder that is otherwise fine. The recipe's
``cpu-safe-timing`` step builds them through ``cuda_event``: the very same ``torch.cuda.Event`` where CUDA is
available (a GPU run times itself exactly as before), a wall-clock stand-in with the same methods where it is not.
torch is imported inside the function, so that a module that keeps torch lazy stays so.
"""

from __future__ import annotations

import time


class WallClockEvent:
    """``torch.cuda.Event``'s timing methods on the host clock: ``elapsed_time`` in milliseconds between two ``record``s."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._at: float | None = None

    def record(self, stream=None) -> None:
        self._at = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing runs ahead of the host without a device: there is nothing to wait for."""

    def wait(self, stream=None) -> None:
        """As ``synchronize``."""

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: "WallClockEvent") -> float:
        if self._at is None or end_event._at is None:
            raise RuntimeError("elapsed_time: both events must be recorded first (as torch.cuda.Event requires)")
        return (end_event._at - self._at) * 1000.0


def cuda_event(*args, **kwargs):
    """``torch.cuda.Event(*args, **kwargs)`` where CUDA is available, else a ``WallClockEvent``."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.Event(*args, **kwargs)
    return WallClockEvent(*args, **kwargs)
