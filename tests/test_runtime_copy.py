"""The runtime as it travels: the ``_ddpatch_runtime/`` folder a patched tree gets.

Written as a whole (a temporary folder, then a rename), stamped with a manifest, replacing any
older copy (the single file older releases wrote included), removed by ``revert``, and
importable with no ddpatch installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patcher import __version__, api
from patcher.engine.files import RUNTIME_MANIFEST, install_runtime, runtime_sources
from patcher.results import FileResult

VENDORED = Path(__file__).resolve().parent.parent / "vendored" / "ddtree"


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))
    root = tmp_path / "ddtree"
    shutil.copytree(VENDORED, root)
    return root


def _folder_files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in folder.iterdir() if p.is_file()}


def test_the_folder_replaces_an_older_copy_and_revert_puts_it_back(tree):
    old_single = "# ddpatch: runtime helper copied by ddpatch 0.0.1\nOLD = True\n"
    (tree / "_ddpatch_runtime.py").write_text(old_single)
    result = api.apply(tree, jobs=1)
    assert not result.blocked
    folder = tree / "_ddpatch_runtime"
    assert _folder_files(folder) == runtime_sources(), "exactly the new copy, nothing left of the old one"
    assert not (tree / "_ddpatch_runtime.py").exists(), "the single-file copy is gone (the folder would shadow it)"
    manifest = json.loads((folder / RUNTIME_MANIFEST).read_text())
    assert manifest["ddpatch"] == __version__ and "verify.py" in manifest["files"]
    assert not [p for p in tree.iterdir() if p.name.startswith("._ddpatch_runtime")], "no temporary folder is left"
    api.revert(tree)  # the folder goes, the single file comes back
    assert not folder.exists() and (tree / "_ddpatch_runtime.py").read_text() == old_single


def test_a_stale_folder_is_replaced_as_a_whole(tree):
    api.apply(tree, jobs=1)
    folder = tree / "_ddpatch_runtime"
    (folder / "stale_module.py").write_text("STALE = 1\n")  # a module a later release no longer ships
    (folder / "commit.py").write_text("# edited by hand\n")
    again = api.apply(tree, jobs=1)
    assert sorted(again.written) == ["_ddpatch_runtime/commit.py", "_ddpatch_runtime/stale_module.py"]
    assert _folder_files(folder) == runtime_sources()

    api.revert(tree)  # back to the copy as it was before this apply
    assert (folder / "stale_module.py").read_text() == "STALE = 1\n"
    assert (folder / "commit.py").read_text() == "# edited by hand\n"


def test_a_failed_install_leaves_the_old_folder_whole(tree, monkeypatch):
    api.apply(tree, jobs=1)
    folder = tree / "_ddpatch_runtime"
    (folder / "commit.py").write_text("# old copy\n")
    before = _folder_files(folder)
    real = os.replace

    def refuse(src, dst, *args, **kwargs):
        if Path(dst) == folder and "ddpatch-tmp" in str(src):
            raise OSError("disk full")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        install_runtime(tree, [FileResult("_ddpatch_runtime/commit.py", "# old copy\n", patched="x")])
    monkeypatch.setattr(os, "replace", real)
    if not folder.exists():  # moved aside before the failed rename: nothing was deleted
        aside = [p for p in tree.iterdir() if p.name.startswith("._ddpatch_runtime") and "ddpatch-old" in p.name]
        assert aside and _folder_files(aside[0]) == before
    else:
        assert _folder_files(folder) == before
    assert not [p for p in tree.iterdir() if "ddpatch-tmp" in p.name], "the temporary folder is removed"


def test_the_patched_tree_imports_its_runtime_without_ddpatch(tree):
    api.apply(tree, jobs=1)
    code = (
        "import sys; sys.modules['patcher'] = None\n"  # ddpatch itself cannot be imported
        "import _ddpatch_runtime as r\n"
        "r.TREE_STRATEGY = 'node'\n"
        "from _ddpatch_runtime import options, strategies\n"
        "assert options.TREE_STRATEGY == 'node' and strategies.options is options\n"
        "assert callable(r.verify_forward) and callable(r.tree_commit)\n"
        "assert not any(m == 'patcher' or m.startswith('patcher.') for m in sys.modules if sys.modules[m])\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
