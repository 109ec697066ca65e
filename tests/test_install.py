"""ddpatch installed as people install it (issue 39): the wheel carries everything the CLI reads (the
built-in upstream-shaped trees, the recipes, the trained pair) as package data of ``patcher``, and no
other top-level package; ``patcher.shipped`` finds those folders in a checkout and in an install.

The fast tests run the CLI from an installed layout made by hand (no wheel built); the slow ones build
the wheel (and the sdist it may be built from) and run ``ddpatch demo`` from a venv it is installed in.
``.ci/wheel`` does the same in a fresh venv with torch installed from scratch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import patcher

ROOT = Path(__file__).resolve().parent.parent
#: what setup.py's build step copies: checkout folder -> its place in the installed package
SHIPPED = {"recipes": "patcher/data/recipes", "vendored": "patcher/data/vendored"}
PAIR = "patcher/data/trained_pair"
NOT_SHIPPED = shutil.ignore_patterns("__pycache__", "*.py[cod]", ".*")
#: the wheel's files outside the trained pair, uncompressed: about 0.75 MB today (the trained pair's
#: weights are 10.5 MB of the 11.4 MB); a file over the cap is something shipped by mistake
REST_CAP, FILE_CAP = 2_000_000, 200_000


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc" and not p.name.startswith(".")}


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DDPATCH_WARM_VERIFIER")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


# ----------------------------------------------------------------------------- where the data is found
def _locator(package: Path):
    """``patcher.shipped`` as it runs from a package folder at ``package`` (its ``__init__.py`` copied there)."""
    package.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(patcher.__file__), package / "__init__.py")
    spec = importlib.util.spec_from_file_location(f"located_{abs(hash(package))}", package / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.shipped


def test_shipped_reads_the_install_first_then_the_checkout_it_lies_in(tmp_path):
    installed = tmp_path / "site" / "patcher"
    shipped = _locator(installed)
    (installed / "data" / "vendored").mkdir(parents=True)
    (tmp_path / "site" / "recipes").mkdir()  # another project's top-level `recipes` in site-packages: never ours
    assert shipped("vendored") == installed / "data" / "vendored"
    assert shipped("recipes") == installed / "data" / "recipes"  # missing: the install's path, for the error to name

    checkout = tmp_path / "clone"
    shipped = _locator(checkout / "patcher")
    (checkout / "pyproject.toml").write_text("[project]\n")
    (checkout / "vendored").mkdir()
    assert shipped("vendored") == checkout / "vendored"
    (checkout / "patcher" / "data" / "vendored").mkdir(parents=True)  # an install's copy wins where both are
    assert shipped("vendored") == checkout / "patcher" / "data" / "vendored"
    assert patcher.shipped("vendored") == ROOT / "vendored" and patcher.shipped("recipes") == ROOT / "recipes"


def test_the_cli_runs_from_an_installed_layout_without_the_checkout(tmp_path):
    """The package laid out as the wheel lays it (no checkout above it): the recipes, the demo's
    built-in tree and SARIF's recipe lines are all found inside ``patcher``."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "patcher", site / "patcher", ignore=shutil.ignore_patterns("__pycache__", "trained_pair"))
    for source, target in SHIPPED.items():
        shutil.copytree(ROOT / source, site / target, ignore=NOT_SHIPPED)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = (
        "import patcher, sys\n"
        "from patcher.cli import main\n"
        "from patcher.engine.recipe import load_recipe\n"
        "from patcher.report.sarif import _recipe_location\n"
        "print(patcher.__file__)\n"
        "loc = _recipe_location(load_recipe('qwen3_6-gdn'), 'target-cache-config')\n"
        "print('sarif-line', loc['physicalLocation'].get('region', {}).get('startLine'))\n"
        "sys.argv = ['ddpatch', 'demo', '--no-verify', '--out', 'demo']\n"
        "main()\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=_clean_env(PYTHONPATH=str(site)),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    first = run.stdout.splitlines()[0]
    assert first == str(site / "patcher" / "__init__.py"), first
    assert "sarif-line None" not in run.stdout, run.stdout
    assert (elsewhere / "demo" / "_ddpatch_runtime").is_dir() and (elsewhere / "demo" / "ddtree.py").is_file()


# ----------------------------------------------------------------------------- the built wheel
def _source_copy(dest: Path) -> Path:
    """The checkout without what a build or a test run leaves in it (a build in place would write there)."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", ".venv", "venv", "wheelhouse", "out"))
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", minversion="68")  # pyproject's build requirement; no index is reached
    base = tmp_path_factory.mktemp("wheel")
    source = _source_copy(base / "src")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(base / "dist"), str(source)],
                           capture_output=True, text=True, timeout=600, env=_clean_env())
    assert build.returncode == 0, build.stderr[-3000:]
    (path,) = (base / "dist").glob("ddpatch-*.whl")
    return path


@pytest.mark.heavy
def test_the_wheel_carries_the_data_under_patcher_and_no_other_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
    names = {i.filename for i in infos}
    top = {n.split("/")[0] for n in names}
    assert top == {"patcher", f"{wheel.name.split('-py3')[0]}.dist-info"}, top
    for source, target in SHIPPED.items():
        inside = {n[len(target) + 1:] for n in names if n.startswith(target + "/")}
        assert inside == _files(ROOT / source), f"{target}: {sorted(inside ^ _files(ROOT / source))}"
    pair = {n[len(PAIR) + 1:] for n in names if n.startswith(PAIR + "/")}
    assert pair == _files(ROOT / PAIR)
    assert not [n for n in names if n.endswith((".pyc", ".pyo")) or "__pycache__" in n]
    # what else it carries stays small: the trained pair is the wheel's weight, by design
    rest = [i for i in infos if not i.filename.startswith(PAIR + "/")]
    big = [(i.filename, i.file_size) for i in rest if i.file_size > FILE_CAP]
    assert not big and sum(i.file_size for i in rest) < REST_CAP, (big, sum(i.file_size for i in rest))


@pytest.mark.heavy
def test_a_wheel_built_from_the_sdist_is_the_same(wheel, tmp_path):
    """``python -m build`` and ``uv build`` go through the sdist: MANIFEST.in must bring recipes/ and vendored/ along."""
    source = _source_copy(tmp_path / "src")
    code = ("import os, sys, tarfile; from setuptools import build_meta as b\n"
            "out = sys.argv[1]  # build_meta rewrites sys.argv\n"
            "sdist = b.build_sdist(out); tarfile.open(f'{out}/{sdist}').extractall(out, filter='data')\n"
            "os.chdir(f'{out}/{sdist[:-len(\".tar.gz\")]}'); print(b.build_wheel(out))\n")
    out = tmp_path / "out"
    out.mkdir()
    built = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True, timeout=600, env=_clean_env())
    assert built.returncode == 0, built.stderr[-3000:]
    with zipfile.ZipFile(out / built.stdout.split()[-1]) as z, zipfile.ZipFile(wheel) as w:
        assert sorted(z.namelist()) == sorted(w.namelist())


def _venv_over_this_environment(venv: Path) -> Path:
    """A bare venv of this interpreter, for ``_see_this_environment`` once its own packages are in; returns its python.

    Not ``venv --system-site-packages``: that reaches the *base* interpreter's packages, which are not this
    environment's when the tests run inside a venv (README command 2 in a fresh venv: no ``rich`` there)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return venv / "bin" / "python"


def _see_this_environment(python: Path) -> None:
    """Let the venv of ``python`` import what this interpreter imports, after its own packages, whatever kind of
    environment runs the tests (a global install, a venv, a venv over system site packages, a user site): a ``.pth``
    file lists the folders on this ``sys.path`` that the venv lacks, less the checkout (what is tested must come from
    the venv). Written after the venv's own install, so that pip there sees only the venv."""
    probe = "import json, sys, sysconfig; print(json.dumps([sysconfig.get_path('purelib'), sys.path]))"
    run = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60, check=True, env=_clean_env())
    site_packages, theirs = json.loads(run.stdout)
    has = {Path(p).resolve() for p in theirs if p}
    folders: list[Path] = []
    for entry in filter(None, sys.path):  # "" is the current folder, the child's own
        path = Path(entry).resolve()
        if path.is_dir() and path not in has and not path.is_relative_to(ROOT) and path not in folders:
            folders.append(path)
    (Path(site_packages) / "_ddpatch_tests_parent.pth").write_text("".join(f"{f}\n" for f in folders))


