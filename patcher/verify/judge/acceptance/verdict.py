"""``acceptance: METHOD``: is it the drafter or the integration?

A greedy target makes every round a function of its start alone (the new tokens committed before it): a
correct decoder that starts a round there sees the same context, block and target choices as ddpatch's
from-scratch reference, so it accepts one of the acceptances a drafter within epsilon of the reference's
could reach there (``reference_decode``: the reachable set, near-ties included). The check walks each run's
rounds from its own starts and judges every round, both ways:

- a round below its set loses acceptance (the drafter is fed or read wrong, the tree is built too small,
  the walk stops short);
- a round above its set accepts more than any correct tree could: the tree is not built as the algorithm
  says (a budget off by one, per-depth instead of path scores), which on a looping text is often the only
  symptom.

Every round inside its set means the run is one of the decodes the sets allow, so its mean is at or above the
floor (the lowest mean of any such decode): "the integration is exact: the drafter is the limit".

The floor is the stored one (the shipped pair's ``acceptance_floor.json``) or this run's (``pair_reference``);
rounds that start within the last block are not judged (trees shorten their last block: ``horizon_of``).
"""

from __future__ import annotations

from ...check import Check
from .floor import horizon_of, judged_rounds, not_applicable
from .reference_decode import floor, walk

#: a run whose correct rounds leave no room for a loss (every reachable set is {1}) cannot judge acceptance
NOTHING_TO_LOSE = 1


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _accepts(reach: list[int]) -> str:
    if len(reach) == 1:
        return str(reach[0])
    if reach == list(range(reach[0], reach[-1] + 1)):
        return f"{reach[0]} to {reach[-1]}"
    return " or ".join(map(str, reach))


def judge_prompt(acceptance: list[int], entry: dict, entry_p: dict, horizon: int) -> dict:
    """One run's rounds against its prompt's floor entry: each round at its own start, both sequences, the rounds off."""
    stop_at = entry_p["stop_at"] if entry_p.get("stop_at") is not None and entry_p["stop_at"] < horizon else None
    ref = walk(entry["at"], horizon, stop_at)
    mine = judged_rounds(acceptance, horizon)
    rounds, off, s = [], [], 0
    for i, a in enumerate(mine):
        reach = entry["reachable"][s] if s < len(entry["reachable"]) else None
        rounds.append({"round": i, "start": s, "accepted": a, "reachable": reach})
        if reach is not None and a not in reach:
            off.append({"round": i, "start": s, "accepted": a, "reachable": reach,
                        "way": "below" if a < min(reach) else "above" if a > max(reach) else "between"})
        s += a
    return {"mean": _mean(mine), "floor": floor(entry["reachable"], horizon, stop_at), "reference": _mean(ref),
            "rounds": len(mine), "reference_rounds": len(ref), "reference_total": sum(ref),
            "acceptance": mine, "reference_acceptance": ref, "judged": rounds, "off": off,
            "room": sum(1 for r in rounds if r["reachable"] is not None and min(r["reachable"]) > NOTHING_TO_LOSE),
            "sharp": sum(1 for r in rounds if r["reachable"] is not None and len(r["reachable"]) == 1 and r["reachable"][0] > 1),
            "tails": len(acceptance) - len(mine)}


