"""Reading and writing source files: encodings as Python reads them, the provenance line,
atomic writes, and the runtime helper that patched trees get a copy of.

Nothing here knows about recipes' steps; ``pipeline`` reads through it and ``write`` writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Iterable

from .. import __version__
from ..results import FileResult
from .codemods.base import RUNTIME_MODULE
from .recipe import Recipe

RUNTIME_PACKAGE = RUNTIME_MODULE  # the folder ``_ddpatch_runtime/`` a patched tree imports
RUNTIME_FILE = RUNTIME_MODULE + ".py"  # the single-file copy older ddpatch releases wrote; replaced by the folder
RUNTIME_MANIFEST = "MANIFEST.json"
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+([A-Za-z_]\w*)", re.M)
_PROVENANCE = re.compile(r"^# ddpatch: recipe (?P<recipe>\S+) v(?P<version>\d+), ddpatch (?P<ddpatch>\S+); steps: (?P<steps>.*)$")


# ----------------------------------------------------------------------------- reading
def read_source(path: Path) -> str:
    return decode_source(path.read_bytes())[0]


def read_file(base: Path, path: Path) -> tuple[FileResult, str]:
    """A file's result before any step runs (its text, encoding and functions, or why it cannot be
    read), and its text as the tree-wide scans read it (leniently, for a file that cannot be decoded)."""
    rel = path.relative_to(base).as_posix() if path != base else path.name
    try:
        data = path.read_bytes()
    except OSError as exc:
        return FileResult(rel, None, error=f"cannot read: {exc}"), ""
    try:
        text, encoding = decode_source(data)
    except ValueError as exc:
        return FileResult(rel, None, error=f"cannot read: {exc}"), data.decode("utf-8", errors="replace")
    return FileResult(rel, text, functions=defined_functions(text), encoding=encoding), text


def not_regular(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file (a FIFO, a socket, a device), else None."""
    import stat

    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None  # gone, or unreadable: reading it reports why
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return None
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")


def decode_source(data: bytes) -> tuple[str, str]:
    """The text of a Python file and its encoding, as Python reads it (PEP 263).

    The encoding is that of the ``coding:`` cookie, or ``utf-8-sig`` when the file starts
    with a BOM (the BOM is not part of the text, and is written back), else UTF-8.
    """
    import io
    import tokenize

    if b"\x00" in data[:8192]:
        raise ValueError("binary file")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        if "invalid or missing encoding" not in str(exc):  # an unknown codec, or a cookie that contradicts the BOM
            raise ValueError(f"bad coding declaration ({exc})") from None
        encoding = "utf-8"  # no cookie, and the first lines are not UTF-8: said below
    try:
        return data.decode(encoding), encoding
    except UnicodeDecodeError as exc:
        name = "UTF-8" if encoding in ("utf-8", "utf-8-sig") else f"{encoding} as declared"
        raise ValueError(f"not {name} ({exc.reason} at byte {exc.start})") from None


