"""The rows of a verify report that judge a method's runs: token identity (near-ties told from losses), the
drafter oracle's verdict, whether the run could see a rollback bug at all (its acceptance histogram), and the
mask id the scripted draft takes. ``checks.verify_model`` collects the runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import drafter_oracle, drafter_verdict
from ..plumbing.events import error_summary


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


def drafter_calibration(target, draft, prompt, reference, mask_token_id, block_size, stepped_hidden=None):
    """(the drafter oracle's tolerances, None) or (None, why it cannot judge this drafter)."""
    try:
        return drafter_oracle.calibrate(target, draft, prompt, reference, mask_token_id, block_size, stepped_hidden), None
    except drafter_oracle.Unbindable as exc:
        return None, str(exc)
    except Exception as exc:  # a drafter the reference forward cannot drive
        return None, f"its from-scratch forward failed: {error_summary(exc)['error']}"


def judge_drafter(drafted, target, draft, final, mask_token_id, dcal, reviewed=()):
    """The drafter oracle's verdict on one decode; a reference it cannot compute is a skip, not a pass."""
    try:
        return drafter_verdict.judge(drafted, target, draft, final, mask_token_id, dcal, tuple(reviewed or ()))
    except Exception as exc:
        return drafter_verdict.DrafterVerdict(skipped=f"its from-scratch reference failed: {error_summary(exc)['error']}")


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
    from .oracle import plain_forward

    with torch.inference_mode():
        for prompt, ref in zip(prompts, references):
            # the forward the oracles ask for again
            shared = plain_forward(target, prompt[0].tolist() + list(ref), hidden_states=True)
            if shared is not None:
                top = shared[0].amax(dim=0).clone()
            else:
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
        reviewed = [e for r in judged for e in r["drafter"].get("reviewed") or ()]
        if reviewed:
            fields = ", ".join(sorted({e["field"] for e in reviewed}))
            evidence += (f"; reviewed deliberate difference ({fields}) in {len(reviewed)} rounds, e.g. round {reviewed[0]['round']}: "
                         f"{reviewed[0]['detail']}")
    else:
        evidence = "no run"
    return {**check, "passed": bool(judged) and not over and not errors, "evidence": evidence}


def rollback_check(name: str, acceptance: list[int], block_size: int, where: str = "", scripted: str = "") -> dict:
    """``rollback seen: METHOD``: whether the run could see a rollback bug. A commit that keeps the wrong number of
    tokens shows only after a round that accepted part of its block; a run whose rounds all accepted one token (or all
    of it) passes whatever the commit does. Too few partial rounds, or too few distinct lengths, is *inconclusive*,
    never a pass."""
    hist: dict[int, int] = {}
    for a in acceptance:
        hist[a] = hist.get(a, 0) + 1
    shown = " ".join(f"{k}:{v}" for k, v in sorted(hist.items())) or "none"
    partial = [a for a in acceptance if (1 < a < block_size if block_size > 2 else a < block_size)]
    need = min(MIN_DISTINCT, block_size)
    check = {"check": f"rollback seen: {name}", "histogram": {str(k): v for k, v in sorted(hist.items())}}
    prefix = f"{where}: " if where else ""
    tail = f"; {scripted}" if scripted else ""
    if not acceptance:
        return {**check, "passed": False, "inconclusive": True, "evidence": f"{prefix}inconclusive: no round ran{tail}"}
    if not partial:
        why = ("no round accepted part of its block (1 < accepted < block size)" if block_size > 2 else "no round rejected a proposal")
        return {**check, "passed": False, "inconclusive": True, "evidence": (
            f"{prefix}inconclusive: the run could not see a rollback bug: {why}; accept histogram {shown}{tail}")}
    if len(hist) < need:
        return {**check, "passed": False, "inconclusive": True, "evidence": (
            f"{prefix}inconclusive: the run could not see a rollback bug: {len(hist)} distinct acceptance lengths, at least "
            f"{need} needed; accept histogram {shown}{tail}")}
    return {**check, "passed": True, "evidence": f"{prefix}{len(partial)} of {len(acceptance)} rounds accepted part of their block; "
                                                 f"accept histogram {shown}{tail}"}


def settle_rollback(result: dict | None) -> dict | None:
    """A real drafter's inconclusive ``rollback seen`` (a trained drafter accepts what it accepts: sampled, the trained
    pair's rounds mostly accept one token) passes when the same method's rollback was seen on another model of the
    run, naming where. A scripted draft's inconclusive row stays: the script is there to make rollback happen."""
    if not result:
        return result
    seen: dict[str, str] = {}
    for model in result.get("models", []):
        for c in model.get("checks", []):
            if c["check"].startswith("rollback seen: ") and c["passed"] and c["check"] not in seen:
                seen[c["check"]] = f"{model['model']}: {c['evidence']}"
    for model in result.get("models", []):
        for c in model.get("checks", []):
            if c.get("inconclusive") and c.get("real_drafter") and c["check"] in seen:
                here = c["evidence"].replace("inconclusive: the run could not see a rollback bug: ", "")
                c.update(passed=True, inconclusive=False, evidence=f"seen on {seen[c['check']]} (not here, a real drafter: {here})")
    return result


#: distinct acceptance lengths a method's rounds must show (block size permitting) for its run to see a rollback bug
MIN_DISTINCT = 3
