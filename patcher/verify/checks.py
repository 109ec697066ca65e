"""The checks on one model: the reference's own soundness, a warm-up, then per prompt and method
token identity, the logits the decoder used against one from-scratch forward, acceptance
lengths and speed; under sampling a distributional test of the second new token."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from . import acceptance as accept, calibration, drafter_oracle, neartie, oracle, routers
from .binding import call_generate, unsupported_sampling
from .events import emit, error_summary
from .models import greedy, multi_token_consistent


@dataclass
class MethodStats:
    name: str
    tokens: int = 0
    seconds: float = 0.0
    acceptance: list[int] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)

    def as_dict(self, baseline: "MethodStats | None") -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        out = {
            "method": self.name,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(tps, 2),
            "identical_runs": sum(r["verdict"]["identical"] for r in self.runs),
            "near_ties": sum(len(r.get("ties", {}).get("near_ties", [])) for r in self.runs if r.get("ties", {}).get("kind") == "near-tie"),
            "runs": self.runs,
        }
        if self.acceptance:
            hist: dict[int, int] = {}
            for a in self.acceptance:
                hist[a] = hist.get(a, 0) + 1
            out["acceptance_mean"] = round(sum(self.acceptance) / len(self.acceptance), 3)
            out["acceptance_histogram"] = {str(k): v for k, v in sorted(hist.items())}
        if baseline is not None and baseline.seconds and self.seconds and baseline.tokens:
            out["speedup"] = round((self.tokens / self.seconds) / (baseline.tokens / baseline.seconds), 3)
        return out


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


def verify_model(label: str, cfg: dict, fns: dict, target, draft, mask_token_id, is_preset: bool, prompts,
                 scripted: bool = False, choose_mask: bool = False) -> dict:
    import torch

    ScriptedDraft, compare = oracle.ScriptedDraft, oracle.compare

    checks: list[dict] = []
    block_size = cfg["block_size"]
    budgets = cfg["tree_budgets"]
    stop_ids = cfg.get("stop_token_ids") or None
    max_new = cfg["max_new_tokens"]
    sampling = sampling_of(cfg)
    dtype = str(target.dtype).replace("torch.", "")
    device = target.get_input_embeddings().weight.device
    prompts = [p.to(device) for p in prompts]

    # the reference continuations, then the noise floor on them: the tolerance follows this target, dtype and device
    references = [greedy(target, p, max_new, stop_ids or ()) for p in prompts]
    if choose_mask:
        mask_token_id = never_emitted(target, prompts, references)
        draft.mask_token_id = mask_token_id
    cal = calibration.calibrate(target, prompts, references, override=cfg.get("logit_tolerance"))
    tolerance = cal.tolerance
    dcal, draft_skip = drafter_calibration(target, draft, prompts[0], references[0], mask_token_id, block_size)

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

    methods = [("dflash", fns.get("dflash_generate"), None)]
    if fns.get("ddtree_generate") is not None:
        methods += [(f"ddtree_tb{b}", fns["ddtree_generate"], b) for b in budgets]
    methods = [m for m in methods if m[1] is not None]
    if sampling:  # a decoder that cannot take the requested sampling options is not run (and says so)
        skipped = [(name, unsupported_sampling(fn, sampling)) for name, fn, _ in methods]
        skipped = [(name, keys) for name, keys in skipped if keys]
        if skipped:
            checks.append({"check": "sampling options", "passed": True, "evidence": "; ".join(
                f"{name} not run: its decoder takes no {', '.join(keys)}" for name, keys in skipped)})
            methods = [m for m in methods if m[0] not in dict(skipped)]

    def run(name, fn, budget, prompt, reference, seed, max_new_tokens=max_new, logits=True):
        """One decode; returns (new tokens, acceptance lengths, seconds, logits verdict or None)."""
        hook = None
        if is_preset or scripted:
            script = ScriptedDraft(target, prompt[0].tolist() + reference, seed=seed, forbidden=[mask_token_id],
                                   from_distribution=sampling is not None)
            hook = script.attach(draft)
        if sampling:
            torch.manual_seed(10_000 + seed)
        recorder = oracle.LogitsRecorder(target)
        drafted = drafter_oracle.DrafterRecorder(draft, target) if logits and draft_skip is None else None
        try:
            with recorder if logits else contextlib.nullcontext(), drafted or contextlib.nullcontext():
                new, acceptance, secs = call_generate(
                    fn, model=draft, target=target, input_ids=prompt, mask_token_id=mask_token_id,
                    max_new_tokens=max_new_tokens, block_size=block_size, stop_token_ids=stop_ids, tree_budget=budget,
                    sampling=sampling,
                )
        finally:
            if hook is not None:
                hook.remove()
        verdict = ties = None
        if logits:
            final = prompt[0].tolist() + new
            forced = oracle.reference_logits(target, final)  # teacher-forced over the emitted tokens
            verdict = oracle.judge_logits(recorder.calls, final, forced, prompt.shape[1], tolerance)
            if not sampling:
                ties = neartie.judge_ties(reference, new, forced, prompt.shape[1], cal.epsilon, mask_token_id, stop_ids or (), max_new_tokens)
        run.drafter = judge_drafter(drafted, target, draft, final, mask_token_id, dcal) if logits and drafted else None
        run.ties = ties
        return new, acceptance, secs, verdict

    # (b) warm-up
    warm_ok, warm_error, warm_name = True, None, None
    try:
        for warm_name, fn, budget in methods:
            run(warm_name, fn, budget, prompts[0][:, :4], greedy(target, prompts[0][:, :4], max_new, stop_ids or ()), seed=-1, logits=False)
    except Exception as exc:  # the patched code failed to run at all
        warm_ok, warm_error = False, error_summary(exc)
    evidence = f"{warm_name}: {warm_error['error']}" if warm_error else "every method ran once"
    checks.append({"check": "warms up", "passed": warm_ok, **(warm_error or {}), "evidence": evidence})
    if not warm_ok:
        return {"model": label, "checks": checks, "methods": [], "calibration": cal.as_dict(), "logit_tolerance": tolerance}

    baseline = MethodStats("target greedy (block_size=1)" if not sampling else "target sampling (block_size=1)")
    stats = {name: MethodStats(name) for name, _, _ in methods}
    total = len(prompts) * (1 + len(methods))
    done = 0
    for p_index, prompt in enumerate(prompts):
        reference = references[p_index]
        seed = cfg["seeds"][p_index % len(cfg["seeds"])] * 1000 + p_index
        if sampling:
            torch.manual_seed(10_000 + seed)
        new, _, secs = call_generate(
            fns["dflash_generate"], model=draft, target=target, input_ids=prompt, mask_token_id=mask_token_id,
            max_new_tokens=max_new, block_size=1, stop_token_ids=stop_ids, sampling=sampling, strict=False,
        )
        baseline.tokens += len(new)
        baseline.seconds += secs
        baseline.runs.append({"prompt": p_index, "verdict": compare(reference, new).as_dict() if not sampling else {"identical": True}})
        done += 1
        emit("progress", done=done, total=total, label=f"{label}: prompt {p_index + 1} baseline")
        for name, fn, budget in methods:
            try:
                new, acceptance, secs, logits = run(name, fn, budget, prompt, reference, seed)
            except Exception as exc:
                err = error_summary(exc)
                stats[name].runs.append({"prompt": p_index, "verdict": compare(reference, []).as_dict(), **err})
                continue
            st = stats[name]
            st.tokens += len(new)
            st.seconds += secs
            st.acceptance += acceptance
            partial_at = first_partial(acceptance, block_size)
            if run.drafter is not None:
                drafter_row = {"drafter": run.drafter.as_dict(), "drafter_description": run.drafter.describe()}
            else:
                drafter_row = {}
            if sampling:  # sampled tokens have no greedy reference: the logits oracle judges them
                st.runs.append({"prompt": p_index, "verdict": {"identical": True}, "sampled": True, "logits": logits.as_dict(),
                                "logits_description": logits.describe(), "first_partial": partial_at, **drafter_row})
            else:
                verdict = compare(reference, new)
                st.runs.append({"prompt": p_index, "verdict": verdict.as_dict(), "description": verdict.describe(),
                                "logits": logits.as_dict(), "logits_description": logits.describe(),
                                "ties": run.ties.as_dict(), "ties_description": run.ties.describe(), "first_partial": partial_at,
                                "acceptance": list(acceptance), **drafter_row})
            done += 1
            emit("progress", done=done, total=total, label=f"{label}: prompt {p_index + 1} {name}")

    distributions: dict[str, dict] = {}
    if sampling and cfg.get("sampling_runs", 0) > 0:
        prompt = prompts[0]
        expected = second_token_distribution(target, prompt, {k: v for k, v in sampling.items() if v is not None})
        reference = greedy(target, prompt, max(2, block_size), stop_ids or ())
        for name, fn, budget in methods:
            counts: dict[int, int] = {}
            for i in range(cfg["sampling_runs"]):
                new, *_ = run(name, fn, budget, prompt, reference, seed=50_000 + i, max_new_tokens=2, logits=False)
                if len(new) > 1:
                    counts[new[1]] = counts.get(new[1], 0) + 1
            test = oracle.chi_square_test(counts, expected, alpha=cfg.get("alpha", 1e-3))
            distributions[name] = test.as_dict()
            emit("progress", done=done, total=total, label=f"{label}: {name} sampled {cfg['sampling_runs']} times")

    f32 = calibration.float32_command(cfg)
    for name, st in stats.items():
        failed_runs = [r for r in st.runs if "error" in r]
        if not sampling:
            checks.append(routers.inconclusive(lossless_check(name, st.runs), st.runs, dtype, f32))
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
        checks.append(routers.inconclusive({"check": f"logits == from-scratch: {name}", "passed": bool(judged) and not over
                                            and not failed_runs, "evidence": evidence}, st.runs, dtype, f32))
        checks.append(routers.inconclusive(drafter_check(name, st.runs, draft_skip), st.runs, dtype, f32))
        if not (is_preset or scripted):  # a real drafter: its acceptance, judged against a stored floor or reported
            checks.append(accept.method_check(name, st.runs, cfg.get("acceptance_floor"), cfg.get("acceptance_floor_missing") or
                                              "no stored floor for this drafter", cfg, dtype, references, checks[-1]))
        if name in distributions:
            d = distributions[name]
            test = oracle.DistributionVerdict(d["statistic"], d["dof"], d["p_value"], d["samples"], d["alpha"])
            checks.append({"check": f"sampling distribution: {name}", "passed": test.passed,
                           "evidence": "2nd new token vs the target's exact distribution: " + test.describe()})
    partial = [a for st in stats.values() for a in st.acceptance if 1 < a < block_size]
    method_rows = []
    for st in stats.values():
        row = st.as_dict(baseline)
        judged = [r["logits"] for r in st.runs if "logits" in r]
        if judged:
            worst = max(judged, key=lambda v: v["max_abs"])
            row["max_dlogit"], row["max_dlogit_at"] = worst["max_abs"], worst["at"]
        if st.name in distributions:
            row["distribution"] = distributions[st.name]
        method_rows.append(row)
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
        "drafter_calibration": dcal.as_dict() if dcal is not None else None,
    }


def drafter_calibration(target, draft, prompt, reference, mask_token_id, block_size):
    """(the drafter oracle's tolerances, None) or (None, why it cannot judge this drafter)."""
    try:
        return drafter_oracle.calibrate(target, draft, prompt, reference, mask_token_id, block_size), None
    except drafter_oracle.Unbindable as exc:
        return None, str(exc)
    except Exception as exc:  # a drafter the reference forward cannot drive
        return None, f"its from-scratch forward failed: {error_summary(exc)['error']}"


def judge_drafter(drafted, target, draft, final, mask_token_id, dcal):
    """The drafter oracle's verdict on one decode; a reference it cannot compute is a skip, not a pass."""
    try:
        return drafter_oracle.judge(drafted, target, draft, final, mask_token_id, dcal)
    except Exception as exc:
        return drafter_oracle.DrafterVerdict(skipped=f"its from-scratch reference failed: {error_summary(exc)['error']}")


def first_partial(acceptance: list[int], block_size: int) -> int | None:
    """The first new token decided after a round that rejected part of its block (None: every round accepted it all)."""
    done = 1  # the prefill decides new token 0; a round of acceptance a decides the next a
    for a in acceptance:
        done += a
        if a < block_size:  # the state now holds rejected tokens: the next round's logits read it
            return done
    return None


def lossless_check(name: str, runs: list[dict]) -> dict:
    """Token identity, with near-ties told from losses (``neartie``) and the mask-token event named."""
    kinds = [r.get("ties", {}).get("kind", "identical" if r["verdict"]["identical"] else "loss") for r in runs]
    identical = sum(r["verdict"]["identical"] for r in runs)
    lost = [r for r, k in zip(runs, kinds) if k == "loss" or "error" in r]
    masked = [r for r, k in zip(runs, kinds) if k == "mask-token"]
    tied = [r for r, k in zip(runs, kinds) if k in ("near-tie", "routing")]
    check = {"check": f"lossless: {name}", "passed": bool(runs) and not lost and not masked}
    if lost:
        first = lost[0]
        why = first.get("description") or first.get("error", "failed")
        if first.get("ties_description") and first["ties"]["kind"] == "loss":
            why += "; " + first["ties_description"]
        check["evidence"] = f"{len(lost)}/{len(runs)} runs differ; prompt {first['prompt']}: {why}"
    elif masked:
        check.update(inconclusive=True, evidence=f"prompt {masked[0]['prompt']}: {masked[0]['ties_description']}")
    elif tied:
        check["evidence"] = (f"{identical}/{len(runs)} runs token-identical, {len(tied)} within near-ties or routing flips; "
                             f"prompt {tied[0]['prompt']}: {tied[0]['ties_description']}")
    else:
        check["evidence"] = f"{len(runs)}/{len(runs)} runs token-identical"
    return check


def never_emitted(target, prompts, references) -> int:
    """A mask id for the scripted draft that the target's reference runs never emit: of the ids absent
    from every reference and every prompt, the one whose largest logit over the reference positions is lowest.
    Not a prompt id: upstream decoders drop the mask id from the whole row, prompt included."""
    import torch

    seen = {t for ref in references for t in ref} | {int(t) for prompt in prompts for t in prompt.flatten().tolist()}
    worst = None
    with torch.inference_mode():
        for prompt, ref in zip(prompts, references):
            ids = torch.cat([prompt, torch.tensor([ref], device=prompt.device)], dim=1) if ref else prompt
            top = target(ids, use_cache=False).logits[0].float().amax(dim=0).cpu().clone()
            worst = top if worst is None else torch.maximum(worst, top)
    worst = worst.clone()  # out of inference mode
    if seen:
        worst[list(seen)] = float("inf")
    return int(worst.argmin())


def drafter_check(name: str, runs: list[dict], skipped: str | None = None) -> dict:
    """The ``drafter: METHOD`` check over a method's runs (each may hold a ``drafter`` verdict): a drafter the oracle
    cannot bind, or a reference it cannot compute, is a visible ``skip``, never a pass."""
    check = {"check": f"drafter: {name}"}
    judged = [r for r in runs if "drafter" in r]
    skips = [r["drafter_description"] for r in judged if r["drafter"].get("skipped")]
    if skipped or (judged and len(skips) == len(judged)):
        return {**check, "passed": True, "skipped": True, "evidence": f"drafter oracle: skipped ({skipped})" if skipped else skips[0]}
    errors = [r for r in runs if "error" in r]
    over = [r for r in judged if not r["drafter"]["passed"]]
    if errors and not judged:
        evidence = errors[0].get("error", "failed")
    elif over:
        evidence = f"{len(over)}/{len(judged)} runs differ; prompt {over[0]['prompt']}: {over[0]['drafter_description']}"
        check["failures"] = over[0]["drafter"]["failures"][:8]
    elif judged:
        worst = {k: max(r["drafter"]["worst"].get(k, 0.0) for r in judged) for k in judged[0]["drafter"]["worst"]}
        top = [sum(r["drafter"]["top1"][i] for r in judged) for i in (0, 1)]
        evidence = (f"{len(judged)}/{len(judged)} runs, {sum(r['drafter']['rounds'] for r in judged)} drafter calls equal a "
                    "from-scratch drafter forward; max |Δ| " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
                    + f"; proposals {top[0]}/{top[1]}")
    else:
        evidence = "no run"
    return {**check, "passed": bool(judged) and not over and not errors, "evidence": evidence}
