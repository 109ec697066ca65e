"""What a correct DFlash or DDTree reaches with THIS pair, on THIS run's prompts, dtype, block size and budgets.

A stored floor (``acceptance_floor.json``, the shipped trained pair's) is the fast path; any other pair gets
its floor here, in the run: ``reference_decode``'s from-scratch decoders evaluated at every round start of
each prompt's greedy continuation, with the set of acceptances a drafter within epsilon of this one could
reach there (``reference_decode.Positions``). The result has the stored floor's shape, so one check
(``acceptance.method_check``) judges both.

What it costs: one target forward per prompt (its hidden states give the drafter's context at every start:
the target is causal, so the features of the first ``s`` tokens are the first ``s`` rows of the whole
sequence's forward, to float rounding, which epsilon covers), then one drafter forward per start, over the
committed context and one block. The target's greedy continuation, which the run computed already, decides
every acceptance: a proposal is accepted iff it equals the target's greedy token.

Epsilon follows this run: the drafter oracle's measured output tolerance for this drafter, in this dtype,
times the LM head's largest row L1 norm (a drafter output within the tolerance moves a logit by at most that),
so a bfloat16 run gets its wider epsilon.
"""

from __future__ import annotations

from .reference_decode import ScratchPair, budget_of, chain_at, max_row_l1, tree_at

MADE_IN_RUN = "this run: ddpatch's from-scratch reference decoders (patcher/verify/judge/acceptance/reference_decode.py) on the run's prompts"


def epsilon_of(target, output_tolerance: float, logits_tolerance: float | None = None) -> dict:
    """Epsilon in logits. In float32: the drafter oracle's output tolerance (measured in this run) times this LM head's
    largest row L1 norm, a bound (|Δlogit| <= |Δhidden|_max x |row|_1) that costs nothing there (1e-3 logits on the
    shipped pair) and is the stored floor's own rule. In a low precision that bound spans the whole logit range (its
    output tolerance is 100x wider, and every drafter proposal would be a near-tie), so epsilon is the tolerance the
    oracle measured on the drafter's logits themselves (``logits_tolerance``: MULTIPLE x the largest logit gap between
    two exact computations of the same block), where that is the smaller."""
    row = max_row_l1(target.get_output_embeddings())
    bound = output_tolerance * row
    out = {"logits": bound, "output_tolerance": output_tolerance, "lm_head_max_row_l1": row,
           "rule": "this run's drafter oracle output tolerance x largest |LM head row|_1"}
    if logits_tolerance is not None and logits_tolerance < bound:
        out.update(logits=logits_tolerance, bound=bound, rule="this run's drafter oracle tolerance on the drafter's logits "
                                                              "(MULTIPLE x the measured gap between two exact computations)")
    return out


def context_features(pair: ScratchPair, seq: list[int]):
    """The drafter's context features of every position of ``seq`` (``hidden_states[layer_id + 1]``), one forward."""
    import torch

    with torch.inference_mode():
        hs = pair.target(pair._ids(seq), use_cache=False, output_hidden_states=True).hidden_states
        return torch.cat([hs[i + 1][0].to(pair.device) for i in pair.layer_ids], -1)[None].to(pair.dtype)


def draft_logits_at(pair: ScratchPair, features, seq: list[int], s: int):
    """``ScratchPair.draft_logits`` for the round that starts at ``seq[s]``, from precomputed context features."""
    import torch

    from ..drafter.recorder import embedding_scale, reference_output

    with torch.inference_mode():
        noise = (pair.embed(pair._ids([seq[s]] + [pair.mask_id] * (pair.block_size - 1))) * embedding_scale(pair.draft)).to(pair.dtype)
        positions = torch.arange(s + pair.block_size, device=pair.device)[None]
        out = reference_output(pair.draft, pair.roles, features[:, :s], noise, positions)
        w = pair.head.weight
        return pair.head(out[1:].to(w.device, w.dtype)).float().cpu()


def methods_for(budgets) -> list[str]:
    return ["dflash"] + [f"ddtree_tb{b}" for b in sorted(set(budgets))]


