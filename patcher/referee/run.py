"""``ddpatch referee``: a serving engine's speculative decoding beside a correct decoder's, with the same pair on the
same prompts.

1. The engine (``engines.connect``): its kind, that it speculates, that it tokenizes as the target does.
2. Each prompt, as the target's tokenizer makes it (``--prompts-file`` as verify reads it, else verify's built-in
   prompts), sent at temperature 0; its tokens and the engine's own acceptance counters, in one definition (mean
   tokens a verification round commits, the bonus included: ``counters.tokens_per_round``).
3. ddpatch's from-scratch reference on the same prompts (``reference``): the target's greedy tokens, what a correct
   DFlash accepts (and DDTree at each budget asked), and the near-tie floor, counted as the engine counts. A DFlash2 or
   DSpark drafter (its config's kind: ``drafter_kinds``) is judged by its own kind's chain, DDTree not judged.
4. Per prompt and overall: token identity (the first divergence), the two acceptances, the floor, and one verdict.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import PromptTooLong, RefereeError
from . import engines
from .reference import engine_accepted_range
from .ties import check_divergences

#: a probe text the engine and the target's tokenizer must split alike
PROBE = "The referee compares tokens: 12 apples, 7 pears; def f(x):\n    return x * 2"
#: engines count their last round their own way (vLLM counts it before trimming at a stop; SGLang's varies by
#: version): a prompt's acceptance may sit one token over its rounds from the reference's count and still be exact
LAST_ROUND_SLACK = 1.0


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


#: what makes each engine's counts exact where the referee had to derive them
EXACT_FLAG = {"llama.cpp": "llama-server --metrics", "vllm": "vllm serve --per-request-spec-decode-metrics summary",
              "sglang": "an SGLang whose meta_info counts the accepted drafts (spec_num_correct_drafts)"}


def judge_prompt(i: int, ref, answer, max_new_tokens: int, budgets, divergence=None, along=None) -> dict:
    """One prompt's row: identity against the target's greedy tokens (``divergence``: the target's verdict where they
    part, ``ties.judge``), and the engine's acceptance beside a correct DFlash's from the same starts (its mean, its
    floor within epsilon, its ceiling, and the accepted tokens it may reach), along the target's greedy or, after a
    near-tie, along the engine's own tokens (``along``). Plain data; ``judge_counts`` and ``verdict`` judge it."""
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
    row["tokens"] = "unknown" if got is None else ("identical" if row["identical"] else "differs")
    walk = ref
    if divergence is not None:
        row["divergence"] = divergence.as_dict()
        if divergence.ok:
            row["tokens"], walk = "near-tie", (along or ref)
        elif divergence.kind == "undecided":
            row["tokens"] = "undecided"
    row["reference_along"] = "engine" if walk is not ref else "target"
    from ..verify.judge.acceptance.reference_decode import floor, walk as rounds_of  # the one reference walk

    n = len(walk.greedy) if walk.stop_at is None else max_new_tokens
    stop = walk.stop_at
    chain = walk.chain  # the drafter kind's own chain reference (DFlash's; DFlash2's selector, DSpark's Markov head)
    rounds = rounds_of(chain["at"], n, stop, engine=True)
    row["reference"] = _mean(rounds)
    row["reference_rounds"] = len(rounds)
    row["floor"] = floor(chain["reachable"], n, stop, engine=True)
    row["ceiling"] = floor(chain["reachable"], n, stop, engine=True, lowest=False)
    reach = engine_accepted_range(chain["reachable"], n, stop)
    row["accepted_reference"] = list(reach) if reach else None
    span = answer.acceptance.span
    row["span"] = list(span) if span else None
    row["engine_range"] = [1 + span[0] / span[3], 1 + span[1] / span[2]] if span else None
    row["derived"] = span is not None and (span[0] != span[1] or span[2] != span[3])
    row["ddtree"] = {b: (_mean(rounds_of(walk.methods[f"ddtree_tb{b}"]["at"], n, stop, engine=True))
                         if f"ddtree_tb{b}" in walk.methods else None) for b in budgets}  # None: no tree reference for this kind
    row["room"] = any(min(r) > 1 for r in chain["reachable"][: max(0, n - 2)])
    return row


