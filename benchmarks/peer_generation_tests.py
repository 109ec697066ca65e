"""transformers' own generation tests, with every ``generate()`` inside ``patcher.lossless``: a peer check per release.

transformers' ``GenerationTesterMixin`` (``tests/generation/test_utils.py`` of its source checkout) runs greedy,
assisted-decoding and prompt-lookup tests with each family's own tiny test configuration
(``tests/models/<family>/test_modeling_<family>.py``), and skips the speculative ones on stateful models. This
script runs those tests from YOUR transformers checkout (nothing of it is copied here; check out the tag of the
release you have installed), with:

* every ``generate()`` call inside ``patcher.lossless(model, assistant_model)`` (an assistant's own nested
  ``generate()`` runs inside its target's context);
* the stateful skip lifted: a skip whose reason mentions "stateful" is not taken (``self.skipTest``,
  ``pytest.skip``, ``@pytest.mark.skip(if)``, ``@unittest.skip``), and the ``_is_stateful`` flag (transformers
  up to 5.23) of the tested classes is cleared;

and prints a family x test table (pass, FAIL, refused: ``lossless`` refused the model on entry, skip, ERROR: the
family's test file did not import, vacuous: the test returned instead of running (a bare ``@is_flaky``), so it
proved nothing; a cell shows the worst of the family's test classes), the count of every result,
and the first error line of each FAIL, refusal and ERROR; JSON with ``--json FILE``. ``--no-lossless`` is the
control: the skip lifted, nothing recorded. Test files that bring the mixin through transformers' shared testers
(``CausalLMModelTest`` and kin) are run too; one file that does not import does not stop the others.

    git -C ~/src/transformers checkout v5.25.0
    python3 benchmarks/peer_generation_tests.py ~/src/transformers                       # every family with tests
    python3 benchmarks/peer_generation_tests.py ~/src/transformers --family qwen3_5 --family nemotron_h --json peer.json
    python3 benchmarks/peer_generation_tests.py ~/src/transformers --no-lossless          # the control

Exit status: 0 when every selected test passed (or was refused by ``lossless`` in one line), 1 otherwise, 2 on
bad input (not a checkout, no test file for the families, no test ran). This file is also the pytest plugin it loads into the run (``-p peer_generation_tests``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the GenerationTesterMixin tests this runs (a pytest -k expression)
DEFAULT_TESTS = "assisted or prompt_lookup or greedy"
_RESULTS_ENV, _LOSSLESS_ENV = "DDPATCH_PEER_RESULTS", "DDPATCH_PEER_LOSSLESS"
_local = threading.local()
_RESULTS: dict[str, str] = {}  # test id -> outcome, in the pytest run
_ERRORS: dict[str, str] = {}  # test id -> the first error line of a FAIL, a refusal or a file that did not import
#: the test classes that bring GenerationTesterMixin's tests (transformers' shared testers inherit it)
TESTER_NAMES = ("GenerationTesterMixin", "CausalLMModelTest", "VLMModelTest", "ALMModelTest", "MultiModalModelTest")
#: a test that returns a value instead of running (``@is_flaky`` without its parentheses returns the decorator) passes
#: with only a DeprecationWarning: made an error, reported as ``vacuous`` (never a pass, never a lossless failure)
VACUOUS = "error:It is deprecated to return a value:DeprecationWarning"


class BadInput(Exception):
    """One ``ddpatch: error:`` line, exit 2."""


# ----------------------------------------------------------------------------- the plugin (inside the pytest run)
def pytest_configure(config):
    from transformers.generation.utils import GenerationMixin

    use_lossless = os.environ.get(_LOSSLESS_ENV, "1") == "1"
    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if not use_lossless or getattr(_local, "inside", False):  # an assistant's own generate(): its target's context
            return original(self, *args, **kwargs)
        import patcher
        import torch

        models = [self] + [m for m in (kwargs.get("assistant_model"),) if isinstance(m, torch.nn.Module)]
        _local.inside = True
        try:
            with patcher.lossless(*models):
                return original(self, *args, **kwargs)
        finally:
            _local.inside = False

    GenerationMixin.generate = generate
    _lift_stateful_skips()


def _lift_stateful_skips():
    import unittest

    import pytest

    skip_test, skip = unittest.TestCase.skipTest, pytest.skip

    def skipTest(self, reason):
        if "stateful" not in str(reason).lower():
            skip_test(self, reason)

    def pytest_skip(reason="", *args, **kwargs):
        if "stateful" not in str(reason).lower():
            skip(reason, *args, **kwargs)

    unittest.TestCase.skipTest = skipTest
    pytest.skip = functools.update_wrapper(pytest_skip, skip)
    pytest.skip.Exception = skip.Exception


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        # decorator skips too: @pytest.mark.skip(if) and @unittest.skip whose reason mentions "stateful"
        item.own_markers[:] = [m for m in item.own_markers if not (m.name in ("skip", "skipif") and "stateful" in
                                                                   str(m.kwargs.get("reason", m.args)).lower())]
        function = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        why = str(getattr(function, "__unittest_skip_why__", "")).lower()
        if getattr(function, "__unittest_skip__", False) and "stateful" in why and hasattr(function, "__wrapped__"):
            setattr(item.cls, item.name, function.__wrapped__)  # unittest.skip wrapped the test in one that skips
            item._obj = None  # pytest resolved the wrapper already: look the test up again
    _clear_stateful_flags()


def _clear_stateful_flags():
    """transformers up to 5.23 flags stateful model classes (``_is_stateful``): its tests skip on the flag and its
    ``generate()`` refuses on it. Cleared on every model class loaded by now (the tested classes are listed by the
    test classes, often through a property, so they are found as subclasses, not through those lists)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return
    todo, seen = [PreTrainedModel], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if cls.__dict__.get("_is_stateful", False):
            cls._is_stateful = False
        todo += cls.__subclasses__()


