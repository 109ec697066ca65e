"""A mutation check: small hand-written bugs in the code the tests must guard, and whether they notice.

Each mutant is one textual change to one file (a write path that is not atomic, a status
that is classified the wrong way, a crop that misreads its argument...). For each, the
script copies the checkout to a temporary folder, applies the change there (the checkout
itself is never modified) and runs the tests that guard that code (``GROUP_TESTS``; the groups and
their mutants are in ``benchmarks/mutant_catalog.py``). Outcomes:

- ``killed``: pytest exited 1 with at least one failed test (a check of a listed test failed,
  or the mutated code raised inside one);
- ``survived``: every listed test passed (a hole in the tests, or a change no test can see,
  which the mutant's ``equivalent`` note then explains);
- ``error`` (import or collection errors, a fixture that could not be set up: exit 1 with
  errors only, 2, 3, 4, a signal), ``no-tests`` (exit 5) and ``timeout`` decided nothing:
  they are reported with their reason and not scored, never counted as killed.

    python benchmarks/mutants.py                      # every group
    python benchmarks/mutants.py --group write --group classify
    python benchmarks/mutants.py --list               # the mutants, without running them
    python benchmarks/mutants.py --only W1,C3 -v      # some mutants, with pytest's output on a failure

Before the mutants of a group, its tests run once on the unmodified copy. A group with a
listed test file that does not exist, or whose list selects no test, is ``misconfigured``
(never run around: the whole suite is not a stand-in); one whose tests fail there is
``baseline-fails``. A mutant whose text is no longer in its file (the code moved on) is
``stale``. None of these is scored. The score is printed per group and over all.
Exit status: 0 when every mutant was killed or survived with an ``equivalent`` note; 1
otherwise (a survivor to explain, or a mutant that was not decided).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutant_catalog import GROUP_SELECT, GROUP_TESTS, MUTANTS, Mutant  # noqa: E402  (the groups and their mutants)


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
#: what a run of a group's tests can come to; only ``killed`` and ``survived`` are scored
KILLED, SURVIVED = "killed", "survived"
ERROR, NO_TESTS, TIMEOUT = "error", "no-tests", "timeout"          # a mutant's run that decided nothing
STALE, MISCONFIGURED, BASELINE_FAILS = "stale", "misconfigured", "baseline-fails"  # not run, or not on sound tests
SCORED = (KILLED, SURVIVED)


@dataclass
class Run:
    """One pytest run: its outcome (``pass`` for a baseline/survivor, else one of the above) and why."""
    outcome: str
    reason: str
    seconds: float = 0.0
    passed: int = 0


def copy_checkout(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", "*.pyc")
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    return dest


def missing_tests(tree: Path, tests: list[str]) -> list[str]:
    """The listed test files that do not exist in ``tree`` (a group with any is misconfigured)."""
    return [t for t in tests if not (tree / t.split("::")[0]).is_file()]


def test_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "DDPATCH_HOME": str(tree / ".ddpatch-home")}


def imports_the_copy(tree: Path) -> str:
    """'' when ``import patcher`` in the test environment loads the copy's, else what it loads instead."""
    proc = subprocess.run([sys.executable, "-c", "import patcher; print(patcher.__file__)"], cwd=tree, env=test_env(tree),
                          capture_output=True, text=True, timeout=300)
    where = proc.stdout.strip()
    if proc.returncode or not Path(where).resolve().is_relative_to(tree.resolve()):
        return f"`import patcher` in the copy loads {where or proc.stderr.strip()[-300:]!r}, not the copy: the mutants would not be seen"
    return ""


def _junit(path: Path) -> tuple[dict[str, int], list[tuple[str, str, str]]]:
    """Counts (tests, failures, errors, skipped) and the (kind, test, message) of each failed or errored case."""
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    cases: list[tuple[str, str, str]] = []
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return counts, cases
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            for child in case.findall(kind):
                name = ".".join(x for x in (case.get("classname"), case.get("name")) if x)
                message = (child.get("message") or "").strip().splitlines()
                raised = [line[1:].strip() for line in (child.text or "").splitlines() if line.startswith("E ")]
                # pytest's own E line says what was raised where the message is generic ("collection failure")
                text = raised[-1] if kind == "error" and raised else message[0] if message else raised[-1] if raised else ""
                cases.append((kind, name, text[:200]))
    return counts, cases


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


