"""The child's side of the protocol with the parent: one JSON object per line on stdout, and
errors summarised with the recipe step that most likely fixes them."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

#: (text found in an error, recipe step that fixes it)
HINTS = (
    ("No module named 'datasets'", "lazy-datasets"),
    ("no attribute 'embed_tokens'", "input-embeddings"),
    ("get_conv_state", "target-cache-config"),
    ("list index out of range", "target-cache-config"),
    ("has no attribute 'update'", "target-cache-config (a draft cache was given the target's config)"),
    ("positive value", "crop-compat"),
    ("does not track past states", "crop-compat"),
    ("Torch not compiled with CUDA", "cpu-safe-timing"),
    ("CUDA", "cpu-safe-timing"),
    ("flash_attn", "attn-fallback"),
    ("ddpatch is not importable", "none: the patched tree imports ddpatch's own package; patched code may only use its _ddpatch_runtime copy"),
)


def emit(event: str, **payload: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **payload}) + "\n")
    sys.stdout.flush()


def hint_for(message: str) -> str | None:
    for needle, step in HINTS:
        if needle in message:
            return step
    return None


def error_summary(exc: BaseException) -> dict:
    """The exception, its last frame, and the recipe step it points at."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    message = f"{type(exc).__name__}: {exc}".strip()
    return {
        "error": message.splitlines()[0][:500],
        "frame": f"{last.filename}:{last.lineno} in {last.name}" if last else None,
        "hint": hint_for(message + "".join(traceback.format_tb(exc.__traceback__))),
    }
