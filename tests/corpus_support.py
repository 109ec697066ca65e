"""The corpus's sites per release, kept as data (``tests/data/corpus_sites/``): measure, compare, write.

``tests/test_corpus.py`` runs the recipe over real trees nobody wrote for ddpatch (the installed
transformers and torch, and a fixed sample of each) and over ``vendored/``. Which sites a real
package has changes with its release, so the exact sites are data, one file per release:

* ``<package>/<release>.json``: ``sample`` (the sample's sites, per file, ``step|status: count``)
  and ``package`` (the whole package's sites per ``step|status``), for the release installed
  when it was written (``2.13.0+cpu`` counts as ``2.13.0``);
* ``vendored.json``: the sites of ``vendored/`` per file (our own upstream-shaped trees, the one
  corpus with a decode loop; no release in it).

The files were written by running the recipe (``--write``), so they are expectations only once
someone reviewed them: the diff must show the sites a change of the recipe or of the release
explains (tests/fixtures/README.md says how to read a site). Never rewrite one to turn a test
green without that reason in the commit.

    python3 tests/corpus_support.py                    # measure here, print what differs from the data; writes nothing
    python3 tests/corpus_support.py --write            # write the installed releases' files and vendored.json
    python3 tests/corpus_support.py --write --sample-only transformers   # the sample only (seconds, not a minute)

A release of the version matrix is measured in its environment (``.ci/matrix`` makes them):

    for r in 5.21.0 5.23.0 5.24.0 5.25.0; do
        ${DDPATCH_MATRIX_DIR:-/tmp/ddpatch-matrix}/v$r/bin/python tests/corpus_support.py --write transformers
    done

Exit status: 0 when the data matches (or was written), 1 when it differs.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))  # this checkout's patcher, not an installed one

from patcher.engine.pipeline import run_recipe  # noqa: E402
from patcher.engine.recipe import load_recipe  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "corpus_sites"
RECIPE = load_recipe("qwen3_6-gdn")
VENDORED = ROOT / "vendored"

#: The fast tier's sample: paths inside each package, chosen on transformers 5.23.0 and torch 2.13.0.
SAMPLE = {
    "transformers": [
        "modelcard.py", "integrations/neftune.py", "models/shieldgemma2/modeling_shieldgemma2.py", "integrations/deepgemm.py",
        "distributed/pipeline_parallel.py", "models/pi0/modeling_pi0.py", "models/kosmos2/modeling_kosmos2.py",
        "generation/candidate_generator.py",  # 5.25: transformers' own past recording with a count (crop-compat rewrites it)
        # turned away by the syntax-tree prefilter
        "integrations/sdpa_paged.py", "models/jev/modeling_jev.py", "integrations/eager_paged.py",
        # the hybrid model and the cache ddpatch patches code for: no site of its own
        "models/qwen3_5/modeling_qwen3_5.py", "models/qwen3_5/configuration_qwen3_5.py", "cache_utils.py",
    ],
    "torch": [
        "_inductor/codegen/rocm/rocm_benchmark_request.py", "_vendor/quack/bench/bench_utils.py", "autograd/profiler_legacy.py",
        "_inductor/codegen/mtia/device_op_overrides.py", "mps/event.py",  # turned away by the syntax-tree prefilter
        "nn/modules/linear.py", "utils/benchmark/utils/timer.py",
    ],
}


def package_root(name: str) -> Path:
    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


def installed_release(package: str) -> str:
    """The installed release without its local part: ``2.13.0+cpu`` -> ``2.13.0``."""
    return importlib.metadata.version(package).split("+")[0]


def sample_tree(name: str, dest: Path) -> Path:
    """A copy of ``name``'s sample files (each with the ``__init__.py`` beside it) under ``dest``."""
    root = package_root(name)
    for rel in SAMPLE[name]:
        if not (root / rel).is_file():
            continue  # another release moved it; what is left is still scanned
        for src in (root / rel, (root / rel).parent / "__init__.py"):
            if src.is_file():
                (dest / src.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dest / src.relative_to(root))
    return dest


def sites_per_file(report) -> dict[str, dict[str, int]]:
    return {f.path: dict(sorted(Counter(f"{s.step}|{s.status}" for s in f.sites).items()))
            for f in sorted(report.files, key=lambda f: f.path) if f.sites}


def sites_per_kind(report) -> dict[str, int]:
    return dict(sorted(Counter(f"{s.step}|{s.status}" for f in report.files for s in f.sites).items()))


def recorded(package: str) -> dict | None:
    """The data for the installed release of ``package``; None where it was never measured."""
    path = DATA / package / f"{installed_release(package)}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def recorded_vendored() -> dict[str, dict[str, int]]:
    return json.loads((DATA / "vendored.json").read_text())["sites"]


def measure(package: str, sample_only: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"ddpatch-corpus-{package}-") as tmp:
        sample = sites_per_file(run_recipe(RECIPE, sample_tree(package, Path(tmp)), include_vendored=True))
    out = {"package": package, "release": installed_release(package),
           "written_by": "python3 tests/corpus_support.py --write", "sample": sample}
    if not sample_only:
        out["package_sites"] = sites_per_kind(run_recipe(RECIPE, package_root(package), jobs=2, include_vendored=True))
    return out


def measure_vendored() -> dict:
    return {"written_by": "python3 tests/corpus_support.py --write", "sites": sites_per_file(run_recipe(RECIPE, VENDORED, include_vendored=True))}


def _text(data: dict) -> str:
    return json.dumps(data, indent=1, sort_keys=False) + "\n"


def main(argv: list[str]) -> int:
    write = "--write" in argv
    sample_only = "--sample-only" in argv
    names = [a for a in argv if not a.startswith("--")] or ["transformers", "torch", "vendored"]
    differs = False
    for name in names:
        if name == "vendored":
            path, new = DATA / "vendored.json", measure_vendored()
        else:
            new = measure(name, sample_only)
            path = DATA / name / f"{new['release']}.json"
            if sample_only and path.is_file():  # keep the whole package's counts measured before
                old = json.loads(path.read_text())
                if "package_sites" in old:
                    new["package_sites"] = old["package_sites"]
        old_text = path.read_text() if path.is_file() else ""
        if old_text == _text(new):
            print(f"{path.relative_to(ROOT)}: unchanged")
            continue
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_text(new))
            print(f"{path.relative_to(ROOT)}: written (review the diff)")
        else:
            differs = True
            import difflib

            sys.stdout.writelines(difflib.unified_diff(old_text.splitlines(True), _text(new).splitlines(True),
                                                       f"a/{path.relative_to(ROOT)}", f"b/{path.relative_to(ROOT)}"))
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
