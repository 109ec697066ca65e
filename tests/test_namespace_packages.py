"""The runtime import resolves however a patched module is imported (issue 42, item 8).

A fork's package folder without ``__init__.py`` (a namespace package) whose modules import each other relatively
was given ``import _ddpatch_runtime``, which does not resolve when the module is imported as ``pkg.mod``. Each
patched tree here is imported as a user would: ``import pkg.decode`` from the tree's root, and, for a module that
may also be run as a script, from inside its folder.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patcher import api
from patcher.engine.packages import BOTH, package_modes

DECODE = '''
from transformers import DynamicCache

from .timing import timed


def dflash_generate(model, target, input_ids, max_new_tokens, block_size):
    target_cache = DynamicCache()
    draft_cache = DynamicCache()
    out, _seconds = timed(lambda: target(input_ids, past_key_values=target_cache, output_hidden_states=True))
    start = input_ids.shape[1]
    while start < max_new_tokens:
        block = input_ids[:, -block_size:]
        model(target_hidden=out.hidden_states[-1], noise_embedding=target.get_input_embeddings()(block), past_key_values=draft_cache)
        draft_cache.crop(start)
        out = target(block, past_key_values=target_cache, output_hidden_states=True)
        start += 1
        target_cache.crop(start)
    return out
'''
TIMING = '''
import torch


def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    return out, start.elapsed_time(end) / 1000
'''


pytestmark = pytest.mark.usefixtures("journal_home")  # DDPATCH_HOME in the test's tmp_path (tests/conftest.py)


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_a_namespace_package_is_imported_as_pkg_mod_and_as_a_script_after_the_patch(tmp_path):
    src = write(tmp_path / "src", {"pkg/decode.py": DECODE, "pkg/timing.py": TIMING,
                                   "bench.py": "from pkg.decode import dflash_generate\n"})
    result = api.apply(src, out=tmp_path / "out", jobs=1)
    assert not result.blocked and {"pkg/decode.py", "pkg/timing.py"} <= set(result.written)
    out = tmp_path / "out"
    decode, timing = (out / "pkg" / "decode.py").read_text(), (out / "pkg" / "timing.py").read_text()
    assert "from . import _ddpatch_runtime" in decode and "\nimport _ddpatch_runtime" not in decode
    assert "try:\n    from . import _ddpatch_runtime\nexcept ImportError" in timing
    as_package = python("import bench, pkg.timing; out, s = pkg.timing.timed(lambda: 7); assert out == 7 and s >= 0; print('ok')", out)
    assert as_package.returncode == 0 and as_package.stdout.strip() == "ok", as_package.stderr[-1200:]
    as_script = python("import timing; out, s = timing.timed(lambda: 7); assert out == 7; print('ok')", out / "pkg")
    assert as_script.returncode == 0 and as_script.stdout.strip() == "ok", as_script.stderr[-1200:]
    again = api.apply(out, jobs=1)
    assert not again.written, "a second run finds the import block it wrote"


def test_unpatched_behaviour_the_import_is_what_broke(tmp_path):
    """The control: written as before (``import _ddpatch_runtime`` in a module imported as pkg.mod), it fails."""
    out = write(tmp_path / "tree", {"pkg/mod.py": "import _ddpatch_runtime\n", "pkg/_ddpatch_runtime/__init__.py": ""})
    assert python("import pkg.mod", out).returncode != 0


def test_how_each_module_is_read():
    texts = {
        "bench.py": "from pkg.plain import f\nimport pkg.dotted as d\n",
        "pkg/relative.py": "from .plain import f\n",
        "pkg/plain.py": "import torch\n",
        "pkg/dotted.py": "import torch\n",
        "pkg/sibling.py": "from . import lone\n",
        "pkg/lone.py": "x = 1\n",
        "scripts/run.py": "import torch\n",
        "src/lib/mod.py": "x = 1\n",
        "tool.py": "from lib.mod import x\n",
    }
    modes = package_modes(Path("/nonexistent"), texts)
    # scripts/run.py is imported by nothing in the tree, but verify (and a user's notebook) imports it from the root as
    # scripts.run, and it may be run as a script: both ways
    assert modes == {"bench.py": False, "tool.py": False, "pkg/relative.py": True, "pkg/sibling.py": True,
                     "pkg/plain.py": BOTH, "pkg/dotted.py": BOTH, "pkg/lone.py": BOTH, "scripts/run.py": BOTH,
                     "src/lib/mod.py": BOTH}


def test_a_regular_package_and_the_root_keep_their_imports(tmp_path):
    root = write(tmp_path / "tree", {"pkg/__init__.py": "", "pkg/a.py": "import torch\n", "top.py": "import pkg.a\n"})
    assert package_modes(root, {"pkg/__init__.py": "", "pkg/a.py": "import torch\n", "top.py": "import pkg.a\n"}) == {
        "pkg/__init__.py": True, "pkg/a.py": True, "top.py": False}