def judge_counts(r: dict) -> str:
    """A prompt's counts beside a correct DFlash's, for every value they may have: ``ok``, ``below`` (its floor),
    ``above`` (its ceiling) or ``undecided`` (some values one way, some the other). Exact counts: the mean against
    the floor and ceiling. Rounds derived, accepted tokens counted: the accepted tokens against the fewest and most a
    correct DFlash accepts over the same tokens (exact: with the tokens fixed, fewer accepted is more rounds). Sets
    ``judged_by``."""
    if r["engine"] is None or r["span"] is None:
        r["judged_by"] = None
        return "ok"
    a_lo, a_hi, _, _ = r["span"]
    slack = LAST_ROUND_SLACK / max(1, r["reference_rounds"])
    floor, ceiling = r["floor"], r["ceiling"]
    if r["derived"] and a_lo == a_hi and r["accepted_reference"]:
        r["judged_by"] = "accepted"
        lo, hi = r["accepted_reference"]
        return "below" if a_lo < lo - LAST_ROUND_SLACK else ("above" if a_lo > hi + LAST_ROUND_SLACK else "ok")
    r["judged_by"] = "range" if r["derived"] else "mean"
    low, high = r["engine_range"]
    if floor is not None and high < floor - slack:
        return "below"
    if ceiling is not None and low > ceiling + slack:
        return "above"
    if (floor is None or low >= floor - slack) and (ceiling is None or high <= ceiling + slack):
        return "ok"
    return "undecided"


def _fig(lo: float | None, hi: float | None) -> str:
    if lo is None:
        return "-"
    return f"{lo:.2f}" if hi is None or abs(hi - lo) < 0.005 else f"{lo:.2f} to {hi:.2f}"


def _shows(r: dict, side: str, word: str = "floor ") -> str:
    """One prompt's figure beside its floor (``side`` "below") or ceiling ("above"), as it was judged."""
    if r["judged_by"] == "accepted":
        lo, hi = r["accepted_reference"]
        bound = f"the fewest a correct DFlash accepts, {lo}" if side == "below" else f"the most a correct DFlash accepts, {hi}"
        return (f"{r['span'][0]} accepted {'<' if side == 'below' else '>'} {bound} (rounds derived: "
                f"{_fig(*r['engine_range'])} tokens a round)")
    low, high = r["engine_range"] or (r["engine"], r["engine"])
    if side == "below":
        return f"{_fig(low, high)} < {word}{r['floor']:.2f}"
    return f"{_fig(low, high)} > {r['ceiling']:.2f}"


def _derived_note(rows: list[dict], engine_kind: str) -> str:
    derived = [r for r in rows if r["derived"]]
    if not derived:
        return ""
    names = ", ".join(str(r["prompt"]) for r in derived)
    how = ("judged by their accepted tokens, which are counted, so the verdict holds for every round count the "
           "derivation allows" if all(r.get("judged_by") == "accepted" for r in derived) else "judged for every value the "
           "derivation allows")
    return f"; counts derived on prompt(s) {names}, {how} ({EXACT_FLAG.get(engine_kind, 'exact counters')} counts them)"


def gap(r: dict) -> list:
    """A prompt's (lowest, highest) tokens a round, for every value its counts may have."""
    return r["engine_range"] or [r["engine"]] * 2


def verdict(rows: list[dict], engine_kind: str, drafter: str = "DFlash") -> dict:
    """``_verdict``'s, its line naming the correct decoder of the drafter's kind (``drafter``: DFlash, DFlash2, DSpark)."""
    out = _verdict(rows, engine_kind)
    if drafter != "DFlash":
        out["line"] = out["line"].replace("correct DFlash", f"correct {drafter}")
    return out


