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

Nothing copied is written into the repository. Then it runs, ``--repeat`` times each (the
table shows medians), every command in its own process, each right after a run of the yardstick:

* ``ast.parse`` of every Python file of the tree (a ``python -c`` loop; it also prints its own
  parse time, without the interpreter's start);
* ``ddpatch check TREE``, ``ddpatch diff TREE``, ``ddpatch apply TREE --out OUT`` (a new OUT
  each run) and ``ddpatch apply TREE`` in place (on a fresh copy each run, copied outside the
  timer: atomic writes and the journal);
* ``ddpatch check TREE --include-vendored`` (every file checked: what leaving the vendored
  folders out saves).

It prints one row per command: wall s and CPU s (user + system, the workers included; the
figure to trust on a busy machine), peak MB of the process tree, exit code, and the ratio of
each run to the ``ast.parse`` run just before it (median over runs), for wall and for CPU
time. ``--json`` prints the same as one JSON object.

Usage: python benchmarks/bench_large_tree.py [--repeat 3] [--jobs N] [--copied 320] [--generated 120] [--json] [--keep DIR]
       [--commands check,diff,...]

The script times the checkout it lives in (``python -m patcher`` with that checkout first on
``PYTHONPATH``): a copy of it in an older checkout times that one on the same tree.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import tree_rss_kb  # noqa: E402  (the RSS of a process tree, from /proc)

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


def measure(cmd: list[str], out: Path) -> dict:
    """Wall s, CPU s (user + system of the process and the children it waited for: ddpatch's
    workers), peak MB of the process tree and exit code of one run; stdout goes to ``out``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out, "w") as stdout:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE, env=env, text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss_kb(proc.pid))
            time.sleep(0.02)
        wall = time.perf_counter() - start
        err = proc.stderr.read()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):  # 1: check and diff find changes
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "peak": peak / 1024, "code": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="Runs per command; the table shows the median.")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="ddpatch's --jobs.")
    parser.add_argument("--copied", type=int, default=320, help="Files copied from installed packages into vendored folders.")
    parser.add_argument("--generated", type=int, default=120, help="Generated toolkit modules (external/toolkit).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    parser.add_argument("--keep", type=Path, default=None, help="Build the tree here (new or empty) and keep it.")
    parser.add_argument("--commands", default=None,
                        help="Only these rows, comma-separated (check, diff, apply --out, apply in place, check --include-vendored); "
                             "ast.parse always runs. For a checkout that predates --include-vendored, leave that one out.")
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
        if args.commands:
            wanted = [c.strip() for c in args.commands.split(",") if c.strip()]
            unknown = sorted(set(wanted) - set(commands))
            if unknown:
                raise SystemExit(f"--commands: unknown {', '.join(unknown)}; known: {', '.join(commands)}")
            commands = {name: cmd for name, cmd in commands.items() if name in wanted}
        runs: dict[str, list[dict]] = {name: [] for name in commands}
        parses: list[dict] = []
        ratios: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for run in range(args.repeat):
            for name, cmd in commands.items():
                if name == "apply --out":
                    cmd = ddpatch("apply", str(tree), "--out", str(tmp / f"out{run}"), *jobs)
                elif name == "apply in place":
                    copy = tmp / f"inplace{run}"
                    shutil.copytree(tree, copy)
                    cmd = ddpatch("apply", str(copy), *jobs)
                # the yardstick right before each command: a ratio compares two runs seconds apart
                parse = measure([sys.executable, "-c", PARSE, str(tree)], tmp / "parse.out")
                parse["alone"] = float((tmp / "parse.out").read_text().split()[1])
                parses.append(parse)
                got = measure(cmd, tmp / "cmd.out")
                runs[name].append(got)
                ratios[name].append((got["wall"] / parse["wall"], got["cpu"] / parse["cpu"]))
                log(f"  {name:<26} {got['wall']:7.2f} s wall {got['cpu']:6.2f} s CPU  exit {got['code']}   "
                    f"(ast.parse just before: {parse['wall']:.2f} s wall, {parse['cpu']:.2f} s CPU)")
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # as measure() runs it
        report = json.loads(subprocess.run(ddpatch("check", str(tree), "--format", "json", *jobs), cwd=ROOT, env=env,
                                           capture_output=True, text=True).stdout)
        left_out = [v for v in report.get("vendored", []) if not v["checked"]]

    def row(name: str, got: list[dict], pairs: list[tuple[float, float]] | None) -> dict:
        return {"command": name, "runs": len(got), "wall_s": round(statistics.median(g["wall"] for g in got), 3),
                "cpu_s": round(statistics.median(g["cpu"] for g in got), 3), "peak_mb": round(max(g["peak"] for g in got)),
                "exit_code": got[-1]["code"],
                "wall_ratio": round(statistics.median(p[0] for p in pairs), 2) if pairs else 1.0,
                "cpu_ratio": round(statistics.median(p[1] for p in pairs), 2) if pairs else 1.0}

    rows = [row("ast.parse", parses, None)] + [row(name, runs[name], ratios[name]) for name in commands]
    result = {
        "tree": dict(info),
        "left_out": [{"path": v["path"], "reason": v["reason"], "files": v["files"]} for v in left_out],
        "ast_parse_alone_s": round(statistics.median(p["alone"] for p in parses), 3),
        "rows": rows,
        "machine": {"cpus": os.cpu_count(), "load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2),
                    "python": sys.version.split()[0], "libcst": version("libcst"), "jobs": args.jobs},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"\nload average {result['machine']['load_end']:.2f} at end; left out as vendored: "
          + ", ".join(f"{v['path']}/ ({v['reason']}, {v['files']} files)" for v in result["left_out"]))
    header = f"{'command':<26} {'runs':>4} {'wall s':>7} {'CPU s':>6} {'peak MB':>7} {'exit':>4} {'x ast.parse wall':>16} {'x ast.parse CPU':>15}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['command']:<26} {r['runs']:>4} {r['wall_s']:>7.2f} {r['cpu_s']:>6.2f} {r['peak_mb']:>7} {r['exit_code']:>4} "
              f"{r['wall_ratio']:>15.2f}x {r['cpu_ratio']:>14.2f}x")
    print(f"(ratios: the median over runs of each run against the ast.parse run just before it; ast.parse's own "
          f"parse time, without the interpreter's start: {result['ast_parse_alone_s']:.2f} s)")


if __name__ == "__main__":
    main()
