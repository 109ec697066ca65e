"""A mutation check: small hand-written bugs in the code the tests must guard, and whether they notice.

Each mutant is one textual change to one file (a write path that is not atomic, a status
that is classified the wrong way, a crop that misreads its argument...). For each, the
script copies the checkout to a temporary folder, applies the change there (the checkout
itself is never modified), runs the tests that guard that code, and reports the mutant
**killed** (a test failed) or **survived** (every test passed: a hole in the tests, or
a change that cannot be seen, which the table's note then explains).

    python benchmarks/mutants.py                      # every group
    python benchmarks/mutants.py --group write --group classify
    python benchmarks/mutants.py --list               # the mutants, without running them
    python benchmarks/mutants.py --only W1,C3 -v      # some mutants, with the failing test's name

Before the mutants of a group, its tests run once on the unmodified copy: a group whose
tests fail there is reported as such and not scored. A mutant whose text is no longer in
its file (the code moved on) is reported ``stale`` and not scored either.
Exit status: 0 when every scored mutant was killed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    id: str
    group: str
    #: a file, or a module path without ``.py`` (``patcher/runtime``): then the snippet is looked
    #: up in ``patcher/runtime.py`` and in every ``patcher/runtime/*.py``, so a module that became
    #: a package (or the reverse) keeps its mutants
    path: str
    old: str
    new: str
    what: str
    #: why a survivor is acceptable (a change no test can observe); empty: it must be killed
    equivalent: str = ""


#: The tests that guard each group (pytest node ids, relative to the checkout).
GROUP_TESTS = {
    "write": [
        "tests/test_write_safety.py",
        "tests/test_errors.py::test_read_only_file_blocks_the_apply_and_its_sites_say_skipped",
        "tests/test_errors.py::test_revert_force_restores_the_original_contents",
        "tests/test_errors.py::test_a_stale_runtime_copy_is_refreshed",
        "tests/test_cli.py::test_revert_refuses_to_clobber_later_edits",
        "tests/test_cli.py::test_in_place_apply_is_idempotent_and_revert_restores_bytes",
    ],
    "classify": [
        "tests/test_statuses.py",
        "tests/test_errors.py::test_check_labels_sites_pending_and_apply_labels_them_applied",
        "tests/test_errors.py::test_a_blocked_apply_reports_its_sites_pending",
        "tests/test_errors.py::test_read_only_file_blocks_the_apply_and_its_sites_say_skipped",
        "tests/test_errors.py::test_a_tree_without_recipe_code_says_so_in_one_line",
        "tests/test_cli.py::test_unparseable_file_is_reported_as_the_cause_and_skipped",
        "tests/test_cli.py::test_no_match_blocks_writes_and_exits_2",
        "tests/test_cli.py::test_check_then_apply_out_then_reapply",
    ],
    "crop": [
        "tests/test_cache_commit.py::test_crop_cache_meaning",
    ],
    "guards": [
        "tests/test_guards.py",
        "tests/test_cache_commit.py",
    ],
    "reading": [
        "tests/test_codemods.py",
        "tests/test_dataflow.py",
        "tests/test_drift.py",
    ],
}

#: ``-k`` expressions that narrow a group's files to the tests about its code
GROUP_SELECT = {
    "reading": "crop and not decodes and not claims and not exit_0 and not masks",
}

RUNTIME = "patcher/runtime"  # a module or a package: see Mutant.path
CROP_CODEMOD = "patcher/engine/codemods/crop.py"


ATOMIC_BODY = '''    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    if path.exists():
        mode = path.stat().st_mode & 0o7777
    elif mode is None:
        mode = new_file_mode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".ddpatch-tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
'''

MUTANTS = [
    # ------------------------------------------------------------------ the write path
    Mutant("W1", "write", "patcher/engine/files.py", ATOMIC_BODY,
           '''    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.unlink(missing_ok=True)
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])
        handle.write(data[len(data) // 2:])
''', "not atomic: writes the file in place in two halves, and drops its mode"),
    Mutant("W2", "write", "patcher/engine/files.py", ATOMIC_BODY,
           '''    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(path, "wb") as handle:
        handle.write(data)
''', "not atomic: truncates and writes the file in place (mode kept)"),
    Mutant("W3", "write", "patcher/engine/files.py",
           "    if path.exists():\n        mode = path.stat().st_mode & 0o7777\n    elif mode is None:\n",
           "    if mode is None:\n", "an existing file's mode is not kept"),
    Mutant("W4", "write", "patcher/engine/files.py", "    return 0o666 & ~mask\n", "    return 0o600\n",
           "new files get mkstemp's 0600"),
    Mutant("W5", "write", "patcher/engine/files.py", "        os.chmod(tmp, mode)\n", "",
           "no chmod at all: every written file ends 0600"),
    Mutant("W6", "write", "patcher/engine/files.py", "        Path(tmp).unlink(missing_ok=True)\n        raise\n", "        raise\n",
           "a failed write leaves its temp file in the tree"),
    Mutant("W7", "write", "patcher/engine/files.py", "            handle.flush()\n            os.fsync(handle.fileno())\n        os.chmod(tmp, mode)\n",
           "            handle.flush()\n        os.chmod(tmp, mode)\n",
           "no fsync before the rename",
           equivalent="durability across a power cut: no test can cut the power; the data and the rename are the same"),
    Mutant("W8", "write", "patcher/results.py", "        return (self.patched or \"\").encode(self.encoding)\n",
           "        return (self.patched or \"\").encode(\"utf-8\")\n", "patched text always written as UTF-8 (cookie ignored)"),
    Mutant("W9", "write", "patcher/engine/files.py", "    line = provenance_line(recipe, steps) + newline_of(text)\n",
           "    line = provenance_line(recipe, steps) + \"\\n\"\n", "the provenance line always ends in LF"),
    Mutant("W10", "write", "patcher/engine/files.py", "        return data.decode(encoding), encoding\n",
           "        return data.decode(encoding), \"utf-8\" if encoding == \"utf-8-sig\" else encoding\n",
           "a UTF-8 BOM is dropped on write"),
    Mutant("W11", "write", "patcher/engine/write.py", "        reason = unwritable(base / f.path)\n", "        reason = None\n",
           "read-only files are not refused"),
    Mutant("W12", "write", "patcher/api.py", "    blocked = bool(report.no_match or report.skipped) and not allow_partial",
           "    blocked = bool(report.no_match) and not allow_partial", "a skipped file does not stop the write"),
    Mutant("W13", "write", "patcher/engine/journal.py", "        if current is not None and _sha(current) != entry[\"patched_sha256\"]:\n",
           "        if False:\n", "revert overwrites files edited since the apply"),
    Mutant("W14", "write", "patcher/engine/journal.py", "        atomic_write(path, original)\n", "        atomic_write(path, original.decode(\"utf-8\", \"replace\"))\n",
           "revert restores text, not the original bytes"),
    Mutant("W15", "write", "patcher/engine/write.py",
           "    wanted = {PurePosixPath(f.path).parent for f in report.files if f.needs_runtime and not f.error}\n",
           "    wanted = {PurePosixPath(f.path).parent for f in report.changed if f.needs_runtime}\n",
           "a stale runtime copy is not refreshed when nothing else changes"),
    Mutant("W16", "write", "patcher/engine/files.py",
           "    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f\".{path.name}.\", suffix=\".ddpatch-tmp\")\n",
           "    fd, tmp = tempfile.mkstemp(prefix=f\".{path.name}.\", suffix=\".ddpatch-tmp\")\n",
           "the temp file is made in the system's temp folder (M4): the rename may cross filesystems"),
    # ------------------------------------------------------------------ status classification
    Mutant("C1", "classify", "patcher/engine/classify.py", "    if not statuses or NO_MATCH in statuses:\n        return NO_MATCH\n",
           "    if not statuses:\n        return NO_MATCH\n", "a no-match anchor does not make its step no-match"),
    Mutant("C2", "classify", "patcher/engine/classify.py", "    for status in (APPLIED, ALREADY_APPLIED, FIXED_UPSTREAM):\n",
           "    for status in (FIXED_UPSTREAM, ALREADY_APPLIED, APPLIED):\n", "a step's status prefers fixed-upstream over applied"),
    Mutant("C3", "classify", "patcher/engine/pipeline.py",
           "            site.status = ALREADY_APPLIED if site.step in recorded else FIXED_UPSTREAM\n",
           "            site.status = ALREADY_APPLIED\n", "output form without provenance is called already-applied"),
    Mutant("C4", "classify", "patcher/engine/pipeline.py",
           "            site.status = ALREADY_APPLIED if site.step in recorded else FIXED_UPSTREAM\n",
           "            site.status = FIXED_UPSTREAM\n", "ddpatch's own output is called fixed-upstream"),
    Mutant("C5", "classify", "patcher/engine/classify.py",
           "                anchors.append(AnchorResult(fn, NO_MATCH, f\"function `{fn}` is not defined anywhere in the tree\"))\n",
           "                pass\n", "an anchor function that is gone is not reported"),
    Mutant("C6", "classify", "patcher/engine/classify.py",
           "                anchors.append(AnchorResult(fn, NO_MATCH, f\"`{fn}` has no site for this step\", path, line))\n",
           "                anchors.append(AnchorResult(fn, FIXED_UPSTREAM, f\"`{fn}` has no site for this step\", path, line))\n",
           "an anchor without a site is a false green (fixed-upstream)"),
    Mutant("C7", "classify", "patcher/engine/files.py", "    for line in text.splitlines()[:3]:\n", "    for line in text.splitlines()[:1]:\n",
           "provenance after a shebang or coding cookie is not read"),
    Mutant("C8", "classify", "patcher/engine/pipeline.py", "    report = Report(recipe, root, upstream, files + skipped, steps, missing)\n    mark_skipped(report)\n",
           "    report = Report(recipe, root, upstream, files + skipped, steps, missing)\n",
           "an unparseable file shows as no-match of every step anchored in it (cause not first)"),
    Mutant("C9", "classify", "patcher/engine/classify.py", "        if step.status == APPLIED:\n            step.status = PENDING\n",
           "        if False:\n            step.status = PENDING\n", "check reports pending steps as applied"),
    Mutant("C10", "classify", "patcher/engine/classify.py", "        if SKIPPED in statuses and NO_MATCH not in statuses:\n",
           "        if False:\n", "a step with sites in a skipped file keeps its applied/no-match status"),
    # ------------------------------------------------------------------ crop semantics (runtime.crop_cache's contract)
    Mutant("R1", "crop", RUNTIME, "    new_len = length if length >= 0 else current + length\n",
           "    new_len = length if length > 0 else current + length\n", "crop_cache(cache, 0) keeps everything (contract: keeps nothing)"),
    Mutant("R2", "crop", RUNTIME, "    new_len = length if length >= 0 else current + length\n",
           "    new_len = length if length >= 0 else current - length\n", "a negative count adds instead of dropping"),
    Mutant("R3", "crop", RUNTIME, "    new_len = max(0, min(new_len, current))\n", "    new_len = max(0, new_len)\n",
           "no clamp past the end",
           equivalent="_cut clamps the drop count to [0, current] itself, so crop_cache keeps its contract without this clamp (test_crop_cache_meaning's past-the-end and negative-past cases pass either way)"),
    Mutant("R4", "crop", RUNTIME, "    new_len = max(0, min(new_len, current))\n", "    new_len = min(new_len, current)\n",
           "dropping more than the cache holds is not clamped at 0",
           equivalent="_cut clamps the drop count to [0, current] itself, so crop_cache keeps its contract without this clamp (test_crop_cache_meaning's past-the-end and negative-past cases pass either way)"),
    Mutant("R5", "crop", RUNTIME, "    new_len = length if length >= 0 else current + length\n",
           "    new_len = current + length if length >= 0 else length\n", "the two meanings swapped"),
    # ------------------------------------------------------------------ the runtime's guards (issue 22: M1, M2)
    Mutant("G1", "guards", RUNTIME,
           "                if keep[0] != 0 or any(parents[b] != a for a, b in zip(keep, keep[1:])):\n"
           "                    raise ValueError(f\"ddpatch: kept tree nodes {keep} are not a root-to-node path\")\n",
           "                pass\n", "a tree keep need not be a root-to-node path (M1: compact_cache(cache, 5, [0, 1, 4]) commits a wrong branch)"),
    Mutant("G2", "guards", RUNTIME,
           "                if keep[0] != 0 or any(parents[b] != a for a, b in zip(keep, keep[1:])):\n",
           "                if keep[0] != 0:\n", "a tree keep is checked for its root only, not for parent links"),
    Mutant("G3", "guards", RUNTIME,
           "            if keep != list(range(n)):\n                raise ValueError(f\"ddpatch: a chain verify can only keep a prefix, got {keep}\")\n",
           "", "a chain keep need not be a prefix (M2: [0, 2] commits tokens 0 and 1)"),
    Mutant("G4", "guards", RUNTIME,
           "    if record.mode == \"tree\" and keep > 1 and not _tree_prefix_is_path(record, keep):\n",
           "    if False:\n", "a tree verify cut back by a plain crop commits its first nodes as if they were a path"),
    Mutant("G5", "guards", RUNTIME, "    return all(parents[i] == i - 1 for i in range(1, len(parents)))\n",
           "    return all(parents[i] < i for i in range(1, len(parents)))\n",
           "any tree counts as a chain, so a crop of a branching tree verify guesses a path"),
    Mutant("G6", "guards", RUNTIME, "    if keep < 0:\n        _set_record(cache, None)\n",
           "    if False:\n        _set_record(cache, None)\n", "a cut below the verify's start is not refused"),
    # ------------------------------------------------------------------ crop-compat's reading of a local (M3)
    Mutant("D1", "reading", CROP_CODEMOD, "            results = [self.meaning(fn, v, seen) for v in fn.assigns[name]]\n",
           "            results = [self.meaning(fn, v, seen) for v in fn.assigns[name][:1]]\n",
           "first assignment wins: `n = keep; if exact: n = keep - cache.get_seq_length()` reads as a length"),
    Mutant("D2", "reading", CROP_CODEMOD, "            results = [self.meaning(fn, v, seen) for v in fn.assigns[name]]\n",
           "            results = [self.meaning(fn, v, seen) for v in fn.assigns[name][-1:]]\n",
           "last assignment wins"),
    Mutant("D3", "reading", CROP_CODEMOD, "            kind = _combine({k for k, _ in results})\n            if kind == AMBIGUOUS:\n"
           "                return AMBIGUOUS, f\"`{name}` is assigned both",
           "            kind = results[0][0]\n            if kind == AMBIGUOUS:\n                return AMBIGUOUS, f\"`{name}` is assigned both",
           "a local's readings are not combined: the first decides"),
    Mutant("D4", "reading", CROP_CODEMOD,
           "        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Subtract) and _seq_length_call(expr.right):\n",
           "        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Subtract):\n",
           "any subtraction reads as a 5.x count (`start - 1` left alone as a count)"),
    Mutant("D5", "reading", CROP_CODEMOD,
           "            if not results:\n                return LENGTH, f\"`{name}` (a parameter: 4.x code passes lengths)\"\n",
           "            if True:\n                return LENGTH, f\"`{name}` (a parameter: 4.x code passes lengths)\"\n",
           "a helper's parameter is always a length, whatever its callers pass"),
]


def locate(tree: Path, m: Mutant) -> tuple[Path | None, str]:
    """The one file of ``tree`` that holds ``m.old`` exactly once, or (None, why it is stale)."""
    if m.path.endswith(".py"):
        candidates = [tree / m.path]
    else:
        candidates = [tree / f"{m.path}.py", *sorted((tree / m.path).glob("*.py"))]
    counts = {p: p.read_text(encoding="utf-8").count(m.old) for p in candidates if p.is_file()}
    hits = [p for p, n in counts.items() if n]
    if len(hits) == 1 and counts[hits[0]] == 1:
        return hits[0], ""
    return None, f"text found {sum(counts.values())} times in {len(hits)} of {len(counts)} files"


# ----------------------------------------------------------------------------- running
def copy_checkout(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", "*.pyc")
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    return dest


def run_tests(tree: Path, tests: list[str], timeout: float, verbose: bool, select: str | None = None) -> tuple[bool, str, float]:
    """(passed, the first failing test, seconds); the copy's ``patcher`` is the one imported."""
    present = [t for t in tests if (tree / t.split("::")[0]).exists()]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "DDPATCH_HOME": str(tree / ".ddpatch-home")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *present, *(["-k", select] if select else [])]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "(timeout)", time.perf_counter() - start
    seconds = time.perf_counter() - start
    failed = next((line.split(" ")[1] for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))), "")
    if verbose and proc.returncode not in (0, 1):
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
    return proc.returncode == 0, failed or (f"exit {proc.returncode}" if proc.returncode else ""), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", action="append", choices=sorted(GROUP_TESTS), help="Only these groups (repeatable).")
    parser.add_argument("--only", default=None, help="Only these mutant ids, comma-separated.")
    parser.add_argument("--list", action="store_true", help="List the mutants and exit.")
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds per test run.")
    parser.add_argument("--no-baseline", action="store_true", help="Skip the run on the unmodified copy.")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if (not args.group or m.group in args.group)
              and (not args.only or m.id in {x.strip() for x in args.only.split(",")})]
    if args.list:
        for m in chosen:
            print(f"{m.id:<4} {m.group:<9} {m.path:<33} {m.what}")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="ddpatch-mutants-") as tmp:
        tree = copy_checkout(Path(tmp) / "tree")
        for group in [g for g in GROUP_TESTS if any(m.group == g for m in chosen)]:
            tests = GROUP_TESTS[group]
            if not args.no_baseline:
                ok, failed, seconds = run_tests(tree, tests, args.timeout, args.verbose, GROUP_SELECT.get(group))
                print(f"[{group}] baseline: {'pass' if ok else 'FAIL ' + failed} ({seconds:.0f} s)", flush=True)
                if not ok:
                    results += [(m, "baseline-fails", failed, 0.0) for m in chosen if m.group == group]
                    continue
            for m in (m for m in chosen if m.group == group):
                path, why = locate(tree, m)
                if path is None:
                    results.append((m, "stale", why, 0.0))
                    print(f"  {m.id:<4} stale     {m.what} ({why})", flush=True)
                    continue
                original = path.read_text(encoding="utf-8")
                path.write_text(original.replace(m.old, m.new), encoding="utf-8")
                try:
                    ok, failed, seconds = run_tests(tree, tests, args.timeout, args.verbose, GROUP_SELECT.get(group))
                finally:
                    path.write_text(original, encoding="utf-8")  # always restored, even on Ctrl-C
                outcome = "survived" if ok else "killed"
                results.append((m, outcome, failed, seconds))
                print(f"  {m.id:<4} {outcome:<9} {m.what}" + (f"  [{failed}]" if failed and args.verbose else "")
                      + f" ({seconds:.0f} s)", flush=True)
    scored = [r for r in results if r[1] in ("killed", "survived")]
    killed = [r for r in scored if r[1] == "killed"]
    print()
    print(f"{'id':<4} {'group':<9} {'outcome':<15} mutant")
    for m, outcome, failed, _ in results:
        note = f"  (killed by {failed})" if outcome == "killed" and failed else ""
        if outcome == "survived" and m.equivalent:
            note = f"  (equivalent: {m.equivalent})"
        print(f"{m.id:<4} {m.group:<9} {outcome:<15} {m.what}{note}")
    if scored:
        print(f"\nscore: {len(killed)}/{len(scored)} killed ({100 * len(killed) / len(scored):.0f}%)"
              + (f"; {len(results) - len(scored)} not scored (stale or baseline failing)" if len(results) != len(scored) else ""))
    survivors = [r for r in scored if r[1] == "survived" and not r[0].equivalent]
    return 0 if not survivors and scored else 1


if __name__ == "__main__":
    sys.exit(main())
