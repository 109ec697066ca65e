"""Reading and writing source files: encodings as Python reads them, the provenance line,
atomic writes, and the runtime helper that patched trees get a copy of.

Nothing here knows about recipes' steps; ``pipeline`` reads through it and ``write`` writes.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path, PurePosixPath
from typing import Iterable

from .. import __version__
from ..results import FileResult
from .codemods.base import RUNTIME_MODULE
from .recipe import Recipe

RUNTIME_FILE = RUNTIME_MODULE + ".py"
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+([A-Za-z_]\w*)", re.M)
_PROVENANCE = re.compile(r"^# ddpatch: recipe (?P<recipe>\S+) v(?P<version>\d+), ddpatch (?P<ddpatch>\S+); steps: (?P<steps>.*)$")


# ----------------------------------------------------------------------------- reading
def read_source(path: Path) -> str:
    return decode_source(path.read_bytes())[0]


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
def _runtime_source() -> str:
    body = (Path(__file__).resolve().parent.parent / "runtime.py").read_text(encoding="utf-8")
    head = (
        f"# ddpatch: runtime helper copied by ddpatch {__version__}; do not edit, re-run `ddpatch apply` to update.\n"
        "# Source: patcher/runtime.py in ddpatch (MIT).\n"
    )
    return head + body


def add_runtime_files(root: Path, files: list[FileResult]) -> list[FileResult]:
    """One runtime module next to every patched file that calls it."""
    wanted = sorted({PurePosixPath(f.path).parent for f in files if f.needs_runtime})
    if not wanted:
        return []
    source = _runtime_source()
    out = []
    for folder in wanted:
        rel = (folder / RUNTIME_FILE).as_posix()
        path = root / rel
        old = path.read_text(encoding="utf-8") if path.exists() else None
        out.append(FileResult(rel, old, patched=source if old != source else None))
    return out


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
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return "read-only folder; not patched"
    return None