def prompt_entry(pair: ScratchPair, prompt: list[int], greedy: list[int], methods: list[str], horizon: int, eps: float,
                 stop_ids=()) -> dict:
    """One prompt's entry of a floor: at every start ``s`` before ``horizon`` (new tokens committed before the round),
    per method the from-scratch acceptance and the reachable set. Starts past the end of ``greedy`` (a stop token)
    are never reached; they hold ``[1]``."""
    seq = list(prompt) + list(greedy)
    features = context_features(pair, seq)
    P, q = len(prompt), pair.block_size - 1
    entry = {"ids": list(prompt), "greedy": list(greedy), "methods": {m: {"at": [], "reachable": []} for m in methods},
             "stop_at": next((j for j, t in enumerate(greedy) if t in set(stop_ids)), None)}
    for s in range(horizon):
        if s + 1 >= len(greedy):  # the continuation ended (a stop token): no round starts here
            for m in methods:
                entry["methods"][m]["at"].append(1)
                entry["methods"][m]["reachable"].append([1])
            continue
        logits = draft_logits_at(pair, features, seq, P + s)
        gold = greedy[s + 1 : s + 1 + q]
        for m in methods:
            a, reach = chain_at(logits, gold, eps) if m == "dflash" else tree_at(logits, gold, budget_of(m), eps)
            entry["methods"][m]["at"].append(a)
            entry["methods"][m]["reachable"].append(reach)
    return entry


def in_run_floor(target, draft, prompts: list[list[int]], references: list[list[int]], *, block_size: int, budgets,
                 max_new_tokens: int, stop_ids, output_tolerance: float, dtype: str, progress=None,
                 logits_tolerance: float | None = None) -> dict:
    """The floor data of this run (the stored floor's shape): per prompt its greedy continuation and, per method
    (``dflash``, ``ddtree_tbB``), at every start judged the reference's acceptance and the reachable set."""
    from .floor import horizon_of

    pair = ScratchPair(target, draft, draft.mask_token_id, block_size)
    methods = methods_for(budgets)
    eps = epsilon_of(target, output_tolerance, logits_tolerance)
    h = horizon_of(max_new_tokens, block_size)
    out = []
    for i, (prompt, greedy) in enumerate(zip(prompts, references)):
        out.append(prompt_entry(pair, prompt, greedy, methods, h, eps["logits"], stop_ids))
        if progress is not None:
            progress(f"reference: prompt {i + 1}/{len(prompts)}")
    return {"made_by": MADE_IN_RUN, "in_run": True, "epsilon": eps, "prompts": out,
            "settings": {"dtype": dtype, "greedy": True, "block_size": block_size, "budgets": sorted(set(budgets)),
                         "max_new_tokens": max_new_tokens, "stop_token_ids": list(stop_ids or [])}}


def floor_for(stored: dict | None, why_missing: str, cfg: dict, dtype: str, target, draft, dcal, prompts, references,
              budgets, progress=None) -> tuple[dict | None, str]:
    """(the floor this run is judged against, '') or (None, why none): the stored one where it covers the run (the
    fast path), else this run's own from the reference decoders; none only where the drafter oracle cannot drive the
    drafter (its from-scratch forward is the reference's)."""
    from .floor import not_applicable

    if stored is not None:
        why = not_applicable(stored, cfg, dtype, None) or next(
            (f"no stored floor for tree budget {b}" for b in budgets if b not in stored["settings"]["budgets"]), None)
        if why is None and [p[0].tolist() for p in prompts] != [e["ids"] for e in stored["prompts"][: len(prompts)]]:
            why = "the run's prompts are not the stored floor's"
        if why is None:
            return stored, ""
    else:
        why = why_missing
    if dcal is None:
        return None, f"{why}, and the reference decoders cannot drive this drafter"
    low = dtype != "float32" and "logits" in dcal.tolerances  # float32 keeps the stored floor's rule (the two agree)
    data = in_run_floor(target, draft, [p[0].tolist() for p in prompts], references, block_size=cfg["block_size"], budgets=budgets,
                        max_new_tokens=cfg["max_new_tokens"], stop_ids=cfg.get("stop_token_ids") or (),
                        output_tolerance=dcal.tolerances["output"], dtype=dtype, progress=progress,
                        logits_tolerance=dcal.tolerances["logits"] if low else None)
    data["instead_of_stored"] = why if stored is not None else None
    return data, ""