def method_check(name: str, runs: list[dict], floor_data: dict | None, why_none: str, cfg: dict, dtype: str,
                 references: list[list[int]], drafter: dict, kind: str | None = None, budget: int | None = None) -> dict:
    """The ``acceptance: METHOD`` row: every round judged against what a correct decoder reaches from its start, or
    reported (``info``) where nothing can judge it. Any chain decoder is judged against the chain reference
    (``dflash``), any tree decoder at budget B against the tree's (``ddtree_tbB``)."""
    check: dict = {}  # the row's figures, in its order
    if kind is None:  # named the reference decoders' way: dflash, ddtree_tbB
        kind, budget = ("tree", int(name.rsplit("tb", 1)[1])) if name.startswith("ddtree_tb") else ("chain", None)
    done = [r for r in runs if r.get("acceptance")]
    lengths = [a for r in done for a in r["acceptance"]]
    mean = _mean(lengths)
    oracle = f"drafter oracle: {'skip' if drafter.get('skipped') else 'pass' if drafter.get('passed') else 'FAIL'}"
    stored = "dflash" if kind == "chain" else f"ddtree_tb{budget}"
    correct = "a correct DFlash" if kind == "chain" else "a correct tree"
    reason = why_none if floor_data is None else not_applicable(floor_data, cfg, dtype, budget if kind == "tree" else None)
    if not reason and stored not in floor_data["prompts"][0]["methods"]:
        reason = f"no reference for {stored}"
    info = {"passed": True, "info": True, "acceptance_mean": round(mean, 3)}
    if reason or not done:
        figures = f"mean {mean:.2f} over {len(lengths)} rounds" if done else "no run"
        return _row(name, info, evidence=f"{figures} ({reason or 'nothing to judge'}: reported, not judged); {oracle}")
    n = cfg["max_new_tokens"]
    h = horizon_of(n, cfg["block_size"])
    if h <= 0:
        return _row(name, info, evidence=f"mean {mean:.2f}: {n} new tokens leave no round a whole block before the end (block size "
                                    f"{cfg['block_size']}): reported, not judged; {oracle}")
    rows, left_out = [], []
    for r in done:
        p = r["prompt"]
        entry_p = floor_data["prompts"][p] if p < len(floor_data["prompts"]) else None
        if entry_p is None or references[p] != entry_p["greedy"][: len(references[p])] or not r["verdict"]["identical"]:
            left_out.append(p)
            continue
        rows.append({"prompt": p, **judge_prompt(r["acceptance"], entry_p["methods"][stored], entry_p, h)})
    source = "this run's reference" if floor_data.get("in_run") else "the stored floor"
    tails = sum(row.pop("tails") for row in rows)
    note = (f"; prompt(s) {', '.join(map(str, left_out))} left out (greedy continuation differs from the reference's)" if left_out else "")
    note += (f"; {tails} last round(s) left out (trees shorten their last block)" if tails else "")
    if not rows:
        return _row(name, info, evidence=f"mean {mean:.2f}: no prompt comparable with {source}{note}; {oracle}")
    ref_mean = sum(row.pop("reference_total") for row in rows) / sum(row["reference_rounds"] for row in rows)  # over rounds
    judged = sum(row["rounds"] for row in rows)
    room = sum(row["room"] for row in rows)
    sharp = sum(row.pop("sharp") for row in rows)
    mean_judged = _mean([a for row in rows for a in row["acceptance"]])
    check.update(acceptance_mean=round(mean, 3), judged_mean=round(mean_judged, 3), reference_mean=round(ref_mean, 3),
                 reference=source, judged_rounds=judged,
                 rounds_with_room=room, sharp_rounds=sharp, per_prompt=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
                                                    for row in rows])
    off = [(row, o) for row in rows for o in row["off"]]
    below = [row for row in rows if row["mean"] < row["floor"] - 1e-9]
    if off or below:
        row, first = off[0] if off else (below[0], None)
        where = (f"prompt {row['prompt']}, round {first['round']}, at new token {first['start'] + 1}: accepted {first['accepted']} "
                 f"where {correct} accepts {'at most ' if first['way'] == 'above' else ''}"
                 f"{max(first['reachable']) if first['way'] == 'above' else _accepts(first['reachable'])}") if first else ""
        if first is not None and first["way"] == "above" and not below:
            verdict = (f"the tree is not built as the algorithm says: {where} (mean {row['mean']:.2f} against the reference's "
                       f"{row['reference']:.2f})")
        else:
            b = below[0] if below else row
            verdict = (f"the integration loses acceptance: mean {b['mean']:.2f} < floor {b['floor']:.2f} on prompt {b['prompt']}" if below
                       else f"the integration loses acceptance: mean {row['mean']:.2f} (floor {row['floor']:.2f})")
            verdict += f"; first round that differs: {where}" if where else ""
        return _row(name, check, passed=False, verdict=verdict, evidence=(
            f"{verdict} ({len(off)} of {judged} rounds outside what {correct} reaches from their start; {source}){note}; {oracle}"))
    if room == 0:
        return _row(name, check, passed=False, inconclusive=True, verdict="inconclusive", evidence=(
            f"inconclusive: {correct} with this drafter accepts {NOTHING_TO_LOSE} token in every one of the {judged} rounds judged "
            f"(the drafter predicts nothing here), so no loss could show; judge a trained drafter, or rerun with --scripted-draft "
            f"in place of --draft for the rollback{note}; {oracle}"))
    verdict = "the integration is exact: the drafter is the limit"
    low = min(rows, key=lambda row: row["mean"] - row["floor"])
    sharpest = min(rows, key=lambda row: row["reference"] - row["floor"])
    power = sharpest["reference"] - sharpest["floor"]
    check["smallest_visible_loss"] = round(power, 3)
    weak = (f"; near-ties in {dtype} let a mean fall {power:.2f} below the reference unseen: judge in float32 for a sharper "
            f"verdict" if dtype != "float32" and power > 0.25 else "")
    return _row(name, check, passed=True, verdict=verdict, evidence=(
        f"{verdict}: every one of {judged} rounds accepts what {correct} could from its start (mean {mean_judged:.2f}, reference "
        f"{ref_mean:.2f}; closest to its floor: prompt {low['prompt']}, {low['mean']:.2f} against {low['floor']:.2f}; {source}); "
        f"a one-token loss fails in any of the {sharp} rounds without a near-tie, and a mean loss of more than {power:.2f} "
        f"tokens a round anywhere (prompt {sharpest['prompt']}){weak}{note}; {oracle}"))


