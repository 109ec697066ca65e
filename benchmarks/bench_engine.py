"""Wall time and peak memory of `ddpatch diff` against LibCST's own CLI running the same steps.

Not a test: for each tree it runs, in the same process and one after the other,

* ``ddpatch diff --recipe qwen3_6-gdn TREE -j JOBS``, and
* ``python -m libcst.tool codemod -x patcher.engine.codemods.libcst_recipe.QwenRecipe --no-format -u 3 -j JOBS TREE``:
  every step of the recipe as a LibCST codemod, in recipe order, the way LibCST's tool runs
  codemods (no prefilter; each step copies the tree, computes its metadata, traverses).

Both print diffs and write nothing. Trees: the installed transformers package and vendored/.
It prints one table: tool, tree, files, runs, wall s (median), peak MB, ratio (LibCST wall /
ddpatch wall). Peak MB is the largest sum of RSS over the command's process tree, sampled
every 50 ms from /proc (so it counts the worker processes of both tools).

Usage: python benchmarks/bench_engine.py [--jobs 2] [--repeat N] [--limit N] [--trees transformers,vendored]

``--limit N`` runs both tools on the same N files of each tree, spread evenly over the sorted
file list and copied with their folders into a temporary tree ("sample" in the table), and
ddpatch alone on the whole tree ("all"); the LibCST time of the whole tree is then printed
as an extrapolation by lines, marked as such. The LibCST side on the whole transformers
package takes hours on two cores. ``--repeat`` defaults to 3 runs for a tree of at most 50
files and 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "qwen3_6-gdn"
COMMAND = "patcher.engine.codemods.libcst_recipe.QwenRecipe"


def tree_rss_kb(pid: int) -> int:
    """RSS of ``pid`` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next((int(line.split()[1]) for line in fh if line.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return total


def measure(cmd: list[str], cwd: Path, out: Path) -> tuple[float, float, int]:
    """(wall seconds, peak MB of the process tree, exit code) of one run; stdout goes to ``out``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(out, "w") as stdout:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, env=env, text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss_kb(proc.pid))
            time.sleep(0.05)
        wall = time.perf_counter() - start
        err = proc.stderr.read()
    if proc.returncode not in (0, 1, 2):  # ddpatch: 1 changes, 2 a step is no-match here
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    return wall, peak / 1024, proc.returncode


def python_files(tree: Path) -> list[Path]:
    return sorted(p for p in tree.rglob("*.py") if "__pycache__" not in p.parts)


def sample(tree: Path, limit: int, dest: Path) -> Path:
    """``limit`` files of ``tree``, spread evenly, copied with their relative paths under ``dest``."""
    files = python_files(tree)
    step = max(1, len(files) / limit)
    chosen = [files[int(i * step)] for i in range(min(limit, len(files)))]
    for path in chosen:
        target = dest / path.relative_to(tree)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return dest


def changed_files(diff: Path, prefix: str) -> set[str]:
    names = set()
    for line in diff.read_text(errors="replace").splitlines():
        if line.startswith("+++ ") and not line.startswith("+++ /dev/null"):
            name = line[4:].split("\t")[0].strip()
            name = name[2:] if name.startswith("b/") else name
            names.add(name[len(prefix):].lstrip("/") if name.startswith(prefix) else name)
    return {n for n in names if not n.endswith("_ddpatch_runtime.py")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=None, help="Runs per tool and tree; the table shows the median.")
    parser.add_argument("--limit", type=int, default=None, help="Run both tools on this many files of each tree.")
    parser.add_argument("--trees", default="transformers,vendored")
    parser.add_argument("--skip-libcst", action="store_true", help="Only time ddpatch.")
    args = parser.parse_args()

    from importlib.metadata import version

    import transformers

    trees = {"transformers": Path(transformers.__file__).parent, "vendored": ROOT / "vendored"}
    print(f"python {sys.version.split()[0]}, libcst {version('libcst')}, "
          f"transformers {transformers.__version__}, {os.cpu_count()} CPUs, jobs {args.jobs}, "
          f"load average {os.getloadavg()[0]:.2f} at start", flush=True)
    rows = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ddpatch-bench-") as tmp:
        for name in args.trees.split(","):
            tree = trees[name]
            label = name
            if args.limit and args.limit < len(python_files(tree)):
                tree = sample(tree, args.limit, Path(tmp) / name)
                label = f"{name} (sample)"
            files = python_files(tree)
            lines = sum(p.read_bytes().count(b"\n") for p in files)
            tools = {
                "ddpatch diff": [sys.executable, "-P", "-m", "patcher", "diff", "--recipe", RECIPE, str(tree), "-j", str(args.jobs)],
                "libcst.tool codemod": [sys.executable, "-P", "-m", "libcst.tool", "codemod", "-x", COMMAND, "--no-format", "-u", "3",
                                        "-j", str(args.jobs), "--hide-progress", "--include-generated", str(tree)],
            }
            if args.skip_libcst:
                del tools["libcst.tool codemod"]
            runs = args.repeat or (3 if len(files) <= 50 else 1)
            walls: dict[str, list[float]] = {t: [] for t in tools}
            peaks: dict[str, float] = {t: 0.0 for t in tools}
            diffs = {t: Path(tmp) / f"{name}-{i}.diff" for i, t in enumerate(tools)}
            for _ in range(runs):
                for tool, cmd in tools.items():  # interleaved, so that machine noise hits both alike
                    wall, peak, _code = measure(cmd, tree, diffs[tool])
                    walls[tool].append(wall)
                    peaks[tool] = max(peaks[tool], peak)
                    print(f"  {tool:<20} {label:<22} {wall:8.1f} s {peak:8.0f} MB", flush=True)
            base = statistics.median(walls["ddpatch diff"])
            for tool in tools:
                wall = statistics.median(walls[tool])
                rows.append((tool, label, len(files), lines, runs, wall, peaks[tool], f"{wall / base:.1f}x"))
            if len(tools) == 2:
                ours, theirs = (changed_files(diffs[t], str(tree)) for t in tools)
                same = "same" if ours == theirs else f"differ: ddpatch only {sorted(ours - theirs)}, libcst only {sorted(theirs - ours)}"
                print(f"  files changed: ddpatch {len(ours)}, libcst {len(theirs)} ({same})", flush=True)
            if args.limit and trees[name] != tree:
                whole = python_files(trees[name])
                whole_lines = sum(p.read_bytes().count(b"\n") for p in whole)
                cmd = tools["ddpatch diff"][:-3] + [str(trees[name]), "-j", str(args.jobs)]
                wall, peak, _code = measure(cmd, trees[name], Path(tmp) / f"{name}-all.diff")
                print(f"  {'ddpatch diff':<20} {name + ' (all)':<22} {wall:8.1f} s {peak:8.0f} MB", flush=True)
                rows.append(("ddpatch diff", f"{name} (all)", len(whole), whole_lines, 1, wall, peak, "-"))
                if "libcst.tool codemod" in tools:
                    guess = statistics.median(walls["libcst.tool codemod"]) * whole_lines / max(lines, 1)
                    notes.append(f"{name}: LibCST on all {len(whole)} files, extrapolated by lines from the sample "
                                 f"(not measured): ~{guess:.0f} s, ~{guess / wall:.0f}x ddpatch's measured {wall:.1f} s")

    print(f"\nload average {os.getloadavg()[0]:.2f} at end")
    header = f"{'tool':<20} {'tree':<22} {'files':>6} {'lines':>9} {'runs':>4} {'wall s':>8} {'peak MB':>8} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for tool, label, n, lines, runs, wall, peak, ratio in rows:
        print(f"{tool:<20} {label:<22} {n:>6} {lines:>9} {runs:>4} {wall:>8.1f} {peak:>8.0f} {ratio:>6}")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