def test_a_venv_over_this_environment_imports_what_this_environment_does(tmp_path):
    """The built venv finds this run's dependencies where this run finds them (not the base interpreter's), and its
    own packages first."""
    python = _venv_over_this_environment(tmp_path / "venv")
    own = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, timeout=60, check=True).stdout.strip())
    (own / "rich").mkdir()
    (own / "rich" / "__init__.py").write_text("MARK = 'the venv'\n")
    _see_this_environment(python)
    names = ["rich", "click", "libcst", "transformers", "torch"]
    code = "import importlib.util as u, sys; print(*(getattr(u.find_spec(n), 'origin', 'missing:' + n) for n in sys.argv[1:]))"
    found = subprocess.run([str(python), "-c", code, *names], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           env=_clean_env())
    assert found.returncode == 0, found.stderr[-2000:]
    origins = found.stdout.split()
    assert origins[0] == str(own / "rich" / "__init__.py"), origins[0]
    for name, origin in zip(names[1:], origins[1:]):
        here = importlib.util.find_spec(name).origin
        assert Path(origin).resolve() == Path(here).resolve(), (name, origin, here)


@pytest.mark.heavy
def test_ddpatch_demo_runs_from_the_installed_wheel_in_any_folder(wheel, tmp_path):
    """The wheel in a venv (torch and the rest from the environment that runs the tests, whatever kind it is:
    ``.ci/wheel`` installs them afresh), ``ddpatch demo`` from a folder that is not the checkout: patched, verified,
    exit 0."""
    python = _venv_over_this_environment(tmp_path / "venv")
    venv = python.parent.parent
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                              "--force-reinstall", str(wheel)], capture_output=True, text=True, timeout=600, env=_clean_env())
    assert install.returncode == 0, install.stderr[-3000:]
    _see_this_environment(python)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import patcher; print(patcher.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True, timeout=60, env=_clean_env())
    assert where.stdout.strip().startswith(str(venv)), where.stdout + where.stderr
    demo = subprocess.run([str(venv / "bin" / "ddpatch"), "demo", "--out", "demo"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=900, env=_clean_env())
    assert demo.returncode == 0 and "PASS: every check passed" in demo.stdout, demo.stdout[-3000:] + demo.stderr[-3000:]
