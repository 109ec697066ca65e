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
    # 5.25's GDN forward after a bare activate_past_recording(): min(None, seq_len)
    ("'<' not supported between instances of 'int' and 'NoneType'", "crop-compat (on transformers 5.25 a bare "
     "`activate_past_recording()` leaves recurrent_states_to_keep=None; record_past passes the count the release takes)"),
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


def _in_transformers(filename: str) -> bool:
    return "/transformers/" in filename.replace("\\", "/")


def inside_transformers(frames) -> str | None:
    """Where an error raised inside transformers' own code: the release, the transformers frame it
    raised in, and the API the tree called (its last frame outside transformers, torch and the
    standard library before it), so that a user can tell a tree's bug from an API that moved."""
    if not frames or not _in_transformers(frames[-1].filename):
        return None
    try:
        from importlib.metadata import version

        release = version("transformers")
    except Exception:  # noqa: BLE001 -- metadata missing: say so rather than fail the report
        release = "(unknown release)"
    last = frames[-1]
    where = f"{last.filename.replace(chr(92), '/').rsplit('/transformers/', 1)[-1]}:{last.lineno} in {last.name}"
    entry = next(
        (f for f in reversed(frames) if not _in_transformers(f.filename) and "/torch/" not in f.filename.replace(chr(92), "/")
         and "/lib/python" not in f.filename.replace(chr(92), "/")),
        None,
    )
    called = f"; the tree called it at {entry.filename}:{entry.lineno} (`{(entry.line or '').strip()[:80]}`)" if entry else ""
    return f"inside transformers {release}: {where}{called}"


#: The tree being verified (set by the worker): an error's frames inside it are kept, so that the parent names a recipe
#: step as a hint only where that step touched one of them (``patcher.api``).
TREE: list[str] = []


def tree_frames(frames) -> list[list]:
    """[file relative to the tree, line, function] of each frame inside the tree."""
    if not TREE:
        return []
    root = TREE[0].rstrip("/") + "/"
    return [[f.filename[len(root):], f.lineno, f.name] for f in frames if f.filename.startswith(root)]


def error_summary(exc: BaseException) -> dict:
    """The exception, its last frame, the recipe step it points at, and, when it raised inside
    transformers, the release and the API the tree tripped on."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    message = f"{type(exc).__name__}: {exc}".strip()
    summary = {
        "error": message.splitlines()[0][:500],
        "frame": f"{last.filename}:{last.lineno} in {last.name}" if last else None,
        "hint": hint_for(message + "".join(traceback.format_tb(exc.__traceback__))),
    }
    inside_tree = tree_frames(frames)
    if inside_tree:
        summary["tree_frames"] = inside_tree
    inside = inside_transformers(frames)
    if inside:
        summary["inside"] = inside
    return summary
