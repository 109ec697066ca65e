"""The checks on one model: the reference's own soundness, a warm-up, then per prompt and method
token identity, the logits the decoder used against one from-scratch forward, whether the run
could see a rollback bug (its acceptance histogram), the drafter oracle, acceptance against a
stored floor, and speed; under sampling a distributional test of the second new token.

A *method* is one decoder of the tree with one drafter class (and for a tree decoder one budget):
``methods.Method``. Each row names the decoder's file and function (``decoder``)."""

from __future__ import annotations

import contextlib

from . import acceptance_verdict as accept, calibration, coverage_runs, drafter_oracle, neartie, oracle, pair_reference, routers
from ..subjects.binding import BindError, bind_roles, call_generate, unsupported_sampling
from ..plumbing.events import emit, error_summary
from ..models.load import greedy, multi_token_consistent
from .rows import (MethodStats, drafter_calibration, drafter_check, first_partial, judge_drafter, lossless_check,  # noqa: F401
                   never_emitted, rollback_check)
from ..plumbing.shims import environment_failure, retried_without


#: prompts the target-alone baseline runs on (its tokens/s is the speedup's denominator)
BASELINE_PROMPTS = 4


def sampling_of(cfg: dict) -> dict | None:
    """The sampling options a run passes to the decoder, or None for greedy decoding."""
    if not cfg.get("temperature"):
        return None
    return {"temperature": cfg["temperature"], "top_p": cfg.get("top_p"), "top_k": cfg.get("top_k")}


def second_token_distribution(target, prompt, sampling: dict, max_first: int = 256, mass: float = 0.9999) -> dict[int, float]:
    """Exact P(second new token) under the target's own sampling:
    sum over the first token x0 of p(x0 | prompt) * p(x1 | prompt, x0)."""
    import torch

    with torch.inference_mode():
        p0 = oracle.sampling_distribution(target(prompt, use_cache=False).logits[0, -1], **sampling)
        probs, order = p0.sort(descending=True)
        keep = int(min(max_first, int((probs.cumsum(0) < mass).sum()) + 1))
        firsts, weights = order[:keep], probs[:keep] / probs[:keep].sum()
        total = torch.zeros_like(p0)
        for chunk in range(0, keep, 32):
            xs = firsts[chunk : chunk + 32]
            batch = torch.cat([prompt.expand(len(xs), -1), xs[:, None].to(prompt.device)], dim=1)
            p1 = oracle.sampling_distribution(target(batch, use_cache=False).logits[:, -1], **sampling)
            total += (weights[chunk : chunk + 32, None].to(p1.device) * p1).sum(0).to(total.device)
    return {int(t): float(p) for t, p in enumerate(total.tolist()) if p > 0}


def _decoder_row(check: dict, method) -> dict:
    """``check`` naming the method's decoder (file and function) and drafter class."""
    return {**check, "decoder": {"file": method.decoder["file"], "function": method.decoder["qualname"], "kind": method.kind,
                                 "drafter": method.drafter}}


def drafter_class_row(name: str, why: str, built_here: bool) -> dict:
    """``drafter class NAME``: a class the verifier had to build (a random preset's drafter) and could not is a failure
    naming what it lacked, since the decoders' paths through that class go unverified; one a ``--draft`` folder is
    not is reported (the user chose the folder)."""
    import re

    if not built_here:
        return {"check": f"drafter class {name}", "passed": True, "info": True, "evidence": f"not run on this model: {why}"}
    field = re.search(r"has no attribute '(\w+)'", why)
    what = (f"its code reads config.{field.group(1)}, which the verifier cannot make up for a scaled-down drafter"
            if field else why)
    return {"check": f"drafter class {name}", "passed": False, "evidence": (
        f"cannot build it from a scaled-down config: {what} ({why}); the decoders are not run with it: verify it on a "
        "checkpoint whose config.json has it (--target DIR --draft DIR)")}


def block_of(method, drafts: dict, block_size: int) -> int:
    """The block size a method decodes with: the run's, where its decoder takes one, else its drafter's own (a drafter's
    ``spec_generate`` that reads ``self.block_size``)."""
    draft = drafts.get(method.drafter)
    try:
        takes = "block_size" in bind_roles(method.callable_for(draft), method.required()).values()
    except BindError:
        takes = True
    own = getattr(draft, "block_size", None) or getattr(getattr(draft, "config", None), "block_size", None)
    return block_size if takes or not isinstance(own, int) else own