def _first_error(report) -> str:
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    lines = [line[2:].strip() for line in text.splitlines() if line.startswith("E ")]
    return (lines[0] if lines else (text.strip().splitlines() or [""])[-1])[:300]


def pytest_runtest_logreport(report):
    if report.when != "call" and report.passed:
        return
    if report.passed:
        outcome = "pass"
    elif report.skipped:
        outcome = "skip"
    elif "UnsupportedModelError" in str(report.longrepr):
        outcome = "refused"
    else:  # a test that returned instead of running (VACUOUS) proved nothing either way: its own outcome
        outcome = "vacuous" if "deprecated to return a value" in str(report.longrepr) else "FAIL"
    if _RESULTS.get(report.nodeid) in (None, "pass"):  # a failed setup or teardown outranks a passed call
        _RESULTS[report.nodeid] = outcome
        if outcome in ("FAIL", "refused", "vacuous"):
            _ERRORS[report.nodeid] = _first_error(report)


def pytest_collectreport(report):
    """A test file that does not import (a name this transformers lacks) is an ``ERROR`` of its own family; the
    other families still run (``--continue-on-collection-errors``)."""
    if report.failed and report.nodeid.endswith(".py"):
        _RESULTS[report.nodeid + "::collect"] = "ERROR"
        _ERRORS[report.nodeid + "::collect"] = _first_error(report)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(_RESULTS_ENV)
    if path:
        Path(path).write_text(json.dumps({"results": _RESULTS, "errors": _ERRORS}, indent=1, sort_keys=True))


# ----------------------------------------------------------------------------- the driver
def test_files(source: Path, families: list[str] | None) -> list[Path]:
    models = source / "tests" / "models"
    found = sorted(models.glob("*/test_modeling_*.py"))
    if families:
        found = [p for p in found if p.parent.name in families]
    return [p for p in found if any(name in p.read_text(encoding="utf-8", errors="replace") for name in TESTER_NAMES)]


