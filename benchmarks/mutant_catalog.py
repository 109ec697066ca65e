"""The mutants of ``benchmarks/mutants.py``: per group, the tests that guard the code (``GROUP_TESTS``),
an optional ``-k`` (``GROUP_SELECT``) and the hand-written bugs (``MUTANTS``), each with what it
breaks and, for a survivor no test can see, why (``equivalent``). docs/mutants.md gives the scores.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    "lossless": [  # the cheap checks first: -x stops at the first failure
        "tests/test_lossless.py::test_the_forward_keeps_its_signature",
        "tests/test_lossless.py::test_outside_the_context_transformers_behaves_as_before",
        "tests/test_lossless.py::test_every_stateful_preset_is_lossless_and_its_control_fails[tiny-lfm2]",
        "tests/test_lossless.py::test_early_exit_on_nemotron_h_drafts_with_the_whole_model_and_stays_exact",
        "tests/test_lossless.py::test_every_stateful_preset_is_lossless_and_its_control_fails[tiny-falcon-h1]",
        "tests/test_lossless.py::test_early_exit_is_lossless_with_partial_acceptances_and_its_control_fails",
        "tests/test_lossless.py::test_dflash_is_lossless_with_partial_acceptances",
        "tests/test_lossless.py::test_speculative_sampling_with_an_assistant_follows_the_target",
    ],
    "calibration": [
        "tests/test_calibration.py::test_the_floor_is_measured_and_the_tolerance_is_a_fixed_multiple_of_it",
        "tests/test_calibration.py::test_a_floor_too_high_for_a_loss_to_stand_out_is_inconclusive_and_names_the_float32_command",
        "tests/test_routers.py::test_the_router_floor_is_measured_and_the_router_tolerance_is_a_fixed_multiple_of_it",
        "tests/test_routers.py::test_a_target_without_routers_has_no_router_tolerance_and_a_plain_reference",
    ],
    "neartie": [  # near-ties, the mask-token event, and routing flips (patcher/verify/judge/neartie.py, routers.py)
        "tests/test_calibration.py::test_a_planted_near_tie_is_a_near_tie_and_passes",
        "tests/test_calibration.py::test_a_planted_real_loss_at_the_same_position_fails",
        "tests/test_calibration.py::test_the_targets_own_mask_token_is_named_not_called_a_loss",
        "tests/test_calibration.py::test_a_tie_at_the_divergence_then_a_token_far_from_its_argmax_is_a_loss",
        "tests/test_routers.py",
    ],
    "config": [
        "tests/test_config.py",
    ],
    "env": [
        "tests/test_env.py",
    ],
    "adopt": [
        "tests/test_adopt.py",
    ],
    "warm": [
        "tests/test_warm_verifier.py",
    ],
    "runtime_safety": [
        "tests/test_runtime_safety.py",
    ],
}

#: ``-k`` expressions that narrow a group's files to the tests about its code
GROUP_SELECT = {
    "reading": "crop and not decodes and not claims and not exit_0 and not masks",
    "config": "not verify_reads and not ci_reads",  # those two run a verify and a ci: the config's reading is above
    "env": "not help",  # a subprocess that only checks what --help imports
    "warm": "cannot_serve or leads_its_group or refus",  # the dead-server, timeout and equality runs take minutes
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
    Mutant("W12", "write", "patcher/api.py", "    blocked = bool(report.no_match or report.skipped or report.blocking_imports) and not allow_partial",
           "    blocked = bool(report.no_match or report.blocking_imports) and not allow_partial", "a skipped file does not stop the write"),
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
           "                anchors.append(AnchorResult(fn, NO_MATCH, f\"`{fn}` has no site for this step\" + (",
           "                anchors.append(AnchorResult(fn, FIXED_UPSTREAM, f\"`{fn}` has no site for this step\" + (",
           "an anchor without a site is a false green (fixed-upstream)"),
    Mutant("C7", "classify", "patcher/engine/files.py", "    for line in text.splitlines()[:3]:\n", "    for line in text.splitlines()[:1]:\n",
           "provenance after a shebang or coding cookie is not read"),
    Mutant("C8", "classify", "patcher/engine/pipeline.py", "                    exclude=exclude, excluded=excluded)\n    mark_skipped(report)\n",
           "                    exclude=exclude, excluded=excluded)\n",
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
    Mutant("D1", "reading", CROP_CODEMOD, "            results = [self.meaning(fn, v, seen) for v in values]\n",
           "            results = [self.meaning(fn, v, seen) for v in values[:1]]\n",
           "first assignment wins: `n = keep; if exact: n = keep - cache.get_seq_length()` reads as a length"),
    Mutant("D2", "reading", CROP_CODEMOD, "            results = [self.meaning(fn, v, seen) for v in values]\n",
           "            results = [self.meaning(fn, v, seen) for v in values[-1:]]\n",
           "last assignment wins"),
    Mutant("D3", "reading", CROP_CODEMOD, "            kind = _combine({k for k, _ in results})\n            if kind == AMBIGUOUS:\n"
           "                return AMBIGUOUS, f\"`{name}` is {self._assignments",
           "            kind = results[0][0]\n            if kind == AMBIGUOUS:\n                return AMBIGUOUS, f\"`{name}` is {self._assignments",
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
    Mutant("L1", "lossless", "patcher/generation/context.py", "        self.record = record\n", "        self.record = False\n",
           "lossless() records nothing (on 5.24+, where nothing is refused, it then does nothing)"),
    # ------------------------------------------------------------------ the verifier's noise floor
    Mutant("K1", "calibration", "patcher/verify/judge/calibration.py",
           "        measured = max(measured, float((a - b).abs().max()))\n", "        measured = max(measured, 0.0)\n",
           "the noise floor is no longer measured (the ulp alone)"),
    Mutant("K2", "calibration", "patcher/verify/judge/calibration.py", "MULTIPLE = 4.0\n", "MULTIPLE = 16.0\n",
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
    # ------------------------------------------------------------------ patcher.lossless: more
    Mutant("L2", "lossless", "patcher/generation/forwards.py",
           "    depth = _depth(model)\n\n    @functools.wraps(original)\n    def forward(*args, **kwargs):\n",
           "    depth = _depth(model)\n\n    def forward(*args, **kwargs):\n",
           "the recording forward loses the model forward's signature (transformers builds position_ids from it; MTP needs them)"),
    Mutant("L3", "lossless", "patcher/generation/forwards.py", "        if value is _MISSING:\n            vars(model).pop(name, None)\n",
           "        if value is _MISSING:\n            pass\n", "leaving the context keeps the recording forward on the instance"),
    Mutant("L4", "lossless", "patcher/generation/forwards.py",
           "        if id(model) in inside or cache_of(args, kwargs) is None or _depth(model) != depth:\n",
           "        if id(model) in inside or cache_of(args, kwargs) is None:\n",
           "an early-exit draft (the same model, fewer layers) is recorded as if it were the target"),
    # ------------------------------------------------------------------ calibration: more
    Mutant("K3", "calibration", "patcher/verify/judge/calibration.py",
           "        return self.override is not None or self.tolerance <= CONCLUSIVE_FRACTION * self.spread or self.dtype == \"float32\"\n",
           "        return True\n", "every calibration is conclusive, however high its floor"),
    Mutant("K4", "calibration", "patcher/verify/judge/calibration.py",
           "            router_floor = max(router_floor or 0.0, routed[0])\n", "            router_floor = 0.0\n",
           "the routers' floor is not measured (their logits' ulp alone)"),
    Mutant("K5", "calibration", "patcher/verify/judge/calibration.py",
           "    routers.set_tolerance(target, router_tolerance)\n", "    routers.set_tolerance(target, None)\n",
           "the router tolerance is not handed to the logits oracle (no flip is ever followed)"),
    # ------------------------------------------------------------------ near-ties and routing flips
    Mutant("N1", "neartie", "patcher/verify/judge/neartie.py",
           "    if worst is not None and worst[\"gap\"] > epsilon:\n", "    if worst is not None and worst[\"gap\"] > 100 * epsilon:\n",
           "a gap of 100 epsilons still counts as a tie"),
    Mutant("N2", "neartie", "patcher/verify/judge/neartie.py",
           "    if mask_token_id is not None and first < len(reference_tokens) and reference_tokens[first] == mask_token_id:\n",
           "    if False:\n", "the target emitting the mask token is judged as an ordinary divergence"),
    Mutant("N3", "neartie", "patcher/verify/judge/neartie.py",
           "        if top != token:\n            ties.append(entry)\n        if worst is None or gap > worst[\"gap\"]:\n",
           "        if top != token:\n            ties.append(entry)\n        if worst is None:\n",
           "only the first emitted token is judged against its argmax"),
    Mutant("N4", "neartie", "patcher/verify/judge/neartie.py", "    after_flip = flip_at is not None and flip_at <= first\n",
           "    after_flip = flip_at is not None\n", "a routing flip after the divergence excuses it too"),
    Mutant("N5", "neartie", "patcher/verify/judge/routers.py", "        if delta > tolerance:\n", "        if False:\n",
           "every routing difference is followed, however far apart the router logits are"),
    Mutant("N6", "neartie", "patcher/verify/judge/routers.py", "        if delta > tolerance:\n", "        if delta >= 0:\n",
           "no routing flip is followed (a tie broken the other way fails the run)"),
    Mutant("N7", "neartie", "patcher/verify/judge/routers.py", "    stand(model, final, sites)\n", "",
           "the drafter oracle's reference does not follow the flips the logits reference followed"),
    Mutant("N8", "neartie", "patcher/verify/judge/routers.py", "    return min(flips, key=lambda s: (s[0], order.get(s[1], 0))) if flips else None\n",
           "    return max(flips, key=lambda s: (s[0], order.get(s[1], 0))) if flips else None\n",
           "the last flip is judged first (a flip caused by an earlier one is judged before its cause)"),
    # ------------------------------------------------------------------ config: more
    Mutant("F3", "config", "patcher/config.py", "            if candidate.is_file() and (name != \"pyproject.toml\" or _table(candidate) is not None):\n",
           "            if candidate.is_file():\n", "a pyproject.toml without [tool.ddpatch] stops the search upward"),
    Mutant("F4", "config", "patcher/config.py", "CONFIG_FILES = (\"ddpatch.toml\", \"pyproject.toml\")\n",
           "CONFIG_FILES = (\"pyproject.toml\", \"ddpatch.toml\")\n", "pyproject.toml wins over ddpatch.toml in the same folder"),
    Mutant("F5", "config", "patcher/config.py", "            value = str(path.parent / value)\n", "            value = str(value)\n",
           "a recipe path in the config is read relative to the working folder, not the file"),
    Mutant("F6", "config", "patcher/config.py", "            if not isinstance(value, int) or isinstance(value, bool) or value < 1:\n",
           "            if not isinstance(value, int):\n", "jobs = 0 (or true) is accepted"),
    # ------------------------------------------------------------------ ddpatch env: the tested ranges
    Mutant("E1", "env", "patcher/env.py", "    if have < low:\n        return BELOW\n", "    if have <= low:\n        return BELOW\n",
           "the lowest tested release counts as below the range"),
    Mutant("E2", "env", "patcher/env.py", "    return INSIDE if have < high else ABOVE\n", "    return INSIDE if have <= high else ABOVE\n",
           "the first release above the range counts as inside"),
    Mutant("E3", "env", "patcher/env.py", "    return parts + (0,) * (3 - len(parts)) if len(parts) < 3 else parts\n", "    return parts\n",
           "a two-part version is not padded: 5.25 and 5.25.0 differ"),
    Mutant("E4", "env", "patcher/env.py", "    required = [c for c in components if not c.optional]\n", "    required = components\n",
           "a missing optional kernel makes the environment untested"),
    Mutant("E5", "env", "patcher/env.py", "    match = re.match(r\"\\s*v?(\\d+(?:\\.\\d+)*)\", str(version))\n",
           "    match = re.fullmatch(r\"\\s*v?(\\d+(?:\\.\\d+)*)\", str(version))\n", "a local suffix (+cpu, .dev0) is not a version"),
    # ------------------------------------------------------------------ adopt_cache
    Mutant("A1", "adopt", "patcher/runtime/adopt.py",
           "    cache.layers = fresh.layers\n    cache.layer_class_to_replicate = fresh.layer_class_to_replicate\n", "",
           "a bare cache is not laid out for the target"),
    Mutant("A2", "adopt", "patcher/runtime/adopt.py", "    if held:\n", "    if False:\n",
           "a bare cache that already holds another model's state is laid out anew (that state silently dropped)"),
    Mutant("A3", "adopt", "patcher/runtime/adopt.py",
           "    if not isinstance(cache, DynamicCache) or getattr(cache, \"layer_class_to_replicate\", None) is None:\n",
           "    if not isinstance(cache, DynamicCache):\n", "a cache laid out for another model is laid out anew"),
    Mutant("A4", "adopt", "patcher/runtime/adopt.py",
           "    if not modules or all(i < len(layers) and _is_linear_layer(layers[i]) for i, _ in modules):\n",
           "    if not modules:\n", "a cache already laid out for the target is laid out again"),
    # ------------------------------------------------------------------ the warm verifier
    Mutant("M1", "warm", "patcher/verify/child/warm.py", "    if asked != started_env:\n", "    if False:\n",
           "a request whose import-time environment differs is served by the fork (its verdict may differ)"),
    Mutant("M2", "warm", "patcher/verify/child/warm.py", "    _own_group(pid)\n    try:\n        conn.sendall(", "    try:\n        conn.sendall(",
           "the pid is answered before the child leads its group (a timeout's killpg may miss it)"),
    Mutant("M3", "warm", "patcher/verify/child/warm.py", "    if request.get(\"worker\") != worker:\n", "    if False:\n",
           "a request from another ddpatch checkout is served by this one's fork"),
    Mutant("M4", "warm", "patcher/verify/child/warm.py", "    if request.get(\"executable\") != sys.executable:\n", "    if False:\n",
           "a request from another Python is served by this one's fork"),
    # ------------------------------------------------------------------ runtime safety: each item of test_runtime_safety
    Mutant("S7", "runtime_safety", RUNTIME, "        if holder is not None and holder != me:\n", "        if False:\n",
           "item 1: a second thread's verify of a model under verify is let through"),
    Mutant("S8", "runtime_safety", RUNTIME,
           "        return (_copied_record, (self.mode, self.past_len, self.length, self.settled, self.settled is None))\n",
           "        return (_copied_record, (self.mode, self.past_len, self.length, self.settled, False))\n",
           "item 2: a copy of an uncommitted record can be committed (on the wrong state)"),
    Mutant("S9", "runtime_safety", RUNTIME, "            if i < len(getattr(other, \"layers\", ())) and other.layers[i] is layer:\n",
           "            if False:\n", "item 2: two caches sharing a linear layer are not refused"),
    Mutant("S10", "runtime_safety", RUNTIME, "            if cache is not None and _linear_layer_ids(cache):\n", "            if False:\n",
           "item 3: linear layers in the cache of a config without layer_types pass unrecorded"),
    Mutant("S11", "runtime_safety", RUNTIME,
           "        if layers is None or any(i >= len(layers) or not _is_linear_layer(layers[i]) for i, _ in modules):\n",
           "        if False:\n", "item 4: a cache without 5.x linear-attention layers is not refused"),
    Mutant("S12", "runtime_safety", RUNTIME, "    if current != record.settled:\n", "    if False:\n",
           "item 5: a key/value cache cut by hand after the commit goes unnoticed"),
    Mutant("S13", "runtime_safety", RUNTIME, "                if past_length is not None and int(past_length) != record.past_len:\n",
           "                if False:\n", "item 6: a tree_commit at another past length commits the wrong tokens"),
    Mutant("S14", "runtime_safety", RUNTIME, "    if record.inflight:\n", "    if False:\n",
           "item 7: a verify whose forward raised leaves a record a commit accepts"),
    Mutant("S15", "runtime_safety", RUNTIME, "    if getattr(cache, _WARNED_ATTR, False):\n        return\n",
           "    if getattr(cache, _WARNED_ATTR, False) or _warn_once.__dict__.setdefault(\"done\", []):\n        return\n"
           "    _warn_once.__dict__[\"done\"].append(True)\n",
           "item 8: the no-record warning once per process, not once per cache"),
    Mutant("S16", "runtime_safety", RUNTIME, "    if _release(version) < _release(options.MIN_TRANSFORMERS):\n", "    if False:\n",
           "item 11: a transformers older than the floor is not refused"),
]
