"""Wall time of `ddpatch verify` on the tiny preset, end to end, and the before/after lossless table.

    python benchmarks/bench_verify.py                 # 3 runs of the default verify, median
    python benchmarks/bench_verify.py --repeats 5 --preset tiny-qwen3_5-vlm

It patches vendored/ddtree twice into a temporary folder: with the code-shape steps only
(what a hand `sed` gets you: it runs) and with the full recipe (rollback and tree verify
too), verifies both, and prints one row per method: identical runs and mean acceptance,
before and after, with the logits oracle's largest |logit difference|. Then it times the full verify, which is what the README quotes.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-qwen3_5")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
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
