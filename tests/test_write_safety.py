"""What an in-place apply promises about the files it writes: atomic, modes kept, encodings kept.

The fault tests inject a failure *inside* one write (a disk that fills up halfway), which
is what atomicity is about: a writer that writes the file in place, in two halves, or
drops its mode fails them (benchmarks/mutants.py runs such writers against this file).
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import stat
from pathlib import Path

import pytest
from cli_support import run

from patcher.engine import files as engine
from patcher.engine.files import atomic_write, decode_source, newline_of, write_provenance

TIMING = "import torch\n\n\ndef timed():\n    torch.cuda.synchronize()\n"
GUARD = "    if torch.cuda.is_available():\n        torch.cuda.synchronize()\n"
ONE_STEP = ["--recipe", "qwen3_6-gdn", "--select", "cpu-safe-timing", "-j", "1"]


pytestmark = pytest.mark.usefixtures("journal_home")  # DDPATCH_HOME in the test's tmp_path (tests/conftest.py)


# ----------------------------------------------------------------------------- a fault inside a write
class DiskFull:
    """The ``fail_at``-th file opened for writing takes the first half of what is written to it, then fails (ENOSPC).

    Files opened for writing before it are written normally.
    """

    def __init__(self, monkeypatch, fail_at: int = 1):
        self.failures = 0
        self.opened = 0
        real_open = io.open  # os.fdopen and pathlib open files through io.open too
        outer = self

        class HalfWriter(io.RawIOBase):
            def __init__(self, handle):
                self.handle = handle

            def write(self, data):
                data = bytes(data) if not isinstance(data, str) else data
                self.handle.write(data[: len(data) // 2])
                self.handle.flush()
                outer.failures += 1
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

            def __getattr__(self, name):
                return getattr(self.handle, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.handle.close()

            def close(self):
                self.handle.close()

        def writing(mode) -> bool:
            return any(c in mode for c in "wax+")

        def wrap(handle, mode):
            if not writing(mode):
                return handle
            outer.opened += 1
            return HalfWriter(handle) if outer.opened == fail_at else handle

        def fake_open(file, mode="r", *args, **kwargs):
            return wrap(real_open(file, mode, *args, **kwargs), mode)

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)


def test_a_write_that_fails_halfway_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "model.py"
    old = b"x = 1\n" * 1000
    path.write_bytes(old)
    path.chmod(0o640)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(OSError):
        fault = DiskFull(mp)
        atomic_write(path, b"y = 2\n" * 1000)
    assert fault.failures == 1, "the fault was injected inside the write"
    assert path.read_bytes() == old, "the file is whole-old after a failed write"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py"], "no temp file is left behind"


def test_a_new_file_that_fails_halfway_is_not_created(tmp_path, monkeypatch):
    path = tmp_path / "_ddpatch_runtime.py"
    with pytest.MonkeyPatch.context() as mp, pytest.raises(OSError):
        DiskFull(mp)
        atomic_write(path, "z = 3\n" * 1000)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fail_at", [1, 2, 3])  # the journal, the first file, the second file
def test_apply_that_fails_inside_a_write_leaves_whole_files_one_error_line_and_revert_works(tmp_path, monkeypatch, fail_at):
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("a.py", "b.py"):
        (tree / name).write_text(TIMING)
        (tree / name).chmod(0o640)
    before = {p.name: p.read_bytes() for p in tree.iterdir()}
    with pytest.MonkeyPatch.context() as mp:  # undone on exit, unlike the fixture's DDPATCH_HOME
        fault = DiskFull(mp, fail_at)
        mp.setattr(engine, "new_file_mode", lambda: 0o644)  # keep umask calls out of the fault
        result = run("apply", tree, *ONE_STEP)
    assert fault.failures == 1
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith("ddpatch: error: No space left")
    patched = TIMING.replace("    torch.cuda.synchronize()\n", GUARD)
    for name, data in before.items():
        now = (tree / name).read_bytes()
        assert now == data or (now.endswith(patched.encode()) and now.startswith(b"# ddpatch: recipe")), f"{name} is not whole"
        assert stat.S_IMODE((tree / name).stat().st_mode) == 0o640
    assert sum((tree / name).read_bytes() != data for name, data in before.items()) == max(0, fail_at - 2)
    assert sorted(p.name for p in tree.iterdir()) == ["a.py", "b.py"], "no temp file is left behind"
    if fail_at > 1:  # the journal was written: revert puts back what was replaced
        assert run("revert", tree).exit_code == 0
        assert {p.name: p.read_bytes() for p in tree.iterdir()} == before


def test_the_temp_file_is_made_beside_its_target_so_the_rename_is_atomic(tmp_path, monkeypatch):
    """``os.replace`` is atomic only within one filesystem: a temp file made in the system's
    temp folder (``mkstemp`` without ``dir=path.parent``) may cross devices and fail with EXDEV,
    or, with a copy fallback, not be atomic at all. The temp file must sit beside its target."""
    renames = []
    real_replace = os.replace

    def spy(src, dst, *args, **kwargs):
        renames.append((Path(src), Path(dst)))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", spy)
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    for target in (tree / "model.py", tree / "sub" / "_ddpatch_runtime.py"):
        atomic_write(target, "x = 1\n")
        assert target.read_text() == "x = 1\n"
    assert [dst for _, dst in renames] == [tree / "model.py", tree / "sub" / "_ddpatch_runtime.py"], "every write ends in one os.replace"
    for src, dst in renames:
        assert src.parent == dst.parent, f"temp file {src} is not beside {dst}: the rename may cross filesystems"
        assert src.name.startswith(f".{dst.name}."), "the temp file is a hidden sibling named after its target"


# ----------------------------------------------------------------------------- modes
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o755, 0o600])
def test_apply_and_revert_keep_file_modes(tmp_path, mode):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "timing.py").write_text(TIMING)
    (tree / "timing.py").chmod(mode)
    assert run("apply", tree, *ONE_STEP).exit_code == 0
    assert GUARD in (tree / "timing.py").read_text()
    assert stat.S_IMODE((tree / "timing.py").stat().st_mode) == mode
    assert run("revert", tree).exit_code == 0
    assert (tree / "timing.py").read_text() == TIMING and stat.S_IMODE((tree / "timing.py").stat().st_mode) == mode


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_new_files_get_the_umask_mode_not_0600(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "new.py", "x = 1\n")
        (tmp_path / "sub").mkdir()
        atomic_write(tmp_path / "sub" / "_ddpatch_runtime.py", b"y = 1\n")
    finally:
        os.umask(old)
    for path in (tmp_path / "new.py", tmp_path / "sub" / "_ddpatch_runtime.py"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, oct(path.stat().st_mode)


def test_the_runtime_helper_of_an_apply_is_importable_by_others(tmp_path):
    from patcher.engine.files import RUNTIME_PACKAGE

    tree = tmp_path / "tree"
    (tree / "model").mkdir(parents=True)
    vendored = Path(__file__).resolve().parent.parent / "vendored" / "ddtree"
    for rel in ("ddtree.py", "dflash.py", "benchmark.py", "model/__init__.py", "model/dflash.py", "model/utils.py"):
        (tree / rel).write_bytes((vendored / rel).read_bytes())
        (tree / rel).chmod(0o644)
    old = os.umask(0o022)
    try:
        result = run("apply", tree, "--recipe", "qwen3_6-gdn", "-j", "1")
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    folders = [p for p in tree.rglob(RUNTIME_PACKAGE) if p.is_dir()]
    assert folders, f"no {RUNTIME_PACKAGE}/ written"
    for folder in folders:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, "another user or container UID must be able to enter it"
        helpers = list(folder.rglob("*.py"))
        assert helpers and any(h.name == "__init__.py" for h in helpers)
        for helper in helpers:
            assert stat.S_IMODE(helper.stat().st_mode) == 0o644, f"{helper.name}: another user or container UID must be able to import it"


# ----------------------------------------------------------------------------- encodings
def _tree(tmp_path: Path, name: str, data: bytes) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir(exist_ok=True)
    (tree / name).write_bytes(data)
    return tree


def test_latin1_file_with_a_coding_cookie_is_read_and_written_in_latin1(tmp_path):
    source = b"# -*- coding: latin-1 -*-\n# caf\xe9\nimport torch\n\n\ndef timed():\n    torch.cuda.synchronize()\n    return '\xe9t\xe9'\n"
    tree = _tree(tmp_path, "lat.py", source)
    result = run("apply", tree, *ONE_STEP)
    assert result.exit_code == 0, result.output
    data = (tree / "lat.py").read_bytes()
    lines = data.split(b"\n")
    assert lines[0] == b"# -*- coding: latin-1 -*-", "the cookie stays on line 1 (PEP 263: line 1 or 2)"
    assert lines[1].startswith(b"# ddpatch: recipe qwen3_6-gdn")
    assert b"# caf\xe9\n" in data and b"'\xe9t\xe9'" in data, "non-ASCII text stays in the declared encoding"
    assert b"\xc3" not in data, "nothing was re-encoded as UTF-8"
    assert GUARD.encode() in data
    again = run("apply", tree, *ONE_STEP, "--format", "json")
    assert again.exit_code == 0 and json.loads(again.stdout)["written"] == []
    assert {s["status"] for s in json.loads(again.stdout)["steps"]} == {"already-applied"}, "provenance after the cookie is read"
    assert run("revert", tree).exit_code == 0
    assert (tree / "lat.py").read_bytes() == source


def test_a_file_that_is_not_its_declared_encoding_is_skipped_with_the_reason(tmp_path):
    tree = _tree(tmp_path, "bad.py", b"# coding: ascii\n# caf\xe9\nimport torch\n\n\ndef timed():\n    torch.cuda.synchronize()\n")
    result = run("check", tree, *ONE_STEP)
    assert result.exit_code == 1  # a skipped file is a finding
    assert "ddpatch: error: skipped bad.py: cannot read: not ascii as declared" in result.stderr


def test_crlf_file_keeps_crlf_everywhere_including_the_provenance_line(tmp_path):
    source = TIMING.replace("\n", "\r\n").encode()
    tree = _tree(tmp_path, "crlf.py", source)
    assert run("apply", tree, *ONE_STEP).exit_code == 0
    data = (tree / "crlf.py").read_bytes()
    assert data.startswith(b"# ddpatch: recipe ") and GUARD.replace("\n", "\r\n").encode() in data
    assert data.count(b"\n") == data.count(b"\r\n"), "no bare LF: the file's own newline is kept"
    again = run("apply", tree, *ONE_STEP, "--format", "json")
    assert again.exit_code == 0 and (tree / "crlf.py").read_bytes() == data, "re-applying changes nothing"
    assert run("revert", tree).exit_code == 0 and (tree / "crlf.py").read_bytes() == source


def test_utf8_bom_is_kept(tmp_path):
    source = b"\xef\xbb\xbf" + "# π\n".encode() + TIMING.encode()
    tree = _tree(tmp_path, "bom.py", source)
    assert run("apply", tree, *ONE_STEP).exit_code == 0
    data = (tree / "bom.py").read_bytes()
    assert data.startswith(b"\xef\xbb\xbf# ddpatch: recipe ") and data.count(b"\xef\xbb\xbf") == 1
    assert "# π\n".encode() in data and GUARD.encode() in data
    assert run("revert", tree).exit_code == 0 and (tree / "bom.py").read_bytes() == source


@pytest.mark.parametrize(
    "data,text,encoding",
    [
        (b"x = 1\n", "x = 1\n", "utf-8"),
        (b"\xef\xbb\xbfx = 1\n", "x = 1\n", "utf-8-sig"),
        (b"# coding: latin-1\nx = '\xe9'\n", "# coding: latin-1\nx = '\xe9'\n", "iso-8859-1"),
        (b"#!/usr/bin/env python\n# -*- coding: cp1252 -*-\nx = '\x80'\n", "#!/usr/bin/env python\n# -*- coding: cp1252 -*-\nx = '\u20ac'\n", "cp1252"),
    ],
)
def test_decode_source_follows_pep_263(data, text, encoding):
    assert decode_source(data) == (text, encoding)


@pytest.mark.parametrize("data,needle", [(b"x = '\xe9'\n", "not UTF-8"), (b"# coding: nope-codec\nx = 1\n", "bad coding declaration"),
                                         (b"\x00\x01", "binary file")])
def test_decode_source_rejects_with_a_reason(data, needle):
    with pytest.raises(ValueError, match=needle):
        decode_source(data)


@pytest.mark.parametrize("text,newline", [("a\nb\n", "\n"), ("a\r\nb\r\n", "\r\n"), ("a\rb\r", "\r"), ("", "\n"), ("a", "\n")])
def test_newline_of(text, newline):
    assert newline_of(text) == newline


def test_provenance_goes_after_shebang_and_cookie_with_the_files_newline():
    from patcher.engine.recipe import load_recipe

    recipe = load_recipe("qwen3_6-gdn")
    text = "#!/usr/bin/env python\r\n# -*- coding: latin-1 -*-\r\nx = 1\r\n"
    out = write_provenance(text, {"crop-compat"}, recipe)
    lines = out.split("\r\n")
    assert lines[:2] == text.split("\r\n")[:2] and lines[2].startswith("# ddpatch: recipe qwen3_6-gdn")
    assert "\n" not in out.replace("\r\n", "")
    assert write_provenance(out, {"crop-compat", "tree-commit"}, recipe).count("# ddpatch: recipe") == 1


@pytest.mark.parametrize("clock", [
    [1_765_000_000_000_999_999, 1_765_000_000_001_000_001],  # 2 us apart in one second: the ns mod 1e6 fall
    [1_765_000_000_500_000_000] * 3,  # a frozen clock: three applies in one microsecond
])
def test_journals_sort_in_the_order_the_applies_ran(tmp_path, monkeypatch, clock):
    """``revert`` undoes the journal that sorts last: it must be the latest apply's, however close
    two applies come (test_runtime_copy's apply-apply-revert once reverted the first one)."""
    from patcher.engine import journal

    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))
    root = tmp_path / "tree"
    root.mkdir()
    (root / "a.py").write_text("x = 0\n")
    ticks = iter(clock)
    monkeypatch.setattr(journal.time, "time_ns", lambda: next(ticks))
    made = [journal.record(root, {"a.py": f"x = {i}\n"}, "r") for i in range(len(clock))]
    assert journal.latest(root) == made[-1]
    assert sorted(made) == made and len(set(made)) == len(made), "one journal per apply, in order"
