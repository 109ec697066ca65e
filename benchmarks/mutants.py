"""A mutation check: small hand-written bugs in the code the tests must guard, and whether they notice.

Each mutant is one textual change to one file (a write path that is not atomic, a status
that is classified the wrong way, a crop that misreads its argument...). For each, the
script copies the checkout to a temporary folder, applies the change there (the checkout
itself is never modified) and runs the tests that guard that code (``GROUP_TESTS``). Outcomes:

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
    "lossless": [  # the cheap recorded-count checks first: -x stops at the first failure
        "tests/test_lossless.py::test_every_stateful_preset_is_lossless_and_its_control_fails[tiny-lfm2]",
        "tests/test_lossless.py::test_early_exit_on_nemotron_h_drafts_with_the_whole_model_and_stays_exact",
        "tests/test_lossless.py::test_every_stateful_preset_is_lossless_and_its_control_fails[tiny-falcon-h1]",
        "tests/test_lossless.py::test_early_exit_is_lossless_with_partial_acceptances_and_its_control_fails",
        "tests/test_lossless.py::test_dflash_is_lossless_with_partial_acceptances",
        "tests/test_lossless.py::test_speculative_sampling_with_an_assistant_follows_the_target",
    ],
    "calibration": [
        "tests/test_calibration.py::test_the_floor_is_measured_and_the_tolerance_is_a_fixed_multiple_of_it",
    ],
    "config": [
        "tests/test_config.py::test_cli_flags_override_the_file_and_isolated_ignores_it",
    ],
    "runtime_safety": [
        "tests/test_runtime_safety.py::test_the_tf32_stand_in_rounds_every_matmul_form",
        "tests/test_runtime_safety.py::test_the_cumulative_decay_is_exact_when_matmuls_run_in_tf32",
        "tests/test_runtime_safety.py::test_a_round_makes_a_fixed_number_of_host_syncs_whatever_the_layers",
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
    # ------------------------------------------------------------------ patcher.lossless (generate() on stateful models)
    Mutant("L1", "lossless", "patcher/lossless.py", "        self.record = record\n", "        self.record = False\n",
           "lossless() records nothing (on 5.24+, where nothing is refused, it then does nothing)"),
    # ------------------------------------------------------------------ the verifier's noise floor
    Mutant("K1", "calibration", "patcher/verify/calibration.py",
           "        measured = max(measured, float((a - b).abs().max()))\n", "        measured = max(measured, 0.0)\n",
           "the noise floor is no longer measured (the ulp alone)"),
    Mutant("K2", "calibration", "patcher/verify/calibration.py", "MULTIPLE = 4.0\n", "MULTIPLE = 16.0\n",
           "the tolerance is 16 floors (still conclusive on the tiny model, which allows up to ~19.7)"),
    # ------------------------------------------------------------------ config files
    Mutant("F1", "config", "patcher/config.py", "    if isolated:\n        return Config()\n",
           "    if isolated:\n        raise ConfigError(\"--isolated: no config file to read\")\n",
           "--isolated raises instead of reading no file"),
    Mutant("F2", "config", "patcher/config.py", "    if isolated:\n        return Config()\n",
           "    if False:\n        return Config()\n", "--isolated is ignored: the nearest file is read"),
    # ------------------------------------------------------------------ runtime safety (issue 21: TF32, host syncs)
    Mutant("S1", "runtime_safety", RUNTIME, "    G = (gl.unsqueeze(-2) * anc.to(gl.dtype)).sum(-1)  # [B, H, N]\n",
           "    G = torch.matmul(gl, anc.to(gl.dtype).transpose(-1, -2))  # [B, H, N]\n",
           "the cumulative decay through torch.matmul (TF32 when a script turns it on)"),
    Mutant("S2", "runtime_safety", RUNTIME, "    G = (gl.unsqueeze(-2) * anc.to(gl.dtype)).sum(-1)  # [B, H, N]\n",
           "    G = torch.einsum(\"bhj,ij->bhi\", gl, anc.to(gl.dtype))  # [B, H, N]\n",
           "the cumulative decay through torch.einsum"),
    Mutant("S3", "runtime_safety", RUNTIME, "    G = (gl.unsqueeze(-2) * anc.to(gl.dtype)).sum(-1)  # [B, H, N]\n",
           "    G = torch.bmm(gl.reshape(-1, 1, gl.shape[-1]), anc.to(gl.dtype).T.expand(gl.shape[0] * gl.shape[1], -1, -1)"
           ").reshape(gl.shape)  # [B, H, N]\n",
           "the cumulative decay through torch.bmm"),
    Mutant("S4", "runtime_safety", RUNTIME, "        index = indices.get(tensor.device)\n",
           "        if torch.equal(tensor[..., :0, :], tensor[..., :0, :]):  # a host sync per K/V tensor\n"
           "            pass\n        index = indices.get(tensor.device)\n",
           "a host sync per attention layer's K/V tensor through torch.equal"),
    Mutant("S5", "runtime_safety", RUNTIME, "        index = indices.get(tensor.device)\n",
           "        if tensor.cpu().numel() < 0:  # a copy to the host per K/V tensor\n"
           "            pass\n        index = indices.get(tensor.device)\n",
           "a copy to the host per attention layer's K/V tensor through .cpu()"),
    Mutant("S6", "runtime_safety", RUNTIME, "        index = indices.get(tensor.device)\n",
           "        index = None\n", "the compaction index is built again for each K/V tensor (a host-to-device copy each)"),
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
