"""A patch keeps upstream's lazy imports: a module that imports torch only inside functions still imports without torch.

DFlash's ``benchmark.py`` imports torch inside ``_run_transformers``, so that its sglang, vLLM and MLX
clients, and ``dflash.load_and_process_dataset`` (a lazy export of the package), load where torch is not
installed; upstream's own ``tests/test_package.py::test_lazy_dataset_export`` checks that. The
``cpu-safe-timing`` step guards the ``torch.cuda.set_device`` in there and must not add a module-level
``import torch`` to do it (it once did).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from drift.variants import BY_NAME, VENDORED
from drift.variants_newest import module_level_imports

# what upstream's test does, in an interpreter where torch and transformers cannot be imported
TORCH_FREE = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Block())
import dflash
from dflash.benchmark import load_and_process_dataset
assert dflash.load_and_process_dataset is load_and_process_dataset
"""


def _imports_without_torch(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TORCH_FREE], cwd=tree, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["vendored", "lazy-torch-bench", "newest"])
def test_a_patched_benchmark_imports_without_torch(name, tmp_path):
    from patcher import api

    src = VENDORED / "dflash" if name == "vendored" else BY_NAME[name].make(tmp_path / "src")
    control = _imports_without_torch(src)
    assert control.returncode == 0, f"the unpatched tree must import without torch for this test to mean anything: {control.stderr}"
    result = api.apply(src, out=tmp_path / "out", jobs=1)
    bench = tmp_path / "out" / "dflash" / "benchmark.py"
    timing = next(s for s in result.report.steps if s.spec.id == "cpu-safe-timing")
    assert timing.status == "applied" and "is_available()" in bench.read_text(), "the guard was written"
    assert "torch" not in module_level_imports(bench.read_text()), "cpu-safe-timing turned a lazy torch import into a module-level one"
    patched = _imports_without_torch(tmp_path / "out")
    assert patched.returncode == 0, f"the patched benchmark no longer imports without torch: {patched.stderr[-600:]}"
