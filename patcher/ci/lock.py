"""The lock file: ``last_verified`` per upstream, updated in place when a ``ci`` run is green."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..results import EXIT_OK, CIResult
from .git import CIError


#: The lock file ``--update-lock`` writes by default: beside the user's fork (the working folder), never in ddpatch's source.
DEFAULT_LOCK = "ddpatch-upstream.lock"


def default_lock_path() -> Path:
    return Path.cwd() / DEFAULT_LOCK


def update_lock_text(text: str, table: str, commit: str) -> str:
    """``text`` with ``last_verified`` of ``[table]`` set to ``commit``; every other byte kept."""
    import tomllib

    lines = text.splitlines(keepends=True)
    header = last_key = None
    in_table = False
    new_line = f'last_verified = "{commit}"'
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("["):
            in_table = stripped.split("#", 1)[0].strip() == f"[{table}]"
            if in_table:
                header = i
            continue
        if not in_table or not stripped or stripped.startswith("#"):
            continue
        if re.match(r"last_verified\s*=", stripped):
            indent = line[: len(line) - len(line.lstrip())]
            ending = line[len(line.rstrip("\r\n")):] or "\n"
            lines[i] = indent + new_line + ending
            break
        last_key = i
    else:
        if header is None:
            raise CIError(f"the lock file has no [{table}] table")
        at = (last_key if last_key is not None else header) + 1
        ending = "\n" if lines[at - 1].endswith("\n") else ""
        if not ending:
            lines[at - 1] += "\n"
        lines.insert(at, new_line + "\n")
    new = "".join(lines)
    try:
        before, after = tomllib.loads(text), tomllib.loads(new)
    except tomllib.TOMLDecodeError as exc:
        raise CIError(f"the lock file is not valid TOML: {exc}") from None
    after_table = dict(after.get(table, {}))
    if after_table.pop("last_verified", None) != commit or {**before, table: None} != {**after, table: None} or \
            {k: v for k, v in before.get(table, {}).items() if k != "last_verified"} != after_table:
        raise CIError(f"could not update last_verified of [{table}] without touching anything else")
    return new


def update_lock(path: Path, table: str, commit: str) -> bool:
    """Set ``last_verified``; returns whether the file changed."""
    from ..engine.files import atomic_write  # the engine (and libcst) only when the lock is written

    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if f"[{table}]" not in old:  # a new lock beside the fork, or a new upstream in it: add its table
        old_text, old = old, old + ("\n" if old and not old.endswith("\n") else "") + f"[{table}]\n"
        new = update_lock_text(old, table, commit)
        atomic_write(path, new)
        return new != old_text
    new = update_lock_text(old, table, commit)
    if new != old:
        atomic_write(path, new)
    return new != old


def apply_lock(result: CIResult, path: Path) -> dict:
    """Record the tip as verified for its upstream when the run is green."""
    table = result.forced_upstream or result.tip.upstream
    info: dict[str, Any] = {"path": str(path), "upstream": table, "commit": result.tip.sha, "updated": False}
    if result.exit_code != EXIT_OK:
        info["reason"] = "not updated: the run is not green"
    elif table is None:
        info["reason"] = "not updated: the upstream layout was not detected (pass --upstream)"
    else:
        info["updated"] = update_lock(path, table, result.tip.sha)
        if not info["updated"]:
            info["reason"] = "already up to date"
    result.lock = info
    return info
