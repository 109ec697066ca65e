"""Wall time of `ddpatch verify` on the tiny preset, end to end, and the before/after lossless table.

    python benchmarks/bench_verify.py                 # 3 runs of the default verify, median
    python benchmarks/bench_verify.py --repeats 5 --preset tiny-qwen3_5-vlm
    python benchmarks/bench_verify.py --warm          # a fresh child per verify against one forked from a warm verifier

It patches vendored/ddtree twice into a temporary folder: with the code-shape steps only
(what a hand `sed` gets you: it runs) and with the full recipe (rollback and tree verify
too), verifies both, and prints one row per method: identical runs and mean acceptance,
before and after, with the logits oracle's largest |logit difference|. Then it times the full verify, which is what the README quotes.

``--warm`` times ``run_verify`` on the full-recipe tree instead, in this process: a fresh
child per verify (what one ``ddpatch verify`` does) against children forked from one warm
verifier (what ``ddpatch ci --verify`` and the test suite do; ``patcher/verify/child/warm.py``).
The first forked verify, which waits for the warm process's own imports, is shown apart.
It also checks that the two give the same result, timings aside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE_ONLY = "verify-forward,tree-commit"


def ddpatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "patcher.cli", *args], capture_output=True, text=True, cwd=ROOT)


def patch(dest: Path, ignore: str | None) -> Path:
    args = ["apply", str(ROOT / "vendored" / "ddtree"), "--recipe", "qwen3_6-gdn", "--out", str(dest)]
    proc = ddpatch(*args, *(["--ignore", ignore, "--allow-lossy"] if ignore else []))  # the code-shape-only control is lossy on purpose
    if proc.returncode != 0:
        sys.exit(proc.stderr)
    return dest


def verify(tree: Path, preset: str) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = ddpatch("verify", str(tree), "--preset", preset, "--format", "json")
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        sys.exit(proc.stderr)
    return elapsed, json.loads(proc.stdout)


def warm_against_fresh(preset: str, repeats: int) -> None:
    sys.path.insert(0, str(ROOT))
    from patcher.verify.process import runner

    def timed(tree: Path) -> tuple[float, dict]:
        start = time.perf_counter()
        outcome = runner.run_verify(tree, presets=[preset])
        return time.perf_counter() - start, runner.without_timings(outcome.result)

    with tempfile.TemporaryDirectory() as tmp:
        tree = patch(Path(tmp) / "full", None)
        fresh = [timed(tree) for _ in range(repeats)]
        with runner.warm_verifier():
            first = timed(tree)
            forked = [timed(tree) for _ in range(repeats)]
    same = all(r == fresh[0][1] for _, r in [*fresh, first, *forked])
    f, w = statistics.median(t for t, _ in fresh), statistics.median(t for t, _ in forked)
    print(f"run_verify {preset}, vendored/ddtree with the full recipe, {repeats} runs each (wall):")
    print(f"  fresh child   median {f:.1f} s (min {min(t for t, _ in fresh):.1f}, max {max(t for t, _ in fresh):.1f})")
    print(f"  forked child  median {w:.1f} s (min {min(t for t, _ in forked):.1f}, max {max(t for t, _ in forked):.1f}); "
          f"the first, while the warm verifier imports: {first[0]:.1f} s")
    print(f"  ratio {f / w:.2f}x; results equal, timings aside: {same}; {runner.warm_stats}")
    if not same:
        sys.exit("a forked verify's result differs from a fresh one's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-qwen3_5")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="Time fresh verify children against forked ones.")
    args = parser.parse_args()
    if args.warm:
        return warm_against_fresh(args.preset, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        before = patch(Path(tmp) / "shape-only", SHAPE_ONLY)
        after = patch(Path(tmp) / "full", None)
        _, shape = verify(before, args.preset)
        times = []
        for _ in range(args.repeats):
            seconds, full = verify(after, args.preset)
            times.append(seconds)
    env = full["environment"]
    print(f"transformers {env['transformers']}, torch {env['torch']}, preset {args.preset}")
    print(f"\n{'method':<14} {'code-shape only':>44} {'full recipe':>44}")
    rows_before = {m["method"]: m for m in shape["models"][0]["methods"]}
    for m in full["models"][0]["methods"]:
        b = rows_before[m["method"]]

        def cell(x):
            return (f"{x['identical_runs']}/{len(x['runs'])} identical, acc {x.get('acceptance_mean', 0):.2f}, "
                    f"max |dlogit| {x.get('max_dlogit', float('nan')):.1e}")

        print(f"{m['method']:<14} {cell(b):>44} {cell(m):>44}")
    print(f"\nddpatch verify {args.preset} (subprocess, wall): median {statistics.median(times):.1f} s over {len(times)} runs "
          f"(min {min(times):.1f}, max {max(times):.1f})")


if __name__ == "__main__":
    main()