def warm_rows(methods: list, failed: dict) -> list[dict]:
    """``warms up`` for the model (its first failure's error, hint and what it does once shimmed, every failure named),
    and a failing ``warms up: METHOD`` row of each method that did not run: the others are judged on."""
    if not failed:
        return [{"check": "warms up", "passed": True, "evidence": "every method ran once"}]

    def text(method, err):
        return f"{method.name} ({method.where}): {err['error']}" + (f"; {err['then']['text']}" if err.get("then") else "")

    (m0, e0), *_ = failed.values()
    others = [m.name for m in methods if m.name not in failed]
    rows = [{"check": "warms up", "passed": False, **e0, "evidence": "; ".join(text(m, e) for m, e in failed.values())
             + (f"; {len(others)} other method(s) ran and are judged below" if others else "")}]
    rows += [_decoder_row({"check": f"warms up: {m.name}", "passed": False, **e, "evidence": text(m, e)}, m) for m, e in failed.values()]
    return rows


def verify_model(label: str, cfg: dict, loaded, target, drafts: dict, mask_token_id, is_preset: bool, prompts,
                 scripted: bool = False, choose_mask: bool = False, notes: dict | None = None) -> dict:
    import torch

    ScriptedDraft, compare = oracle.ScriptedDraft, oracle.compare

    checks: list[dict] = []
    block_size = cfg["block_size"]
    stop_ids = cfg.get("stop_token_ids") or None
    max_new = cfg["max_new_tokens"]
    sampling = sampling_of(cfg)
    dtype = str(target.dtype).replace("torch.", "")
    device = target.get_input_embeddings().weight.device
    prompts = [p.to(device) for p in prompts]
    budgets = set(cfg["tree_budgets"])
    methods = [m for m in loaded.methods if (m.kind != "tree" or m.budget in budgets) and (m.drafter is None or m.drafter in drafts)]
    for name, why in (notes or {}).items():
        checks.append(drafter_class_row(name, why, is_preset))

    # the reference continuations, then the noise floor on them: the tolerance follows this target, dtype and device
    # (greedy's own forwards give the noise floor's token-by-token rows and, for prompt 0, the drafter oracle's
    # token-by-token features: nothing computed twice)
    stepped = [[] for _ in prompts]
    hidden0: list | None = [] if drafts else None
    references = [greedy(target, p, max_new, stop_ids or (), rows=rows, hidden=hidden0 if i == 0 else None)
                  for i, (p, rows) in enumerate(zip(prompts, stepped))]
    if choose_mask:
        mask_token_id = never_emitted(target, prompts, references)
        for draft in drafts.values():
            draft.mask_token_id = mask_token_id
    cal = calibration.calibrate(target, prompts, references, override=cfg.get("logit_tolerance"), stepped=stepped)
    del stepped
    tolerance = cal.tolerance
    dcals = {name: drafter_calibration(target, draft, prompts[0], references[0], mask_token_id, block_size, hidden0)
             for name, draft in drafts.items()}
    del hidden0

    # (d) the reference itself is sound on this transformers version (within this dtype's near-ties)
    ref0 = references[0][:16]
    nocache = greedy(target, prompts[0], len(ref0), stop_ids or (), use_cache=False)
    v = compare(nocache, ref0)
    tie = neartie.judge_ties(nocache, ref0, oracle.reference_logits(target, prompts[0][0].tolist() + ref0), prompts[0].shape[1],
                             cal.epsilon, None, stop_ids or (), len(ref0))
    checks.append({"check": "cached greedy == no-cache greedy", "passed": tie.ok,
                   "evidence": v.describe() + ("" if v.identical else f"; {tie.describe()}")})
    same, diff = multi_token_consistent(target, prompts[0], ref0[: min(6, len(ref0))] or [0])
    checks.append({"check": "multi-token forward == token-by-token", "passed": same or diff <= tolerance,
                   "evidence": f"argmax {'equal' if same else 'DIFFERS'}, max |logit diff| {diff:.2e}"
                               + ("" if same else f" (tolerance {tolerance:.2e}: {'a near-tie' if diff <= tolerance else 'not a tie'})")})

    floor_check = {"check": "noise floor", "passed": cal.conclusive, "evidence": cal.describe(), "calibration": cal.as_dict()}
    if not cal.conclusive:
        command = calibration.float32_command(cfg)
        floor_check.update(inconclusive=True, float32_command=command, evidence=(
            f"inconclusive in {cal.dtype}: tolerance {cal.tolerance:.2e} exceeds {calibration.CONCLUSIVE_FRACTION:g} x the logit "
            f"spread {cal.spread:.2e}, a lossy commit could hide under it; judge it in float32: {command}; {cal.describe()}"))
    checks.append(floor_check)

    if sampling:  # a decoder that cannot take the requested sampling options is not run (and says so)
        skipped = [(m, unsupported_sampling(m.callable_for(drafts.get(m.drafter)), sampling, m.required())) for m in methods]
        skipped = [(m, keys) for m, keys in skipped if keys]
        if skipped:
            checks.append({"check": "sampling options", "passed": True, "evidence": "; ".join(
                f"{m.name} ({m.where}) not run: its decoder takes no {', '.join(keys)}" for m, keys in skipped)})
            methods = [m for m in methods if m not in [x for x, _ in skipped]]

    def run(method, prompt, reference, seed, max_new_tokens=max_new, logits=True):
        """One decode; returns (new tokens, acceptance lengths, seconds, logits verdict or None)."""
        draft = drafts.get(method.drafter)
        hook = script = None
        if draft is not None and (is_preset or scripted):
            script = ScriptedDraft(target, prompt[0].tolist() + reference, seed=seed, forbidden=[mask_token_id],
                                   from_distribution=sampling is not None)
            hook = script.attach(draft)
        if sampling:
            torch.manual_seed(10_000 + seed)
        recorder = oracle.LogitsRecorder(target)
        dcal, draft_skip = dcals.get(method.drafter, (None, "target-only: no drafter"))
        drafted = drafter_oracle.DrafterRecorder(draft, target) if logits and draft is not None and draft_skip is None else None
        try:
            with recorder if logits else contextlib.nullcontext(), drafted or contextlib.nullcontext(), coverage_runs.measuring(method):
                new, acceptance, secs = call_generate(
                    method.callable_for(draft), model=draft, target=target, input_ids=prompt, mask_token_id=mask_token_id,
                    max_new_tokens=max_new_tokens, block_size=block_size, stop_token_ids=stop_ids, tree_budget=method.budget,
                    sampling=sampling, required=method.required(),
                )
        finally:
            if hook is not None:
                hook.remove()
        verdict = ties = None
        final = prompt[0].tolist() + new
        if logits and not acceptance and method.kind != "target":  # the decoder keeps no statistics: read them off its forwards
            acceptance = oracle.observed_acceptance(recorder.calls, prompt.shape[1], len(final))
        if logits:
            forced = oracle.reference_logits(target, final)  # teacher-forced over the emitted tokens
            verdict = oracle.judge_logits(recorder.calls, final, forced, prompt.shape[1], tolerance)
            if not sampling:
                ties = neartie.judge_ties(reference, new, forced, prompt.shape[1], cal.epsilon, mask_token_id, stop_ids or (), max_new_tokens)
        run.drafter = judge_drafter(drafted, target, draft, final, mask_token_id, dcal, cfg.get("reviewed")) if logits and drafted else None
        run.ties = ties
        run.script = script
        return new, acceptance, secs, verdict

    # (b) warm-up: every method once; a failure that only the environment causes (CUDA timing, a missing optional
    # package) is shimmed and the method retried, so that the report names the first real failure too
    # every method once; one that fails (its own failing rows) does not stop the others from being judged
    short = prompts[0][:, :4]
    short_reference = greedy(target, short, max_new, stop_ids or ())  # once for every method
    failed_warm = {}
    for method in methods:
        try:
            run(method, short, short_reference, seed=-1, logits=False)
        except Exception as exc:  # the patched code failed to run at all
            err = error_summary(exc)
            env = environment_failure(exc)
            if env is not None:
                err["then"] = retried_without(env, lambda: run(method, short, short_reference, seed=-1, logits=False))
            failed_warm[method.name] = (method, err)
    checks += warm_rows(methods, failed_warm)
    methods = [m for m in methods if m.name not in failed_warm]
    if not methods:
        oracle.forget_plain()
        return {"model": label, "checks": checks, "methods": [], "calibration": cal.as_dict(), "logit_tolerance": tolerance}

    baseline_method = next((m for m in methods if m.kind == "chain" and not m.drafter_method and m.drafter == loaded.primary), None)
    baseline = MethodStats("target greedy (block_size=1)" if not sampling else "target sampling (block_size=1)")
    stats = {m.name: MethodStats(m.name) for m in methods}
    scripts = {m.name: [] for m in methods}
    total = len(prompts) * (1 + len(methods))
    done = 0
    for p_index, prompt in enumerate(prompts):
        reference = references[p_index]
        seed = cfg["seeds"][p_index % len(cfg["seeds"])] * 1000 + p_index
        if sampling:
            torch.manual_seed(10_000 + seed)
        if p_index >= cfg.get("baseline_prompts", BASELINE_PROMPTS):  # the speed baseline needs a few prompts, not all
            pass
        elif baseline_method is not None:
            new, _, secs = call_generate(
                baseline_method.fn, model=drafts[baseline_method.drafter], target=target, input_ids=prompt, mask_token_id=mask_token_id,
                max_new_tokens=max_new, block_size=1, stop_token_ids=stop_ids, sampling=sampling, strict=False,
            )
        else:  # no chain decoder: the target's own greedy decoding is the baseline
            import time

            start = time.perf_counter()
            new = greedy(target, prompt, max_new, stop_ids or ())
            secs = time.perf_counter() - start
        if p_index < cfg.get("baseline_prompts", BASELINE_PROMPTS):
            baseline.tokens += len(new)
            baseline.seconds += secs
            baseline.runs.append({"prompt": p_index, "verdict": compare(reference, new).as_dict() if not sampling else {"identical": True}})
        done += 1
        emit("progress", done=done, total=total, label=f"{label}: prompt {p_index + 1} baseline")
        for method in methods:
            try:
                new, acceptance, secs, logits = run(method, prompt, reference, seed)
            except Exception as exc:
                err = error_summary(exc)
                stats[method.name].runs.append({"prompt": p_index, "verdict": compare(reference, []).as_dict(), **err})
                continue
            if run.script is not None:
                scripts[method.name].append(run.script)
            st = stats[method.name]
            st.tokens += len(new)
            st.seconds += secs
            st.acceptance += acceptance
            partial_at = first_partial(acceptance, block_size)
            drafter_row = {"drafter": run.drafter.as_dict(), "drafter_description": run.drafter.describe()} if run.drafter else {}
            if sampling:  # sampled tokens have no greedy reference: the logits oracle judges them
                st.runs.append({"prompt": p_index, "verdict": {"identical": True}, "sampled": True, "logits": logits.as_dict(),
                                "logits_description": logits.describe(), "first_partial": partial_at, "acceptance": list(acceptance),
                                **drafter_row})
            else:
                verdict = compare(reference, new)
                st.runs.append({"prompt": p_index, "verdict": verdict.as_dict(), "description": verdict.describe(),
                                "logits": logits.as_dict(), "logits_description": logits.describe(),
                                "ties": run.ties.as_dict(), "ties_description": run.ties.describe(), "first_partial": partial_at,
                                "acceptance": list(acceptance), **drafter_row})
            done += 1
            emit("progress", done=done, total=total, label=f"{label}: prompt {p_index + 1} {method.name}")

    distributions: dict[str, dict] = {}
    if sampling and cfg.get("sampling_runs", 0) > 0:
        prompt = prompts[0]
        expected = second_token_distribution(target, prompt, {k: v for k, v in sampling.items() if v is not None})
        reference = greedy(target, prompt, max(2, block_size), stop_ids or ())
        for method in methods:
            counts: dict[int, int] = {}
            for i in range(cfg["sampling_runs"]):
                new, *_ = run(method, prompt, reference, seed=50_000 + i, max_new_tokens=2, logits=False)
                if len(new) > 1:
                    counts[new[1]] = counts.get(new[1], 0) + 1
            test = oracle.chi_square_test(counts, expected, alpha=cfg.get("alpha", 1e-3))
            distributions[method.name] = test.as_dict()
            emit("progress", done=done, total=total, label=f"{label}: {method.name} sampled {cfg['sampling_runs']} times")

    f32 = calibration.float32_command(cfg)
    floors = {}  # (drafter class, block size) -> (what a correct decoder reaches with it on these prompts, or None, why not)
    if not (is_preset or scripted) and not sampling:
        budgets_run = sorted({m.budget for m in methods if m.kind == "tree"})
        for key in dict.fromkeys((m.drafter, block_of(m, drafts, block_size)) for m in methods if m.kind != "target"):
            floors[key] = pair_reference.floor_for(
                cfg.get("acceptance_floor"), cfg.get("acceptance_floor_missing") or "no stored floor for this drafter",
                {**cfg, "block_size": key[1]}, dtype, target, drafts[key[0]], dcals[key[0]][0], prompts, references, budgets_run,
                progress=lambda text: emit("progress", done=done, total=total, label=f"{label}: {text}"))
    for method in methods:
        name, st = method.name, stats[method.name]
        rows = []
        failed_runs = [r for r in st.runs if "error" in r]
        if not sampling:
            rows.append(routers.inconclusive(lossless_check(name, st.runs), st.runs, dtype, f32))
        judged = [r for r in st.runs if "logits" in r]
        over = [r for r in judged if not r["logits"]["passed"]]
        worst = max(judged, key=lambda r: r["logits"]["max_abs"], default=None)
        if failed_runs and not judged:
            evidence = failed_runs[0].get("error", "failed")
        elif over:
            evidence = f"{len(over)}/{len(judged)} runs over tolerance; prompt {over[0]['prompt']}: {over[0]['logits_description']}"
        elif worst is not None:
            evidence = f"{len(judged)}/{len(judged)} runs within tolerance; worst: {worst['logits_description']}"
        else:
            evidence = "no run"
        rows.append(routers.inconclusive({"check": f"logits == from-scratch: {name}", "passed": bool(judged) and not over
                                          and not failed_runs, "evidence": evidence}, st.runs, dtype, f32))
        if method.kind != "target":
            described = "; ".join(dict.fromkeys(s.describe() for s in scripts[name][:1]))
            real = not (is_preset or scripted)
            row = rollback_check(name, st.acceptance, block_size, scripted=f"scripted draft: {described}" if described else "")
            if real and row.get("inconclusive") and cfg.get("target"):
                row["evidence"] += ("; a real drafter's rounds accept what it predicts: run the same command with --scripted-draft "
                                    "in place of --draft, whose scripted draft accepts part of its blocks")
            rows.append({**row, "real_drafter": real})
            dcal, draft_skip = dcals.get(method.drafter, (None, None))
            rows.append(routers.inconclusive(drafter_check(name, st.runs, draft_skip), st.runs, dtype, f32))
            if real and not sampling:  # a real drafter: every round against what a correct decoder reaches from its start
                block = block_of(method, drafts, block_size)
                floor_data, why_none = floors[(method.drafter, block)]
                rows.append(accept.method_check(name, st.runs, floor_data, why_none, {**cfg, "block_size": block}, dtype, references,
                                                rows[-1], method.kind, method.budget))
        if name in distributions:
            d = distributions[name]
            test = oracle.DistributionVerdict(d["statistic"], d["dof"], d["p_value"], d["samples"], d["alpha"])
            rows.append({"check": f"sampling distribution: {name}", "passed": test.passed,
                         "evidence": "2nd new token vs the target's exact distribution: " + test.describe()})
        checks += [_decoder_row(row, method) for row in rows]
    partial = [a for st in stats.values() for a in st.acceptance if 1 < a < block_size]
    method_rows = []
    for method in methods:
        st = stats[method.name]
        row = st.as_dict(baseline)
        row["decoder"] = {"file": method.decoder["file"], "function": method.decoder["qualname"], "kind": method.kind,
                          "drafter": method.drafter}
        judged = [r["logits"] for r in st.runs if "logits" in r]
        if judged:
            worst = max(judged, key=lambda v: v["max_abs"])
            row["max_dlogit"], row["max_dlogit_at"] = worst["max_abs"], worst["at"]
        if st.name in distributions:
            row["distribution"] = distributions[st.name]
        method_rows.append(row)
    oracle.forget_plain()  # this model's shared forwards: the next model's sequences are others
    return {
        "model": label,
        "checks": checks,
        "baseline": baseline.as_dict(None),
        "methods": method_rows,
        "partial_acceptances": len(partial),
        "plumbing_figures": is_preset,
        "sampling": sampling,
        "logit_tolerance": tolerance,
        "calibration": cal.as_dict(),
        "mask_token_id": mask_token_id,
        "prompts_made": cfg.get("prompts_made"),
        "drafter_calibration": {n: c.as_dict() for n, (c, _) in dcals.items() if c is not None} or None,
    }