def _verdict(rows: list[dict], engine_kind: str) -> dict:
    """The one line, and the exit code it means: 0 the engine reaches a correct DFlash's acceptance and is exact (or
    parts from the float32 greedy only at near-ties), 1 a finding (not lossless, loses acceptance, counts more than a
    correct DFlash could) or inconclusive (what could not be decided, and what decides it)."""
    pooled_accepted = sum((r["acceptance"].get("accepted") or 0) for r in rows)
    pooled_rounds = sum((r["acceptance"].get("rounds") or 0) for r in rows)
    engine = 1 + pooled_accepted / pooled_rounds if pooled_rounds else None
    spans = [r["span"] for r in rows if r.get("span")]
    low = 1 + sum(s[0] for s in spans) / sum(s[3] for s in spans) if spans else None
    high = 1 + sum(s[1] for s in spans) / sum(s[2] for s in spans) if spans else None
    ref_tokens = sum(r["reference"] * r["reference_rounds"] for r in rows)
    ref_rounds = sum(r["reference_rounds"] for r in rows)
    reference = ref_tokens / ref_rounds if ref_rounds else None
    out = {"engine": engine, "engine_range": [low, high], "reference": reference, "prompts": len(rows),
           "derived": [r["prompt"] for r in rows if r.get("derived")],
           "near_ties": [r["prompt"] for r in rows if r.get("tokens") == "near-tie"]}
    figure = _fig(low, high) if spans else _fig(engine, None)
    note = _derived_note(rows, engine_kind)
    differs = [r for r in rows if r.get("tokens", "differs" if r["identical"] is False else None) == "differs"]
    if differs:
        r = differs[0]
        d = r.get("divergence")
        why = (f": the target's margin there is {d['margin']:.4g} logits, outside every tolerance (ε {d['epsilon']:.4g}"
               + (f", {d['dtype']}'s measured {d['dtype_tolerance']:.4g}" if d.get("dtype") and d.get("dtype_tolerance") else "")
               + ")") if d and d.get("margin") == d.get("margin") and d.get("at") == r["first_difference"] else ""
        out.update(kind="not lossless", passed=False, line=(
            f"the engine's output differs from the target's greedy at token {r['first_difference']} (prompt {r['prompt']}"
            + (f": {r['got']} where the target takes {r['expected']}" if "got" in r else ": it stops early") + why
            + f"; {len(differs)} of {len(rows)} prompts differ): not lossless"))
        return out
    for r in rows:
        r["counts"] = judge_counts(r)
        r["below"], r["above"] = r["counts"] == "below", r["counts"] == "above"
    below = [r for r in rows if r["below"]]
    above = [r for r in rows if r["above"]]
    if below and above:
        worst_low = max(below, key=lambda r: r["floor"] - gap(r)[1])
        worst_high = max(above, key=lambda r: gap(r)[0] - r["ceiling"])
        out.update(kind="differs", passed=False, line=(
            f"the engine's acceptance is not a correct DFlash's prompt by prompt: {len(below)} of {len(rows)} prompts below their "
            f"floor (prompt {worst_low['prompt']}: {_shows(worst_low, 'below', '')}), {len(above)} above what a correct DFlash "
            f"reaches (prompt {worst_high['prompt']}: {_shows(worst_high, 'above')}), {figure} against {reference:.2f} "
            f"overall: the drafter is fed otherwise than the reference feeds it (its context features, its block){note}"))
    elif below:
        worst = max(below, key=lambda r: r["floor"] - gap(r)[1])
        out.update(kind="loses acceptance", passed=False, line=(
            f"the engine accepts {figure} where a correct DFlash accepts {reference:.2f}: the integration loses acceptance "
            f"({len(below)} of {len(rows)} prompts below their floor; prompt {worst['prompt']}: {_shows(worst, 'below')}){note}"))
    elif above:
        worst = max(above, key=lambda r: gap(r)[0] - r["ceiling"])
        out.update(kind="counts more", passed=False, line=(
            f"the engine reports {figure} tokens a round where a correct DFlash reaches at most {worst['ceiling']:.2f} on "
            f"prompt {worst['prompt']} ({_shows(worst, 'above')}): its counters count otherwise than {engine_kind}'s documented "
            f"definition, or it drafts more than the drafter's block{note}"))
    elif any(r.get("tokens") == "undecided" or r["counts"] == "undecided" for r in rows):
        parts = [f"prompt {r['prompt']}: parts from the target's greedy at token {r['divergence']['at']}, "
                 f"{r['divergence']['reason']}" for r in rows if r.get("tokens") == "undecided"]
        parts += [f"prompt {r['prompt']}: its derived counts give {_fig(*r['engine_range'])} tokens a round, across its floor "
                  f"{r['floor']:.2f}: {EXACT_FLAG.get(engine_kind, 'exact counters')} counts them" for r in rows
                  if r["counts"] == "undecided"]
        out.update(kind="inconclusive", passed=False, line="inconclusive: " + "; ".join(parts))
    elif not any(r["room"] for r in rows):
        out.update(kind="inconclusive", passed=False, line=(
            "inconclusive: a correct DFlash with this drafter accepts 1 token every round on these prompts, so no loss could "
            "show: referee a trained drafter"))
    else:
        ties = [r for r in rows if r.get("tokens") == "near-tie"]
        tie_note = "".join(
            f"; prompt {r['prompt']} parts from the target's float32 greedy at token {r['divergence']['at']} at a near-tie "
            f"({r['divergence']['got']} for {r['divergence']['expected']}: {r['divergence']['reason']}), judged along the "
            "engine's own tokens" for r in ties)
        out.update(kind="exact", passed=True, line=(
            f"the engine reaches a correct DFlash's acceptance with this pair: the drafter is the limit (engine {figure}, "
            f"reference {reference:.2f} tokens a round, every prompt at or above its floor{tie_note}{note})"))
    return out


