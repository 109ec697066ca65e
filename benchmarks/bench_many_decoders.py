"""A research fork with 26 decoders, as issue 42 found one: the time a default verify takes to judge every one.

The fork is built by transforming ``vendored/dflash`` (our own upstream-shaped code): its ``dflash/model.py`` beside
25 copies, each a ``dflash_generate`` of its own (one line differs), in ``scheme/`` (11), ``analysis/`` (5) and
``alpha_1/`` .. ``alpha_9/`` (one each). As the user in the issue did, it runs ``ddpatch apply --exclude analysis``,
then ``ddpatch verify`` on what apply wrote, as apply's ``next:`` line says (no ``--exclude``: verify reads the one
apply recorded), and prints the decoders found and verified, the seconds and the peak memory of the run.

    python benchmarks/bench_many_decoders.py            # the default verify: tiny-qwen3_5 greedy and sampled, the trained pair
    python benchmarks/bench_many_decoders.py --json --greedy-only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = [("scheme", 11), ("analysis", 5)] + [(f"alpha_{i}", 1) for i in range(1, 10)]
ANCHOR = "def dflash_generate("


def build(out: Path) -> Path:
    """The fork: ``vendored/dflash`` and 25 copies of its decoder module, each with a line of its own."""
    shutil.copytree(ROOT / "vendored" / "dflash", out)
    model = (out / "dflash" / "model.py").read_text()
    assert model.count(ANCHOR) == 1
    n = 0
    for folder, count in FOLDERS:
        (out / folder).mkdir()
        for i in range(count):
            n += 1
            body = model.index(":\n", model.index("return_stats: bool = False", model.index(ANCHOR))) + 2
            text = model[:body] + f"    variant = {n}  # this copy's own line\n" + model[body:]
            (out / folder / f"v{i}.py").write_text(text)
    return out


def ddpatch(*args: str, timeout: float = 3600) -> tuple[subprocess.CompletedProcess, float, float]:
    """(the process, wall seconds, CPU seconds of it and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "patcher", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, time.perf_counter() - start, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    parser.add_argument("--greedy-only", action="store_true", help="Pass --greedy-only to verify.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddpatch-many-") as tmp:
        src = build(Path(tmp) / "fork")
        applied, apply_s, _ = ddpatch("apply", str(src), "--exclude", "analysis", "--out", str(Path(tmp) / "patched"))
        if applied.returncode:
            print(applied.stdout[-3000:], applied.stderr[-3000:], file=sys.stderr)
            return 1
        extra = ["--greedy-only"] if args.greedy_only else []
        proc, wall, cpu = ddpatch("verify", str(Path(tmp) / "patched"), "--format", "json", *extra)
        payload = json.loads(proc.stdout)
    row = next(c for c in payload["checks"] if c["check"] == "decoders")
    decoders = row["decoders"]
    figures = {
        "decoders_found": len(decoders), "decoders_verified": sum(1 for d in decoders if d.get("verified")),
        "left_out_by_exclude": len(row.get("excluded") or []), "verify_exit": proc.returncode, "verify_wall_s": round(wall, 1),
        "verify_cpu_s": round(cpu, 1), "apply_wall_s": round(apply_s, 1), "cores": os.cpu_count(),
        "failed_checks": sorted({c["check"] for c in payload["checks"] + [c for m in payload["models"] for c in m["checks"]]
                                 if not c["passed"]}),
    }
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        for key, value in figures.items():
            print(f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
