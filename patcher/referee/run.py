"""``ddpatch referee``: a serving engine's speculative decoding beside a correct decoder's, with the same pair on the
same prompts.

1. The engine (``engines.connect``): its kind, that it speculates, that it tokenizes as the target does.
2. Each prompt, as the target's tokenizer makes it (``--prompts-file`` as verify reads it, else verify's built-in
   prompts), sent at temperature 0; its tokens and the engine's own acceptance counters, in one definition (mean
   tokens a verification round commits, the bonus included: ``counters.tokens_per_round``).
3. ddpatch's from-scratch reference on the same prompts (``reference``): the target's greedy tokens, what a correct
   DFlash accepts (and DDTree at each budget asked), and the near-tie floor, counted as the engine counts.
4. Per prompt and overall: token identity (the first divergence), the two acceptances, the floor, and one verdict.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import PromptTooLong, RefereeError
from . import engines
from .reference import engine_floor, engine_rounds

#: a probe text the engine and the target's tokenizer must split alike
PROBE = "The referee compares tokens: 12 apples, 7 pears; def f(x):\n    return x * 2"
#: engines count their last round their own way (vLLM counts it before trimming at a stop; SGLang's varies by
#: version): a prompt's acceptance may sit one token over its rounds from the reference's count and still be exact
LAST_ROUND_SLACK = 1.0


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def judge_prompt(i: int, ref, answer, max_new_tokens: int, budgets) -> dict:
    """One prompt: identity against the target's greedy tokens, and the engine's acceptance against a correct
    DFlash's from the same starts (its mean, its floor within epsilon, and its ceiling)."""
    greedy = ref.greedy
    got = answer.output_ids
    row = {"prompt": i, "prompt_tokens": len(ref.ids), "engine_tokens": len(got) if got is not None else None,
           "acceptance": answer.acceptance.as_dict(), "engine": answer.acceptance.tokens_per_round}
    if got is None:
        row["identical"], row["first_difference"] = None, None
    else:
        mine = got[: len(greedy)]
        at = engines.first_difference(mine, greedy[: len(mine)])
        short = len(got) < len(greedy) and not (ref.stop_at is not None and len(got) >= ref.stop_at)
        row["identical"] = at is None and not short
        row["first_difference"] = at if at is not None else (len(got) if short else None)
        if at is not None:
            row["expected"], row["got"] = greedy[at], got[at]
    n = len(greedy) if ref.stop_at is None else max_new_tokens
    stop = ref.stop_at
    chain = ref.methods["dflash"]
    rounds = engine_rounds(chain["at"], n, stop)
    row["reference"] = _mean(rounds)
    row["reference_rounds"] = len(rounds)
    row["floor"] = engine_floor(chain["reachable"], n, stop)
    row["ceiling"] = engine_floor(chain["reachable"], n, stop, lowest=False)
    row["ddtree"] = {b: _mean(engine_rounds(ref.methods[f"ddtree_tb{b}"]["at"], n, stop)) for b in budgets}
    row["room"] = any(min(r) > 1 for r in chain["reachable"][: max(0, n - 2)])
    return row


def verdict(rows: list[dict], engine_kind: str) -> dict:
    """The one line, and the exit code it means: 0 the engine reaches a correct DFlash's acceptance and is exact,
    1 a finding (not lossless, loses acceptance, counts more than a correct DFlash could) or inconclusive."""
    pooled_accepted = sum((r["acceptance"].get("accepted") or 0) for r in rows)
    pooled_rounds = sum((r["acceptance"].get("rounds") or 0) for r in rows)
    engine = 1 + pooled_accepted / pooled_rounds if pooled_rounds else None
    ref_tokens = sum(r["reference"] * r["reference_rounds"] for r in rows)
    ref_rounds = sum(r["reference_rounds"] for r in rows)
    reference = ref_tokens / ref_rounds if ref_rounds else None
    out = {"engine": engine, "reference": reference, "prompts": len(rows)}
    differs = [r for r in rows if r["identical"] is False]
    if differs:
        r = differs[0]
        out.update(kind="not lossless", passed=False, line=(
            f"the engine's output differs from the target's greedy at token {r['first_difference']} (prompt {r['prompt']}"
            + (f": {r['got']} where the target takes {r['expected']}" if "got" in r else ": it stops early")
            + f"; {len(differs)} of {len(rows)} prompts differ): not lossless"))
        return out
    for r in rows:
        slack = LAST_ROUND_SLACK / max(1, r["reference_rounds"])
        r["below"] = r["engine"] is not None and r["floor"] is not None and r["engine"] < r["floor"] - slack
        r["above"] = r["engine"] is not None and r["ceiling"] is not None and r["engine"] > r["ceiling"] + slack
    below = [r for r in rows if r["below"]]
    above = [r for r in rows if r["above"]]
    if below and above:
        low = min(below, key=lambda r: r["engine"] - r["floor"])
        high = max(above, key=lambda r: r["engine"] - r["ceiling"])
        out.update(kind="differs", passed=False, line=(
            f"the engine's acceptance is not a correct DFlash's prompt by prompt: {len(below)} of {len(rows)} prompts below their "
            f"floor (prompt {low['prompt']}: {low['engine']:.2f} < {low['floor']:.2f}), {len(above)} above what a correct DFlash "
            f"reaches (prompt {high['prompt']}: {high['engine']:.2f} > {high['ceiling']:.2f}), {engine:.2f} against {reference:.2f} "
            "overall: the drafter is fed otherwise than the reference feeds it (its context features, its block)"))
    elif below:
        worst = min(below, key=lambda r: r["engine"] - r["floor"])
        out.update(kind="loses acceptance", passed=False, line=(
            f"the engine accepts {engine:.2f} where a correct DFlash accepts {reference:.2f}: the integration loses acceptance "
            f"({len(below)} of {len(rows)} prompts below their floor; prompt {worst['prompt']}: {worst['engine']:.2f} < floor "
            f"{worst['floor']:.2f})"))
    elif above:
        worst = max(above, key=lambda r: r["engine"] - r["ceiling"])
        out.update(kind="counts more", passed=False, line=(
            f"the engine reports {engine:.2f} tokens a round where a correct DFlash reaches at most {worst['ceiling']:.2f} on "
            f"prompt {worst['prompt']} ({worst['engine']:.2f}): its counters count otherwise than {engine_kind}'s documented "
            "definition, or it drafts more than the drafter's block"))
    elif not any(r["room"] for r in rows):
        out.update(kind="inconclusive", passed=False, line=(
            "inconclusive: a correct DFlash with this drafter accepts 1 token every round on these prompts, so no loss could "
            "show: referee a trained drafter"))
    else:
        out.update(kind="exact", passed=True, line=(
            f"the engine reaches a correct DFlash's acceptance with this pair: the drafter is the limit (engine {engine:.2f}, "
            f"reference {reference:.2f} tokens a round, every prompt at or above its floor)"))
    return out


