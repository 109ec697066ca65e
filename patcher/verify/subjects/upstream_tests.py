"""``ddpatch verify --upstream-tests``: the tree's own tests, before and after the patch.

A patch must keep upstream's own promises. Where the tree has tests (a ``tests/`` or ``test/``
folder, else ``test_*.py`` / ``*_test.py`` files outside ``_ddpatch_runtime``), they run with
pytest under ddpatch's own Python, once on the unpatched tree and once on the patched one, each
in a temporary copy (nothing is written into either tree), offline, on CPU, without bytecode or
pytest's cache, and each run twice: with the packages as installed, and without torch (torch,
transformers and accelerate made unimportable, as for an upstream that promises a torch-free
import for its serving clients). Per-test outcomes come from ``--junitxml``. A test that passed
before and does not pass after is a finding, blamed on the recipe steps that changed a file its
failure's traceback names, else a file the test imports, else every file the patch changed.

The parent runs this (no torch is imported here). What the recipe's steps changed comes from
the caller (``patcher.api``: ``check`` on the unpatched tree), as ``steps_of(before, after)``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..check import Check

CHECK = "upstream tests"
RUNTIME_DIR = "_ddpatch_runtime"
#: The environments each tree's tests run in: a name and the top-level packages made unimportable there.
ENVIRONMENTS = (("installed", ()), ("without torch", ("torch", "transformers", "accelerate")))
#: Folders never copied or searched for tests: version control, caches, virtual environments.
SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox", ".nox",
                       ".venv", "venv", "node_modules", ".eggs"})
#: Files larger than this are linked into the temporary copy, not copied (checkpoints, data).
BIG_FILE = 16 << 20
#: Broken tests named in the one-line evidence (all of them are in the row's ``environments``).
NAMED = 5

_BLOCKER = '''\
"""ddpatch verify --upstream-tests: {names} are not installed here (a sitecustomize, so subprocesses see it too)."""
import importlib.abc, importlib.machinery, os, sys
_BLOCKED = {names!r}

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:  # the environment's own sitecustomize still runs
    import importlib.util
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


@dataclass
class Unpatched:
    """The tree before the patch: ``root`` as it is (``--original``), or, with ``overlay``, ``root`` with these files put
    back to their original bytes (None: a file the apply created), as an in-place apply's journal holds them."""

    root: Path
    overlay: dict[str, bytes | None] | None = None
    label: str = ""


# ----------------------------------------------------------------------------- the trees
def _skipped_dir(name: str) -> bool:
    return name in SKIP_DIRS or name == RUNTIME_DIR or name.endswith(".egg-info")


