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
import shutil
import time
from pathlib import Path, PurePosixPath

from ..errors import JournalError
from ..results import RevertResult
from .files import RUNTIME_PACKAGE, atomic_write


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
    # The stamp sorts in the order the applies ran (``latest`` takes the last): the wall-clock second,
    # then its microseconds, then a counter for two applies in the same microsecond. (The sub-second part
    # was once the nanoseconds modulo a million, which does not grow within a second: of two applies in one
    # second, revert then undid either.)
    now = time.time_ns()
    second = time.strftime("%Y%m%dT%H%M%S", time.localtime(now // 1_000_000_000))
    base, n = f"{second}-{now // 1000 % 1_000_000:06d}", 0
    while any(folder.glob(f"{base}-{n:03d}.*")):
        n += 1
    stamp = f"{base}-{n:03d}"
    journal = folder / f"{stamp}.json"
    payload = {"root": str(root.resolve()), "recipe": recipe, "created": stamp, "files": entries}
    atomic_write(journal, json.dumps(payload, indent=1))
    return journal


def latest(root: Path) -> Path | None:
    folder = _folder(root)
    journals = sorted(folder.glob("*.json")) if folder.exists() else []
    return journals[-1] if journals else None


def _inside(root: Path, rel: str) -> Path:
    """``root / rel``, refused when the journal entry's path leaves the tree: ``..``, an absolute path, a symlink out."""
    pure = PurePosixPath(rel)
    if not rel or pure.is_absolute() or Path(rel).is_absolute() or ".." in pure.parts:
        raise JournalError(f"refusing to revert: journal entry {rel!r} leaves the tree {root}")
    path = root / rel
    real_root = root.resolve()
    if path.is_symlink() or not path.parent.resolve().is_relative_to(real_root):
        raise JournalError(f"refusing to revert: journal entry {rel!r} goes through a symlink out of the tree {root}")
    return path


def _backup(path: Path) -> Path:
    """A free ``<file>.orig`` (then ``.orig.1``, ...) next to ``path``, holding its current bytes."""
    backup, n = path.with_name(path.name + ".orig"), 0
    while backup.exists():
        n += 1
        backup = path.with_name(f"{path.name}.orig.{n}")
    atomic_write(backup, path.read_bytes())
    return backup


def revert(root: Path, force: bool = False) -> RevertResult:
    """Undo the latest apply on ``root``; returns what was restored.

    A file edited since the apply (its content is neither the patched nor the original
    text) is left alone unless ``force``: reverting must not lose the user's work. With
    ``force`` each such file is kept as ``<file>.orig`` and named in ``overwritten``.
    A second revert finds only reverted journals and says so (``already_reverted``).
    """
    journal = latest(root)
    if journal is None:
        done = sorted(_folder(root).glob("*.reverted")) if _folder(root).exists() else []
        if done:
            return RevertResult(already_reverted=done[-1].stem)
        raise JournalError(
            f"no ddpatch apply is recorded for {root}; journals are kept under {home() / 'journals'} "
            "(set by $DDPATCH_HOME), keyed by the tree's absolute path, so a tree moved or renamed since "
            "the apply is not found there"
        )
    payload = json.loads(journal.read_text())
    conflicts, restored, overwritten = [], [], []
    for entry in payload["files"]:
        path = _inside(root, entry["path"])
        current = path.read_bytes() if path.exists() else None
        original = None if entry["original"] is None else base64.b64decode(entry["original"])
        if current == original:
            continue
        if current is not None and _sha(current) != entry["patched_sha256"]:
            conflicts.append(entry["path"])
    if conflicts and not force:
        raise JournalError(f"changed since ddpatch applied (use --force to revert anyway; each is kept as <file>.orig): "
                           f"{', '.join(conflicts)}")
    for entry in payload["files"]:
        path = root / entry["path"]
        original = None if entry["original"] is None else base64.b64decode(entry["original"])
        if entry["path"] in conflicts:
            overwritten.append((entry["path"], _backup(path).relative_to(root).as_posix()))
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
    _remove_runtime_folders(root, restored)
    journal.rename(journal.with_suffix(".reverted"))
    return RevertResult(restored, overwritten)


def _remove_runtime_folders(root: Path, restored: list[str]) -> None:
    """A runtime folder the apply created goes as a whole once its files are gone (with the
    ``__pycache__`` Python left in it); one that still holds other files stays."""
    folders = {(root / rel).parent for rel in restored if Path(rel).parent.name == RUNTIME_PACKAGE}
    for folder in sorted(folders):
        if not folder.is_dir():
            continue
        shutil.rmtree(folder / "__pycache__", ignore_errors=True)
        if not any(folder.iterdir()):
            folder.rmdir()