def run_tests(tree: Path, tests: list[str], timeout: float, verbose: bool, select: str | None = None) -> Run:
    """Run ``tests`` in ``tree`` (the copy's ``patcher`` is the one imported) and say what came of it.

    ``pass``: exit 0. ``killed``: exit 1 with at least one failed test (a test's own check, or the
    code under test raising inside it). Anything else decided nothing: ``error`` (exit 1 with only
    errors, such as a fixture that could not be set up; exit 2 collection or import errors; 3, 4, a
    signal), ``no-tests`` (exit 5: nothing collected or everything deselected), ``timeout``. The
    caller checks that every listed file exists first: a missing one is never run around."""
    assert not missing_tests(tree, tests), "run_tests: the caller checks missing_tests first"
    with tempfile.TemporaryDirectory(prefix="ddpatch-mutants-junit-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *tests, *(["-k", select] if select else [])]
        start = time.perf_counter()
        # a session of its own: on a timeout the whole group (verifier children included) is stopped
        proc = subprocess.Popen(cmd, cwd=tree, env=test_env(tree), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Run(TIMEOUT, f"no result after {timeout:.0f} s (stopped)", time.perf_counter() - start)
        seconds = time.perf_counter() - start
        counts, cases = _junit(junit)
    code = proc.returncode
    if verbose and code != 0:
        print(out[-2000:], err[-2000:], file=sys.stderr)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failures = [c for c in cases if c[0] == "failure"]
    errors = [c for c in cases if c[0] == "error"]
    if code == 0:
        return Run("pass", f"{passed} passed" + (f", {counts['skipped']} skipped" if counts["skipped"] else ""), seconds, passed)
    if code == 1 and failures:
        _, name, message = failures[0]
        name = next((line.split(" ")[1] for line in out.splitlines() if line.startswith("FAILED ")), name)  # the node id
        return Run(KILLED, f"{name}: {message}" if message else name, seconds, passed)
    if code == 5:
        return Run(NO_TESTS, "exit 5: no tests collected" + (f" (-k {select!r} deselected every test)" if select else ""), seconds)
    if errors:
        _, name, message = errors[0]
        why = f"{len(errors)} error(s), no failed test; first: {name or 'collection'}: {message}"
    elif code < 0:
        why = f"pytest died of signal {-code}"
    else:
        why = _tail(err) or _tail(out) or "no report"
    return Run(ERROR, f"exit {code}: {why}", seconds)


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
    unknown = sorted({m.group for m in chosen} - set(GROUP_TESTS))
    if unknown:
        parser.error(f"mutants of groups without GROUP_TESTS: {', '.join(unknown)}")
    if args.list:
        for m in chosen:
            print(f"{m.id:<4} {m.group:<9} {m.path:<33} {m.what}")
        return 0
    results: list[tuple[Mutant, Run]] = []
    with tempfile.TemporaryDirectory(prefix="ddpatch-mutants-") as tmp:
        tree = copy_checkout(Path(tmp) / "tree")
        wrong_copy = imports_the_copy(tree)
        for group in [g for g in GROUP_TESTS if any(m.group == g for m in chosen)]:
            tests, select = GROUP_TESTS[group], GROUP_SELECT.get(group)
            mutants = [m for m in chosen if m.group == group]
            missing = missing_tests(tree, tests)
            broken = wrong_copy or (f"listed test file(s) missing: {', '.join(missing)}" if missing else "")
            if not broken and not args.no_baseline:
                base = run_tests(tree, tests, args.timeout, args.verbose, select)
                print(f"[{group}] baseline: {base.outcome} ({base.reason}; {base.seconds:.0f} s)", flush=True)
                if base.outcome == NO_TESTS or base.outcome == ERROR and base.reason.startswith("exit 4") and "not found" in base.reason:
                    broken = f"baseline {base.reason}"  # a -k, or a node id, that selects nothing: the list is wrong
                elif base.outcome != "pass":
                    results += [(m, Run(BASELINE_FAILS, f"the unmodified copy: {base.outcome}: {base.reason}")) for m in mutants]
                    continue
            if broken:
                print(f"[{group}] misconfigured: {broken}; its mutants are not run", flush=True)
                results += [(m, Run(MISCONFIGURED, broken)) for m in mutants]
                continue
            for m in mutants:
                path, why = locate(tree, m)
                if path is None:
                    run = Run(STALE, why)
                else:
                    original = path.read_text(encoding="utf-8")
                    path.write_text(original.replace(m.old, m.new), encoding="utf-8")
                    try:
                        run = run_tests(tree, tests, args.timeout, args.verbose, select)
                    finally:
                        path.write_text(original, encoding="utf-8")  # always restored, even on Ctrl-C
                    if run.outcome == "pass":
                        run = Run(SURVIVED, f"every listed test passed ({run.reason})", run.seconds, run.passed)
                results.append((m, run))
                print(f"  {m.id:<4} {run.outcome:<9} {m.what}" + (f"  [{run.reason}]" if args.verbose or run.outcome != KILLED else "")
                      + f" ({run.seconds:.0f} s)", flush=True)
    return report(results)


def report(results: list[tuple[Mutant, Run]]) -> int:
    """Print the table, each survivor and undecided mutant with its reason, and the score per group;
    0 only when every mutant was killed or is a survivor explained as equivalent."""
    print(f"\n{'id':<4} {'group':<9} {'outcome':<14} mutant")
    for m, run in results:
        if run.outcome == KILLED:
            note = f"  (killed by {run.reason})"
        elif run.outcome == SURVIVED and m.equivalent:
            note = f"  (equivalent: {m.equivalent})"
        else:
            note = f"  ({run.reason})"
        print(f"{m.id:<4} {m.group:<9} {run.outcome:<14} {m.what}{note}")
    print()
    groups = list(dict.fromkeys(m.group for m, _ in results))
    for group in [*groups, None] if len(groups) > 1 else groups:
        rows = [run for m, run in results if group is None or m.group == group]
        killed = sum(run.outcome == KILLED for run in rows)
        scored = sum(run.outcome in SCORED for run in rows)
        others = {o: sum(run.outcome == o for run in rows) for o in dict.fromkeys(run.outcome for run in rows) if o not in SCORED}
        survivors = [m for m, run in results if run.outcome == SURVIVED and (group is None or m.group == group)]
        equivalent = sum(m.equivalent != "" for m in survivors)
        score = f"{killed}/{scored} killed ({100 * killed / scored:.0f}%)" if scored else "nothing scored"
        extra = "; ".join([*([f"survived: {equivalent} equivalent, {len(survivors) - equivalent} unexplained"] if survivors else []),
                           *([f"not scored: {', '.join(f'{n} {o}' for o, n in others.items())}"] if others else [])])
        print(f"score {group or 'all':<9} {score}" + (f"; {extra}" if extra else ""))
    ok = all(run.outcome == KILLED or run.outcome == SURVIVED and m.equivalent for m, run in results)
    return 0 if results and ok else 1


if __name__ == "__main__":
    sys.exit(main())