def run(source: Path, families: list[str] | None, tests: str, use_lossless: bool, timeout: int) -> tuple[dict, dict]:
    """(test id -> outcome, test id -> first error line)."""
    files = test_files(source, families)
    if not files:
        raise BadInput(f"no tests/models/*/test_modeling_*.py with {' or '.join(TESTER_NAMES)} under {source}"
                       + (f" for --family {', '.join(families)}" if families else ""))
    with tempfile.TemporaryDirectory(prefix="ddpatch-peer-") as tmp:
        results = Path(tmp) / "results.json"
        env = dict(os.environ, **{_RESULTS_ENV: str(results), _LOSSLESS_ENV: "1" if use_lossless else "0"})
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), str(ROOT), str(source), env.get("PYTHONPATH", "")])
        command = [sys.executable, "-m", "pytest", "-q", "-p", "peer_generation_tests", "-p", "no:cacheprovider",
                   "-n", "0", "--rootdir", str(source), "--continue-on-collection-errors", "-W", VACUOUS, "-k", tests,
                   *map(str, files)]
        proc = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True, timeout=timeout)
        found = json.loads(results.read_text()) if results.exists() else {}
        if not found.get("results"):  # pytest's exit 2 to 4: interrupted, internal error, usage error
            output = (proc.stdout + proc.stderr).strip().splitlines()
            why = [line[2:].strip() for line in output if line.startswith("E ")][:1] or [l for l in output if l.strip()][-3:]
            raise BadInput(f"no test ran (pytest exit {proc.returncode}): " + " | ".join(why))
        return found["results"], found.get("errors", {})


#: a cell holds one test of every test class of the family (qwen3_5 has two): it shows the worst
WORST_FIRST = ("ERROR", "FAIL", "vacuous", "refused", "skip", "pass")


def table(results: dict) -> tuple[list[str], dict[str, dict[str, str]]]:
    grid: dict[str, dict[str, str]] = {}
    names: list[str] = []
    for nodeid, outcome in results.items():
        path, _, test = nodeid.partition("::")
        family = Path(path).parent.name
        test = test.rpartition("::")[2]
        row = grid.setdefault(family, {})
        if test not in row or WORST_FIRST.index(outcome) < WORST_FIRST.index(row[test]):
            row[test] = outcome
        if test not in names:
            names.append(test)
    return sorted(names), grid


def render(names: list[str], grid: dict[str, dict[str, str]], results: dict | None = None,
           errors: dict | None = None) -> str:
    width = max([len(f) for f in grid] + [6])
    columns = [max([len(f"T{i + 1}")] + [len(row.get(n, "-")) for row in grid.values()]) for i, n in enumerate(names)]
    lines = [f"{'family':<{width}}  " + "  ".join(f"{f'T{i + 1}':<{w}}" for i, w in enumerate(columns)).rstrip()]
    for family in sorted(grid):
        lines.append(f"{family:<{width}}  " + "  ".join(f"{grid[family].get(n, '-'):<{w}}"
                                                       for n, w in zip(names, columns)).rstrip())
    lines += [""] + [f"T{i + 1}: {n}" for i, n in enumerate(names)]
    counts: dict[str, int] = {}
    outcomes = list((results or {}).values()) or [o for row in grid.values() for o in row.values()]
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    lines.append(f"{len(outcomes)} results: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    for nodeid, line in sorted((errors or {}).items()):
        lines.append(f"{(results or {}).get(nodeid, '?')} {nodeid}: {line}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a transformers source checkout (with tests/generation and tests/models)")
    parser.add_argument("--family", action="append", help="only tests/models/FAMILY (repeatable)")
    parser.add_argument("--tests", default=DEFAULT_TESTS, help=f"a pytest -k expression (default: {DEFAULT_TESTS!r})")
    parser.add_argument("--no-lossless", action="store_true", help="the control: the stateful skip lifted, no lossless")
    parser.add_argument("--json", type=Path, help="also write the results (test id -> outcome) and the table as JSON")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for the whole run (default 3600)")
    args = parser.parse_args(argv)
    if not (args.source / "tests" / "generation" / "test_utils.py").is_file():
        print(f"ddpatch: error: {args.source} has no tests/generation/test_utils.py (a transformers source checkout; "
              "the PyPI sdist has no tests/generation)", file=sys.stderr)
        return 2
    try:
        results, errors = run(args.source, args.family, args.tests, not args.no_lossless, args.timeout)
    except BadInput as exc:
        print(f"ddpatch: error: {exc}", file=sys.stderr)
        return 2
    names, grid = table(results)
    print(render(names, grid, results, errors))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "errors": errors, "tests": names, "table": grid}, indent=1,
                                        sort_keys=True))
    return 0 if all(v in ("pass", "refused", "skip") for v in results.values()) and results else 1


if __name__ == "__main__":
    sys.exit(main())
