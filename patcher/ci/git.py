"""Read-only access to a git repository's object store: commits, ranges, parents, trees, diffs.

The user's checkout, index and refs are never touched; bare repositories work.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path, PurePosixPath
from typing import Callable

from ..errors import CIError


def _git_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):
        # a caller's GIT_DIR / GIT_INDEX_FILE / GIT_WORK_TREE must not redirect our reads
        if key.startswith("GIT_") and key not in ("GIT_CONFIG_NOSYSTEM", "GIT_CONFIG_GLOBAL", "GIT_CEILING_DIRECTORIES"):
            del env[key]
    env["GIT_TERMINAL_PROMPT"] = "0"
    env["GIT_OPTIONAL_LOCKS"] = "0"  # reads only: never take the index lock of the user's checkout
    return env


class Repo:
    """Read-only access to a git repository (a checkout or a bare repository)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise CIError(f"repository path does not exist: {self.path}")
        if not self.path.is_dir():
            raise CIError(f"not a git repository (not a directory): {self.path}")
        self.path = self.path.resolve()
        self._env = _git_env()
        self._parents: dict[str, list[str]] = {}
        self._chains: dict[tuple[str, str], list[str]] = {}
        self.git_dir: str | None = None
        try:
            git_dir = self.git("rev-parse", "--absolute-git-dir").strip()
        except CIError as exc:
            raise CIError(f"not a git repository: {self.path} ({exc})") from None
        # From here on, talk to the object store only: no work tree, so a path given inside a
        # checkout changes nothing (pathspecs are from the top) and the checkout is never read.
        self.git_dir = git_dir

    def run(self, *args: str, input: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess:
        where = ["--git-dir", self.git_dir] if self.git_dir else ["-C", str(self.path)]
        try:
            proc = subprocess.run(
                ["git", *where, "-c", "core.quotepath=off", *args],
                input=input,
                capture_output=True,
                env=self._env,
                cwd=self.git_dir or self.path,
            )
        except FileNotFoundError:
            raise CIError("git is not installed (needed by ddpatch ci)") from None
        if check and proc.returncode != 0:
            lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            raise CIError(lines[-1] if lines else f"git {args[0]} failed with status {proc.returncode}")
        return proc

    def git(self, *args: str) -> str:
        return self.run(*args).stdout.decode("utf-8", "replace")

    def commit(self, rev: str, flag: str = "--rev") -> str:
        """The full sha of a commit-ish, or a one-line error."""
        if not rev or rev.startswith("-"):
            raise CIError(f"{flag}: not a revision: {rev!r}")
        proc = self.run("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
        sha = proc.stdout.decode().strip()
        if proc.returncode != 0 or not sha:
            raise CIError(f"{flag}: unknown revision {rev!r} in {self.path}")
        return sha

    def range(self, since: str | None, tip: str) -> list[str]:
        """``since`` (the baseline) then ``since..tip`` oldest first, in topological order; or just ``tip``."""
        if since is None:
            return [tip]
        if since != tip and self.run("merge-base", "--is-ancestor", since, tip, check=False).returncode != 0:
            raise CIError(f"--since {since[:12]} is not an ancestor of --rev {tip[:12]}")
        shas = self.git("rev-list", "--topo-order", "--reverse", f"{since}..{tip}").split()
        return [since, *shas]

    def parents(self, sha: str) -> list[str]:
        if sha not in self._parents:
            self._parents[sha] = self.git("rev-list", "--parents", "-n", "1", sha).split()[1:]
        return self._parents[sha]

    def load_parents(self, since: str, tip: str) -> None:
        for line in self.git("rev-list", "--parents", f"{since}..{tip}").splitlines():
            shas = line.split()
            if shas:
                self._parents[shas[0]] = shas[1:]

    def first_parent_chain(self, tip: str, exclude: str) -> list[str]:
        """The first-parent line from ``tip`` back to (not including) the ancestors of ``exclude``, oldest first."""
        if (tip, exclude) not in self._chains:
            self._chains[tip, exclude] = self.git("rev-list", "--first-parent", "--reverse", tip, f"^{exclude}").split()
        return self._chains[tip, exclude]

    def describe(self, shas: list[str]) -> dict[str, tuple[str, str]]:
        """sha -> (author date, subject)."""
        out: dict[str, tuple[str, str]] = {}
        for i in range(0, len(shas), 500):
            text = self.git("show", "-s", "--no-walk=unsorted", "--format=%H%x00%as%x00%s", *shas[i : i + 500])
            for line in text.splitlines():
                parts = line.split("\x00")
                if len(parts) == 3:
                    out[parts[0]] = (parts[1], parts[2])
        return out

    def export(self, sha: str, dest: Path, want: Callable[[str], bool] | None = None) -> int:
        """Write the tree of ``sha`` under ``dest`` from the object store; returns the number of files.

        Nothing but the object database is read: no checkout, no index, no attributes or
        filters (a tree identical to the commit). Submodules are left out; a symlink is
        written only if it stays inside the tree.
        """
        listing = self.run("ls-tree", "-r", "-z", "--full-tree", sha).stdout.decode("utf-8", "surrogateescape")
        entries = []
        for record in listing.split("\x00"):
            if not record:
                continue
            meta, _, path = record.partition("\t")
            mode, kind, obj = meta.split()
            parts = PurePosixPath(path).parts
            if kind != "blob" or path.startswith("/") or any(p in ("..", ".git") for p in parts):
                continue
            if want is not None and mode != "120000" and not want(path):
                continue
            entries.append((mode, obj, path))
        if not entries:
            return 0
        data = self.run("cat-file", "--batch", input="".join(f"{obj}\n" for _, obj, _ in entries).encode()).stdout
        at = 0
        written = 0
        for mode, _obj, path in entries:
            end = data.index(b"\n", at)
            header = data[at:end].split()
            size = int(header[2])
            blob = data[end + 1 : end + 1 + size]
            at = end + 1 + size + 1
            target = dest.joinpath(*PurePosixPath(path).parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            if mode == "120000":
                link = blob.decode("utf-8", "surrogateescape")
                resolved = os.path.normpath(os.path.join(os.path.dirname(path), link))
                if os.path.isabs(link) or resolved.startswith("..") or (want is not None and not want(resolved)):
                    continue
                os.symlink(link, target)
            else:
                target.write_bytes(blob)
                if mode == "100755":
                    target.chmod(0o755)
            written += 1
        return written

    def diff(self, old: str, new: str, paths: list[str], stat: bool = False) -> str:
        args = ["diff", "--no-color", "--no-ext-diff", "--no-textconv", "-M", "--src-prefix=a/", "--dst-prefix=b/"]
        if stat:
            args.append("--stat=100")
        return self.git(*args, old, new, "--", *paths)