def referee(engine_url: str, target: str, draft: str, *, records=None, source=None, prompts: int | None = None,
            max_new_tokens: int = 64, budgets=(8, 16), kind: str | None = None, api: str | None = None, dtype: str = "float32",
            timeout_s: float = 120.0, progress=None) -> dict:
    """The referee's result (plain data): the engine, per prompt and overall, and the verdict."""
    import torch  # noqa: F401  (the reference needs it: imported here, never when the CLI starts)

    from ..verify.judge.acceptance import floor as acceptance
    from ..verify.models.folders import check_pair
    from ..verify.models.load import target_tokenizer, tokenized_prompts
    from .reference import load_pair, references

    started = time.perf_counter()
    say = progress or (lambda text: None)
    check_pair(target, draft)
    client = engines.connect(engine_url, kind, **({"api": api} if api else {}), timeout_s=timeout_s)
    info = client.info()
    tok = target_tokenizer({"target": target})
    if tok is not None:
        client.check_tokenizer(PROBE, list(tok.encode(PROBE, add_special_tokens=False)))
    say(f"{info.kind} at {client.url}: loading the pair")
    tgt, drf = load_pair(target, draft, dtype)
    cfg = {"target": target, "prompt_records": records, "prompts_source": source or {}, "prompts": prompts or 4, "prompt_len": 8,
           "seeds": [0], "max_new_tokens": max_new_tokens}
    vocab = tgt.config.get_text_config(decoder=True).vocab_size
    ids, stops, made = tokenized_prompts(cfg, cfg["prompts"], vocab, tgt)
    ids = [p[0].tolist() for p in ids]
    stored, _ = acceptance.find({"target": target, "draft": draft})
    if stored is not None and not records:  # a pair with a stored floor: its held-out prompts, as verify runs it
        ids = acceptance.prompts_of(stored, prompts or len(stored["prompts"]))
        made = f"{len(ids)} held-out prompt(s) of the pair's stored acceptance floor"
    if info.context_length:
        for i, p in enumerate(ids):
            if len(p) + max_new_tokens > info.context_length:
                raise PromptTooLong(f"prompt {i} is {len(p)} tokens: with {max_new_tokens} new ones it exceeds the engine's context "
                                    f"of {info.context_length} tokens")
    answers = []
    for i, p in enumerate(ids):
        say(f"{info.kind}: prompt {i + 1}/{len(ids)}")
        answers.append(client.generate(p, max_new_tokens))
    refs, eps = references(tgt, drf, ids, max_new_tokens, budgets, stops, progress=say)
    rows = [judge_prompt(i, r, a, max_new_tokens, budgets) for i, (r, a) in enumerate(zip(refs, answers))]
    result = verdict(rows, info.kind)
    ddtree = {b: _mean([r["ddtree"][b] for r in rows]) for b in budgets}
    return {"engine": info.as_dict(), "target": str(Path(target)), "draft": str(Path(draft)), "prompts_made": made,
            "max_new_tokens": max_new_tokens, "budgets": list(budgets), "epsilon": eps, "per_prompt": rows, "ddtree": ddtree,
            "verdict": result, "seconds": round(time.perf_counter() - started, 2)}


__all__ = ["referee", "verdict", "judge_prompt", "RefereeError"]