def defined_functions(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    line, at = 1, 0
    for m in _DEF.finditer(text):
        if m.group(1) not in out:
            line += text.count("\n", at, m.start())  # counted on from the previous def, not from the top
            at = m.start()
            out[m.group(1)] = line
    return out


# ----------------------------------------------------------------------------- provenance
def read_provenance(text: str) -> set[str]:
    for line in text.splitlines()[:3]:
        m = _PROVENANCE.match(line)
        if m:
            return {s.strip() for s in m.group("steps").split(",") if s.strip()}
    return set()


def provenance_line(recipe: Recipe, steps: Iterable[str]) -> str:
    return f"# ddpatch: recipe {recipe.name} v{recipe.version}, ddpatch {__version__}; steps: {', '.join(sorted(steps))}"


def newline_of(text: str) -> str:
    """The file's own line ending (that of its first line), so that lines ddpatch adds match it."""
    end = text.find("\n")
    if end > 0 and text[end - 1] == "\r":
        return "\r\n"
    if end < 0 and "\r" in text:
        return "\r"
    return "\n"


def write_provenance(text: str, steps: set[str], recipe: Recipe) -> str:
    line = provenance_line(recipe, steps) + newline_of(text)
    lines = text.splitlines(keepends=True)
    for i, old in enumerate(lines[:3]):
        if _PROVENANCE.match(old.rstrip("\r\n")):
            lines[i] = line
            return "".join(lines)
    at = 0
    while at < len(lines) and at < 2 and (lines[at].startswith("#!") or re.match(r"^#.*coding[:=]", lines[at])):
        at += 1
    lines.insert(at, line)
    return "".join(lines)


# ----------------------------------------------------------------------------- the runtime helper
def runtime_sources(narrowing: dict | None = None) -> dict[str, str]:
    """The files of the ``_ddpatch_runtime/`` folder: every module of ``patcher/runtime/`` with a
    header, and ``MANIFEST.json`` (the ddpatch version and each file's sha256; and ``apply``, the
    narrowing the apply was given, ``{"exclude": [...]}``, which ``ddpatch verify`` of the tree keeps)."""
    package = Path(__file__).resolve().parent.parent / "runtime"
    out = {}
    for path in sorted(package.glob("*.py")):
        head = (
            f"# ddpatch: runtime helper copied by ddpatch {__version__}; do not edit, re-run `ddpatch apply` to update.\n"
            f"# Source: patcher/runtime/{path.name} in ddpatch (MIT).\n"
        )
        out[path.name] = head + path.read_text(encoding="utf-8")
    manifest = {
        "ddpatch": __version__,
        "package": RUNTIME_PACKAGE,
        "files": {name: hashlib.sha256(text.encode("utf-8")).hexdigest() for name, text in out.items()},
    }
    if narrowing:
        manifest["apply"] = narrowing
    out[RUNTIME_MANIFEST] = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    return out


def runtime_owner(rel: str) -> PurePosixPath | None:
    """The folder whose code a runtime file serves (``a/_ddpatch_runtime/x.py`` and the old
    single file ``a/_ddpatch_runtime.py`` -> ``a``), or None for any other file."""
    path = PurePosixPath(rel)
    if path.name == RUNTIME_FILE:
        return path.parent
    if path.parent.name == RUNTIME_PACKAGE:
        return path.parent.parent
    return None


def is_removal(result: FileResult) -> bool:
    """A runtime file the new copy no longer has (the old single file, a module since renamed)."""
    return result.patched == "" and runtime_owner(result.path) is not None


def add_runtime_files(root: Path, files: list[FileResult], narrowing: dict | None = None) -> list[FileResult]:
    """The runtime folder next to every patched file that calls it, as one result per file (``narrowing``: what the
    run left out, recorded in ``MANIFEST.json``).

    A stale copy is replaced as a whole: files the new copy lacks (and an old single-file
    ``_ddpatch_runtime.py``) come back as removals (``patched == ""``), which ``install_runtime``
    carries out and the journal can undo.
    """
    wanted = sorted({PurePosixPath(f.path).parent for f in files if f.needs_runtime})
    if not wanted:
        return []
    sources = runtime_sources(narrowing)
    out = []
    for folder in wanted:
        package = folder / RUNTIME_PACKAGE
        for name, text in sources.items():
            rel = (package / name).as_posix()
            path = root / rel
            old = path.read_text(encoding="utf-8") if path.is_file() else None
            out.append(FileResult(rel, old, patched=text if old != text else None))
        present = root / package
        stale = sorted(p.name for p in present.iterdir() if p.is_file() and p.name not in sources) if present.is_dir() else []
        for name in stale + ([] if not (root / folder / RUNTIME_FILE).is_file() else [None]):
            rel = (folder / RUNTIME_FILE).as_posix() if name is None else (package / name).as_posix()
            out.append(FileResult(rel, (root / rel).read_text(encoding="utf-8", errors="replace"), patched=""))
    return out


def install_runtime(dest_root: Path, results: list[FileResult]) -> list[str]:
    """Write the runtime folder of every folder ``results`` touch, each as a whole: built in a
    temporary folder next to it, then renamed into place (an older copy, folder or single file,
    is moved aside first and deleted after). Returns the paths of ``results``."""
    owners = sorted({runtime_owner(f.path) for f in results} - {None})
    for owner in owners:
        sources = runtime_sources()
        manifest = next((f for f in results if f.path == (PurePosixPath(owner) / RUNTIME_PACKAGE / RUNTIME_MANIFEST).as_posix()), None)
        if manifest is not None:  # the manifest this run computed (it records the run's narrowing)
            sources[RUNTIME_MANIFEST] = manifest.patched if manifest.patched is not None else manifest.original
        folder = dest_root / owner
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / RUNTIME_PACKAGE
        for stale in folder.glob(f".{RUNTIME_PACKAGE}.*.ddpatch-*"):  # left by a run killed mid-install
            if stale.is_dir() and stale.name.endswith((".ddpatch-tmp", ".ddpatch-old")):
                shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(dir=folder, prefix=f".{RUNTIME_PACKAGE}.", suffix=".ddpatch-tmp"))
        try:
            mode = new_file_mode()
            for name, text in sources.items():
                with open(staging / name, "wb") as handle:
                    handle.write(text.encode("utf-8"))
                    handle.flush()
                    os.fsync(handle.fileno())
                os.chmod(staging / name, mode)
            umask = os.umask(0o022)
            os.umask(umask)
            os.chmod(staging, 0o777 & ~umask)  # mkdtemp's folder is 0700; a folder made by mkdir is not
            old = None
            if target.exists():
                old = folder / f".{RUNTIME_PACKAGE}.{os.getpid()}.ddpatch-old"
                os.replace(target, old)
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        single = folder / RUNTIME_FILE
        if single.is_file():
            single.unlink()
    return [f.path for f in results]


# ----------------------------------------------------------------------------- atomic writes
def new_file_mode() -> int:
    """The mode ``open()`` gives a new file under the current umask (``mkstemp`` would give 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: Path, data: str | bytes, mode: int | None = None) -> None:
    """Write via a temp file in the same folder and ``os.replace``: the file is whole-old or whole-new.

    ``data`` is bytes, or text written as UTF-8 with its newlines as they are. The file keeps
    its mode; a new file gets ``mode``, or the mode the umask gives a new file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    if path.exists():
        mode = path.stat().st_mode & 0o7777
    elif mode is None:
        mode = new_file_mode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".ddpatch-tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def unwritable(path: Path) -> str | None:
    """Why ``path`` must not be patched in place, if it must not."""
    if path.exists() and (not path.stat().st_mode & 0o222 or not os.access(path, os.W_OK)):  # root passes os.access
        return "read-only file; not patched (make it writable to patch it)"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:  # a file of a folder ddpatch creates (the runtime's)
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        return "read-only folder; not patched"
    return None
