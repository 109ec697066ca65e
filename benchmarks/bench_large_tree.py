"""`check`, `apply` and `diff` on a large fork that vendors third-party packages, against `ast.parse`.

Not a test. It builds, in a temporary folder, a tree shaped like a DDTree fork that vendors
other projects (issue 39: a 331-file fork took 193 s to check):

* a copy of ``vendored/ddtree`` at the root (our own upstream-shaped decoder);
* copies of installed packages (by default rich, click, hypothesis and libcst, as many of their
  files as ``--copied`` allows), each in one kind of vendored folder: ``third_party/rich``
  (named), ``vendor/click`` (named), ``libs/hypothesis`` with its own ``pyproject.toml`` (a
  project of its own), ``deps/libcst`` next to a ``libcst-X.dist-info`` (an install target);
* ``--generated`` modules of our own, seeded, shaped like a third-party image/text toolkit
  (``external/toolkit``), whose words (``crop``, ``hidden_states``, ``datasets``,
  ``synchronize(``) pass the text prefilter, as real packages' do.

Nothing copied is written into the repository. Then it runs, one after the other and
``--repeat`` times each (the table shows medians), every command in its own process:

* ``ast.parse`` of every Python file of the tree (a ``python -c`` loop: its own parse time,
  and the process's wall time, the yardstick);
* ``ddpatch check TREE``, ``ddpatch diff TREE``, ``ddpatch apply TREE --out OUT`` (a new OUT
  each run) and ``ddpatch apply TREE`` in place (on a fresh copy each run, copied outside the
  timer: atomic writes and the journal);
* ``ddpatch check TREE --include-vendored`` (every file checked: what leaving the vendored
  folders out saves).

It prints one row per command: wall s (median), peak MB of the process tree, exit code, and
the ratio to the ``ast.parse`` process; ``--json`` prints the same as one JSON object.

Usage: python benchmarks/bench_large_tree.py [--repeat 3] [--jobs N] [--copied 320] [--generated 120] [--json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import measure  # noqa: E402  (wall and peak memory of one run, from /proc)

ROOT = Path(__file__).resolve().parents[1]
#: installed package -> the vendored folder it is copied into, and how that folder says "vendored"
PACKAGES = {
    "rich": "third_party/rich",
    "click": "vendor/click",
    "hypothesis": "libs/hypothesis/hypothesis",  # libs/hypothesis/pyproject.toml
    "libcst": "deps/libcst",  # deps/libcst-X.dist-info
}
PARSE = r"""
import ast, pathlib, sys, time, warnings
warnings.simplefilter("ignore")
files = sorted(p for p in pathlib.Path(sys.argv[1]).rglob("*.py"))
start = time.perf_counter()
for p in files:
    try:
        ast.parse(p.read_bytes())
    except (SyntaxError, ValueError):
        pass
print(len(files), time.perf_counter() - start)
"""


# ----------------------------------------------------------------------------- the tree
def _module(rng: random.Random, name: str) -> str:
    """One module of a made-up toolkit: classes and functions with loops, some using words the steps' text prefilter looks for."""
    words = ["crop", "hidden_states", "resize", "pad", "normalize", "batch", "tokens", "synchronize()", "datasets", "scale"]
    lines = [f'"""{name}: part of a generated toolkit (ddpatch benchmark tree)."""', "", "from __future__ import annotations", "",
             "import math", "from typing import Any", ""]
    if rng.random() < 0.2:
        lines += ["try:", "    import datasets  # optional", "except ImportError:", "    datasets = None", ""]
    for c in range(rng.randint(2, 5)):
        cls = f"{name.title().replace('_', '')}{c}"
        lines += ["", f"class {cls}:", f'    """A {rng.choice(words)} helper."""', "",
                  "    def __init__(self, size: int = 8, **options: Any) -> None:", "        self.size = size",
                  "        self.options = dict(options)", "        self.hidden_states = []", ""]
        for m in range(rng.randint(3, 8)):
            word = rng.choice(words).rstrip("()")
            lines += [f"    def {word}_{m}(self, values: list[float], limit: int = {rng.randint(1, 64)}) -> list[float]:",
                      "        out = []", "        for i, v in enumerate(values[:limit]):",
                      f"            if v > {rng.random():.3f} * self.size:", f"                out.append(math.sqrt(abs(v)) + {m})",
                      "            else:", "                out.append(v * i)"]
            if word == "crop":
                lines += ["        return self.crop_box(out, 0, len(out) - 1)", ""]
            else:
                lines += ["        return out", ""]
        lines += ["    def crop_box(self, values, start, stop):", "        return values[start:stop]", ""]
    for f in range(rng.randint(3, 10)):
        lines += ["", f"def helper_{f}(x: float, y: float = {rng.random():.2f}) -> float:",
                  f'    """{rng.choice(words)} of x and y."""', "    total = 0.0", f"    for k in range({rng.randint(2, 20)}):",
                  "        total += (x * k - y) / (k + 1)", "    return total"]
    return "\n".join(lines) + "\n"