def _row(name: str, figures: dict, **fields) -> dict:
    """The ``acceptance: METHOD`` row: its figures, then ``fields``, in that order."""
    return Check.of(f"acceptance: {name}", **figures, **fields).to_json()


def floors(loop) -> dict:
    """Per (drafter class, block size) of a real drafter's greedy run: (what a correct decoder reaches with it on these
    prompts, or None, why not): the stored floor where the pair has one, else this run's (``pair_reference``)."""
    from .pair_reference import floor_for

    found: dict = {}
    if not loop.real or loop.sampling:
        return found
    cfg, methods = loop.cfg, loop.methods
    budgets_run = sorted({m.budget for m in methods if m.kind == "tree"})
    for key in dict.fromkeys((m.drafter, loop.block_of(m)) for m in methods if m.kind != "target"):
        found[key] = floor_for(
            cfg.get("acceptance_floor"), cfg.get("acceptance_floor_missing") or "no stored floor for this drafter",
            {**cfg, "block_size": key[1]}, loop.dtype, loop.target, loop.drafts[key[0]], loop.dcals[key[0]][0], loop.prompts,
            loop.references, budgets_run, progress=loop.progress)
    return found


def method_rows(loop, method, earlier: list) -> list[dict]:
    """``acceptance: METHOD`` for a real drafter's greedy run: every round against what a correct decoder reaches from
    its start (``earlier[-1]`` is the method's drafter row, whose verdict the row names)."""
    if method.kind == "target" or not loop.real or loop.sampling:
        return []
    block = loop.block_of(method)
    floor_data, why_none = loop.floors[(method.drafter, block)]
    return [method_check(method.name, loop.stats[method.name].runs, floor_data, why_none, {**loop.cfg, "block_size": block},
                         loop.dtype, loop.references, earlier[-1], method.kind, method.budget)]
