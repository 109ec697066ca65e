"""A journal of in-place applies, so that ``ddpatch revert`` restores a tree exactly.

Before the first file of a tree is replaced, the journal (the original bytes of every
file about to change, and the list of files ddpatch creates) is written and fsynced
outside the tree, under ``$DDPATCH_HOME`` (default ``~/.cache/ddpatch``). Each file is
then replaced atomically, so a run killed halfway leaves every file whole-original or
whole-patched, and the journal can still put all of them back.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path

from ..errors import JournalError
from .files import atomic_write


def home() -> Path:
    return Path(os.environ.get("DDPATCH_HOME") or Path.home() / ".cache" / "ddpatch")


def _folder(root: Path) -> Path:
    key = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:16]
    return home() / "journals" / key


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record(root: Path, changes: dict[str, bytes | str | None], recipe: str) -> Path:
    """Save the originals of ``changes`` (path -> the bytes about to be written; the originals are read from disk)."""
    folder = _folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for rel, new_text in changes.items():
        path = root / rel
        original = path.read_bytes() if path.exists() else None
        entries.append(
            {
                "path": rel,
                "original": None if original is None else base64.b64encode(original).decode(),
                "mode": path.stat().st_mode & 0o7777 if path.exists() else None,
                "patched_sha256": _sha(new_text.encode("utf-8") if isinstance(new_text, str) else new_text or b""),
            }
        )
    stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{time.time_ns() % 1_000_000:06d}"
    journal = folder / f"{stamp}.json"
    payload = {"root": str(root.resolve()), "recipe": recipe, "created": stamp, "files": entries}
    atomic_write(journal, json.dumps(payload, indent=1))
    return journal


def latest(root: Path) -> Path | None:
    folder = _folder(root)
    journals = sorted(folder.glob("*.json")) if folder.exists() else []
    return journals[-1] if journals else None


def revert(root: Path, force: bool = False) -> list[str]:
    """Undo the latest apply on ``root``; returns the restored paths.

    A file edited since the apply (its content is neither the patched nor the original
    text) is left alone unless ``force``: reverting must not lose the user's work.
    """
    journal = latest(root)
    if journal is None:
        raise JournalError(
            f"no ddpatch apply is recorded for {root}; journals are kept under {home() / 'journals'} "
            "(set by $DDPATCH_HOME), keyed by the tree's absolute path, so a tree moved or renamed since "
            "the apply is not found there"
        )
    payload = json.loads(journal.read_text())
    conflicts, restored = [], []
    for entry in payload["files"]:
        path = root / entry["path"]
        current = path.read_bytes() if path.exists() else None
        original = None if entry["original"] is None else base64.b64decode(entry["original"])
        if current == original:
            continue
        if current is not None and _sha(current) != entry["patched_sha256"] and not force:
            conflicts.append(entry["path"])
    if conflicts:
        raise JournalError(f"changed since ddpatch applied (use --force to revert anyway): {', '.join(conflicts)}")
    for entry in payload["files"]:
        path = root / entry["path"]
        original = None if entry["original"] is None else base64.b64decode(entry["original"])
        if original is None:
            if path.exists():
                path.unlink()
                restored.append(entry["path"])
            continue
        if path.exists() and path.read_bytes() == original:
            continue
        atomic_write(path, original)
        if entry["mode"] is not None:
            os.chmod(path, entry["mode"])
        restored.append(entry["path"])
    journal.rename(journal.with_suffix(".reverted"))
    return restored