def build_tree(dest: Path, copied: int = 320, generated: int = 120, seed: int = 0) -> dict:
    """The benchmark's tree under ``dest`` (new); returns what it holds."""
    shutil.copytree(ROOT / "vendored" / "ddtree", dest, ignore=shutil.ignore_patterns("__pycache__"))
    info = {"decoder_files": len(list(dest.rglob("*.py"))), "copied": {}, "generated": generated}
    left = copied
    for package, folder in PACKAGES.items():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations or left <= 0:
            continue
        src = Path(spec.submodule_search_locations[0])
        files = sorted(p for p in src.rglob("*.py") if "__pycache__" not in p.parts)[:max(0, left // (len(PACKAGES) - len(info["copied"])))]
        for path in files:
            target = dest / folder / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        left -= len(files)
        info["copied"][package] = len(files)
    if (dest / "libs" / "hypothesis").is_dir():
        (dest / "libs" / "hypothesis" / "pyproject.toml").write_text('[project]\nname = "hypothesis"\n')
    if (dest / "deps" / "libcst").is_dir():
        (dest / "deps" / "libcst-1.0.dist-info").mkdir()
        (dest / "deps" / "libcst-1.0.dist-info" / "METADATA").write_text("Name: libcst\n")
    rng = random.Random(seed)
    toolkit = dest / "external" / "toolkit"
    for i in range(generated):
        sub = toolkit / f"part{i % 6}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / "__init__.py").touch()
        (sub / f"mod{i}.py").write_text(_module(rng, f"mod{i}"))
    info["files"] = len(list(dest.rglob("*.py")))
    info["lines"] = sum(p.read_bytes().count(b"\n") for p in dest.rglob("*.py"))
    return info


# ----------------------------------------------------------------------------- the runs
def ddpatch(*args: str) -> list[str]:
    return [sys.executable, "-P", "-m", "patcher", *args]


def parse_run(tree: Path, out: Path) -> tuple[float, float, float]:
    """(wall s of the process, its own parse s, peak MB) of ``ast.parse`` over every file of ``tree``."""
    wall, peak, _code = measure([sys.executable, "-c", PARSE, str(tree)], ROOT, out)
    return wall, float(out.read_text().split()[1]), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="Runs per command; the table shows the median.")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="ddpatch's --jobs.")
    parser.add_argument("--copied", type=int, default=320, help="Files copied from installed packages into vendored folders.")
    parser.add_argument("--generated", type=int, default=120, help="Generated toolkit modules (external/toolkit).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    parser.add_argument("--keep", type=Path, default=None, help="Build the tree here (new or empty) and keep it.")
    args = parser.parse_args()
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))

    from importlib.metadata import version

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ddpatch-large-") as tmp:
        tmp = Path(tmp)
        tree = args.keep.resolve() if args.keep else tmp / "fork"
        if tree.exists() and any(tree.iterdir()):
            raise SystemExit(f"--keep {tree}: not empty")
        if tree.exists():
            tree.rmdir()
        info = build_tree(tree, args.copied, args.generated)
        log(f"tree: {info['files']} Python files, {info['lines']} lines ({info['decoder_files']} of vendored/ddtree, "
            f"copied {info['copied']}, {info['generated']} generated); python {sys.version.split()[0]}, libcst {version('libcst')}, "
            f"{os.cpu_count()} CPUs, jobs {args.jobs}, load average {load_start:.2f} at start")
        jobs = ["-j", str(args.jobs)]
        commands = {
            "check": ddpatch("check", str(tree), *jobs),
            "diff": ddpatch("diff", str(tree), *jobs),
            "apply --out": None,  # a new OUT each run
            "apply in place": None,  # a fresh copy each run
            "check --include-vendored": ddpatch("check", str(tree), "--include-vendored", *jobs),
        }
        walls: dict[str, list[float]] = {"ast.parse": [], **{name: [] for name in commands}}
        peaks: dict[str, float] = {name: 0.0 for name in walls}
        codes: dict[str, int] = {}
        parse_own: list[float] = []
        for run in range(args.repeat):
            wall, own, peak = parse_run(tree, tmp / "parse.out")
            walls["ast.parse"].append(wall)
            parse_own.append(own)
            peaks["ast.parse"] = max(peaks["ast.parse"], peak)
            log(f"  {'ast.parse':<26} {wall:7.2f} s (parsing alone {own:.2f} s)")
            for name, cmd in commands.items():
                if name == "apply --out":
                    cmd = ddpatch("apply", str(tree), "--out", str(tmp / f"out{run}"), *jobs)
                elif name == "apply in place":
                    copy = tmp / f"inplace{run}"
                    shutil.copytree(tree, copy)
                    cmd = ddpatch("apply", str(copy), *jobs)
                wall, peak, code = measure(cmd, ROOT, tmp / "cmd.out")
                walls[name].append(wall)
                peaks[name] = max(peaks[name], peak)
                codes[name] = code
                log(f"  {name:<26} {wall:7.2f} s  exit {code}")
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # as measure() runs it
        report = json.loads(subprocess.run(ddpatch("check", str(tree), "--format", "json", *jobs), cwd=ROOT, env=env,
                                           capture_output=True, text=True).stdout)
        left_out = [v for v in report.get("vendored", []) if not v["checked"]]

    base = statistics.median(walls["ast.parse"])
    rows = [{"command": name, "wall_s": round(statistics.median(w), 3), "runs": len(w), "peak_mb": round(peaks[name]),
             "exit_code": codes.get(name, 0), "ratio_to_ast_parse": round(statistics.median(w) / base, 2)} for name, w in walls.items()]
    result = {
        "tree": {k: v for k, v in info.items()},
        "left_out": [{"path": v["path"], "reason": v["reason"], "files": v["files"]} for v in left_out],
        "ast_parse_alone_s": round(statistics.median(parse_own), 3),
        "rows": rows,
        "machine": {"cpus": os.cpu_count(), "load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2),
                    "python": sys.version.split()[0], "libcst": version("libcst"), "jobs": args.jobs},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"\nload average {result['machine']['load_end']:.2f} at end; left out as vendored: "
          + ", ".join(f"{v['path']}/ ({v['reason']}, {v['files']} files)" for v in result["left_out"]))
    header = f"{'command':<26} {'wall s':>8} {'runs':>4} {'peak MB':>8} {'exit':>4} {'x ast.parse':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['command']:<26} {r['wall_s']:>8.2f} {r['runs']:>4} {r['peak_mb']:>8} {r['exit_code']:>4} {r['ratio_to_ast_parse']:>10.2f}x")
    print(f"(ast.parse's own parse time, without the interpreter's start: {result['ast_parse_alone_s']:.2f} s)")


if __name__ == "__main__":
    main()