def copy_tree(source: Path, dest: Path, overlay: dict[str, bytes | None] | None = None) -> Path:
    """``source`` copied to ``dest`` (big files linked), with ``overlay`` laid over it."""

    def ignore(folder, names):
        return [n for n in names if n in SKIP_DIRS or n.endswith(".pyc") or os.path.isfile(os.path.join(folder, n, "pyvenv.cfg"))]

    def copy(src, dst):
        if os.path.getsize(src) > BIG_FILE:
            os.symlink(os.path.abspath(src), dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(source, dest, symlinks=True, ignore=ignore, copy_function=copy)
    for rel, data in (overlay or {}).items():
        path = dest / rel
        if not path.parent.resolve().is_relative_to(dest.resolve()):
            raise ValueError(f"journal entry {rel!r} leaves the tree")
        if data is None:
            path.unlink(missing_ok=True)
            for folder in path.parents:  # a folder the apply created (the runtime's) goes with its files
                if folder == dest or not folder.is_dir() or any(folder.iterdir()):
                    break
                folder.rmdir()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # a linked big file must not be written through
            path.write_bytes(data)
    return dest


def _files(tree: Path):
    for folder, dirs, names in os.walk(tree):
        dirs[:] = sorted(d for d in dirs if not _skipped_dir(d))
        for name in sorted(names):
            yield Path(folder, name).relative_to(tree).as_posix()


def tests_in(tree: Path) -> list[str]:
    """What pytest is pointed at: the tests folder, else the test files (``_ddpatch_runtime`` never)."""
    for name in ("tests", "test"):
        if (tree / name).is_dir() and any(p.endswith(".py") for p in _files(tree / name)):
            return [name]
    return sorted(p for p in _files(tree) if re.fullmatch(r"(.*/)?(test_[^/]*|[^/]*_test)\.py", p))


def changed_files(before: Path, after: Path) -> list[str]:
    """The files (not the runtime folder) whose bytes differ between the two trees, or that only one has (a big file, which
    the recipe never rewrites, by its size)."""
    a, b = set(_files(before)), set(_files(after))

    def differs(rel: str) -> bool:
        x, y = before / rel, after / rel
        size = x.stat().st_size
        return size != y.stat().st_size or size <= BIG_FILE and x.read_bytes() != y.read_bytes()

    return [rel for rel in sorted(a | b) if rel not in a or rel not in b or differs(rel)]


# ----------------------------------------------------------------------------- running pytest
@dataclass
class Run:
    """One pytest run: test id -> (outcome, failure text); ``note`` when pytest did not finish or report."""

    results: dict[str, tuple[str, str]]
    note: str = ""


def pytest_env(tree: Path, blocked: tuple[str, ...], scratch: Path) -> dict:
    from ..plumbing.environ import child_env

    env = child_env()
    env.pop("PYTEST_ADDOPTS", None)
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1")
    paths = [str(tree)] + ([str(tree / "src")] if (tree / "src").is_dir() else [])
    if blocked:
        folder = scratch / "without"
        folder.mkdir(exist_ok=True)
        (folder / "sitecustomize.py").write_text(_BLOCKER.format(names=tuple(blocked)))
        paths.insert(0, str(folder))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_pytest(tree: Path, paths: list[str], blocked: tuple[str, ...], scratch: Path, timeout: float) -> Run:
    junit = scratch / f"junit-{tree.name}-{'-'.join(blocked) or 'installed'}.xml"
    junit.unlink(missing_ok=True)
    args = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
            "--continue-on-collection-errors", f"--junitxml={junit}", *paths]
    proc = subprocess.Popen(args, cwd=tree, env=pytest_env(tree, blocked, scratch), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return Run({}, f"pytest timed out after {timeout:.0f} s")
    if not junit.is_file():
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
        return Run({}, f"pytest did not run (exit {proc.returncode}: {last[:200]})")
    return Run(parse_junit(junit, tree))


_WORST = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def parse_junit(path: Path, tree: Path) -> dict[str, tuple[str, str]]:
    """pytest's junit XML (xunit1: each case names its file) as test id -> (outcome, failure text); a module that could
    not be collected is one id, its file, with outcome ``error``."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        file, name, cls = case.get("file") or "", case.get("name") or "", case.get("classname") or ""
        if not cls:  # a collection error: name is the module's dotted name
            test_id = file or name
        else:
            module = file[:-3].replace("/", ".") if file.endswith(".py") else ""
            inner = cls[len(module) + 1:] if module and cls.startswith(module + ".") else ""
            test_id = "::".join(p for p in (file or cls, inner, name) if p)
        outcome, text = "passed", ""
        for child in case:
            kind = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if kind and _WORST[kind] > _WORST[outcome]:
                outcome, text = kind, f"{child.get('message') or ''}\n{child.text or ''}".replace(str(tree) + os.sep, "")
        if test_id not in out or _WORST[outcome] > _WORST[out[test_id][0]]:
            out[test_id] = (outcome, text)
    return out


# ----------------------------------------------------------------------------- naming the step
def _module_files(tree: Path, module: str, near: Path) -> list[str]:
    rel = module.replace(".", "/")
    for base in (tree, tree / "src", near):
        for candidate in (base / f"{rel}.py", base / rel / "__init__.py"):
            if candidate.is_file():
                return [candidate.relative_to(tree).as_posix()]
    return []


def _statements(body: ast.AST, everywhere: bool):
    """The nodes of ``body``: all of them, or those that run on import (not inside a function)."""
    todo = [body]
    while todo:
        node = todo.pop()
        yield node
        if everywhere or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def imported_files(tree: Path, rel: str) -> set[str]:
    """The tree's files that ``rel`` imports (any import statement of it: tests import inside functions too), and those
    that importing them runs (the tree's modules' import statements outside functions), transitively."""
    seen: set[str] = set()
    todo = [rel]
    while todo:
        current = todo.pop()
        if current in seen or not current.endswith(".py"):
            continue
        seen.add(current)
        path = tree / current
        try:
            body = ast.parse(path.read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        package = Path(current).parent.as_posix().replace("/", ".")
        for node in _statements(body, everywhere=current == rel):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".") if package not in ("", ".") else []
                    parts = parts[:len(parts) - node.level + 1] if node.level > 1 else parts
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" if base else a.name for a in node.names]
            for name in names:
                for i in range(1, name.count(".") + 2):  # a package's __init__ runs before its modules
                    todo.extend(_module_files(tree, ".".join(name.split(".")[:i]), path.parent))
    seen.discard(rel)
    return seen


def blame(test_id: str, text: str, tree: Path, changed: list[str], steps_by_file: dict[str, list[str]]) -> dict:
    """The changed files (and their steps) a newly failing test points at: those its failure text names (a traceback
    path), else those the test module imports, else every changed file."""
    named = [f for f in changed if re.search(r"(?<![\w./-])" + re.escape(f) + r"(?![\w])", text)]
    found_by = "traceback"
    if not named:
        named, found_by = sorted(imported_files(tree, test_id.split("::")[0]) & set(changed)), "imports"
    if not named:
        named, found_by = list(changed), "every changed file"
    steps = list(dict.fromkeys(s for f in named for s in steps_by_file.get(f, [])))
    return {"files": named, "steps": steps, "found_by": found_by}


def _blame_text(b: dict, steps_by_file: dict[str, list[str]]) -> str:
    files = "; ".join(f"{f}: {', '.join(steps_by_file[f])}" if steps_by_file.get(f) else f"{f} (no recipe step names it)"
                      for f in b["files"]) or "nothing"
    how = {"traceback": "", "imports": ", which the test imports",
           "every changed file": "; neither its traceback nor its imports name a changed file"}[b["found_by"]]
    return f"(the patch changed {files}{how})"


# ----------------------------------------------------------------------------- the row
def compare(before: Run, after: Run, tree: Path, changed: list[str], steps_by_file: dict[str, list[str]]) -> dict:
    """One environment's verdict: each test that passed before and not after, with its blame; the rest counted."""
    both, broken, fixed, neither = [], [], [], []
    for test_id in sorted(set(before.results) | set(after.results)):
        was = before.results.get(test_id, ("absent", ""))[0]
        now, text = after.results.get(test_id, ("absent", ""))
        if was == "passed" and now == "passed":
            both.append(test_id)
        elif was == "passed":
            if now == "absent":  # not collected after: the module's collection error, or pytest's own note
                now, text = after.results.get(test_id.split("::")[0], ("absent", after.note))
            b = blame(test_id, text, tree, changed, steps_by_file)
            broken.append({"test": test_id, "before": was, "after": now, **b, "failure": text.strip().splitlines()[:1]})
        elif now == "passed" and was != "absent":
            fixed.append(test_id)
        elif was != "absent":
            neither.append(test_id)
    return {"passed_both": len(both), "broken": broken, "fixed": fixed, "fail_or_skip_both": neither,
            "note_before": before.note, "note_after": after.note}


def _env_text(name: str, verdict: dict, steps_by_file: dict[str, list[str]]) -> str:
    parts = [f"{verdict['passed_both']} passed before and after"]
    broken = verdict["broken"]
    if broken:
        shown = ", ".join(f"{b['test']} {_blame_text(b, steps_by_file)}" for b in broken[:NAMED])
        more = f", and {len(broken) - NAMED} more" if len(broken) > NAMED else ""
        parts.append(f"{len(broken)} passed before and {'fails' if len(broken) == 1 else 'fail'} after: {shown}{more}")
    if verdict["fixed"]:
        parts.append(f"{len(verdict['fixed'])} failed before and pass after")
    if verdict["fail_or_skip_both"]:
        parts.append(f"{len(verdict['fail_or_skip_both'])} fail or skip in both (not judged)")
    for when in ("before", "after"):
        if verdict[f"note_{when}"]:
            parts.append(f"{when} the patch: {verdict[f'note_{when}']}")
    return f"{name}: " + ", ".join(parts)


def upstream_tests_row(patched: Path, unpatched: Unpatched, steps_of: Callable[[Path, Path], dict[str, list[str]]],
                       timeout: float, progress=None) -> dict:
    """The ``upstream tests`` row of a verify report for ``patched`` against ``unpatched``."""
    start = time.perf_counter()
    row = Check.of(CHECK, passed=True, original=unpatched.label or str(unpatched.root)).to_json()
    if importlib.util.find_spec("pytest") is None:
        return {**row, "info": True, "evidence": f"not run: pytest is not installed for {sys.executable} (pip install pytest)"}
    with tempfile.TemporaryDirectory(prefix="ddpatch-upstream-tests-") as scratch:
        scratch = Path(scratch)
        before = copy_tree(unpatched.root, scratch / "before", unpatched.overlay)
        after = copy_tree(patched, scratch / "after")
        paths = tests_in(before) or tests_in(after)
        if not paths:
            return {**row, "info": True, "evidence": "no tests found (a tests/ or test/ folder, or test_*.py / *_test.py files)"}
        changed = changed_files(before, after)
        steps_by_file = steps_of(before, after)
        environments, texts = [], []
        # before and after side by side where there is a second core (each run mostly waits on its imports)
        with ThreadPoolExecutor(max_workers=2 if (os.cpu_count() or 1) > 1 else 1) as pool:
            for i, (name, blocked) in enumerate(ENVIRONMENTS):
                if progress is not None:
                    progress({"event": "progress", "done": i, "total": len(ENVIRONMENTS), "label": f"upstream tests, {name}"})
                runs = list(pool.map(lambda tree, blocked=blocked: run_pytest(tree, paths, blocked, scratch, timeout), (before, after)))
                verdict = compare(*runs, after, changed, steps_by_file)
                environments.append({"name": name, "blocked": list(blocked), **verdict})
                texts.append(_env_text(name, verdict, steps_by_file))
    broken = any(e["broken"] for e in environments)
    judged = any(e["passed_both"] or e["broken"] for e in environments)
    return {**row, "passed": not broken, **({} if judged else {"info": True}), "evidence": "; ".join(texts), "paths": paths,
            "changed_files": changed, "steps_by_file": steps_by_file, "environments": environments,
            "seconds": round(time.perf_counter() - start, 2)}