def referee(engine_url: str, target: str, draft: str, *, records=None, source=None, prompts: int | None = None,
            max_new_tokens: int = 64, budgets=(8, 16), kind: str | None = None, api: str | None = None, dtype: str = "float32",
            timeout_s: float = 120.0, progress=None, engine_dtype: str | None = None) -> dict:
    """The referee's result (plain data): the engine, per prompt and overall, and the verdict. ``engine_dtype``: the
    dtype the engine computes in (``ties.ENGINE_DTYPES``); None: what the engine says of itself, if anything."""
    import torch  # noqa: F401  (the reference needs it: imported here, never when the CLI starts)

    from ..verify.judge.acceptance import floor as acceptance
    from ..verify.models.folders import check_pair
    from ..verify.models.load import target_tokenizer, tokenized_prompts
    from ..verify.plumbing.drafter_kinds import KIND_NAMES, kind_of_folder, referee_refusal
    from .reference import load_pair, references

    started = time.perf_counter()
    say = progress or (lambda text: None)
    check_pair(target, draft, refuse=referee_refusal)  # a kind the referee does not judge: one line, never a DFlash verdict
    drafter_kind = kind_of_folder(draft).kind
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
    precision = {"dtype": engine_dtype or info.dtype, "source": "--engine-dtype" if engine_dtype else info.dtype_source,
                 "quantized": None if engine_dtype else info.quantized}
    found, walks = check_divergences(tgt, drf, refs, answers, eps["logits"], budgets, stops, max_new_tokens,
                                     dtype=precision["dtype"], quantized=precision["quantized"],
                                     mask_token_id=eps.get("mask_token_id"), progress=say)
    rows = [judge_prompt(i, r, a, max_new_tokens, budgets, found[i], walks[i]) for i, (r, a) in enumerate(zip(refs, answers))]
    result = verdict(rows, info.kind, KIND_NAMES[drafter_kind])
    ddtree = {b: (None if any(r["ddtree"][b] is None for r in rows) else _mean([r["ddtree"][b] for r in rows])) for b in budgets}
    return {"engine": info.as_dict(), "target": str(Path(target)), "draft": str(Path(draft)), "prompts_made": made,
            "drafter_kind": drafter_kind, "max_new_tokens": max_new_tokens, "budgets": list(budgets), "epsilon": eps,
            "engine_precision": precision,
            "per_prompt": rows, "ddtree": ddtree,
            "verdict": result, "seconds": round(time.perf_counter() - started, 2)}


__all__ = ["RefereeError", "judge_counts", "judge_prompt", "referee", "verdict"]
