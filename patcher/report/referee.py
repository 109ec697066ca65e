"""``ddpatch referee``'s text report, from the plain result of ``patcher.referee.run`` and its verdict as a ``Check``."""

from __future__ import annotations

from ..verify.check import Check

#: the word a verdict's status is shown with
WORDS = {"pass": "PASS: ", "inconclusive": "INCONCLUSIVE: ", "fail": "FAIL: "}


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def verdict_check(result: dict) -> Check:
    """The referee's verdict as the one check type every report renders: ``referee: KIND`` passed (or failed, or was
    inconclusive) on the verdict's line, its figures (engine, reference, the prompts derived or at a near-tie) kept.
    The JSON ``ddpatch referee --format json`` writes is the plain result, as before."""
    v = dict(result.get("verdict") or {})
    kind = (result.get("engine") or {}).get("kind", "engine")
    figures = {k: x for k, x in v.items() if k not in ("passed", "line")}
    if v.get("kind") == "inconclusive":
        figures["inconclusive"] = True
    return Check.of(f"referee: {kind}", passed=bool(v.get("passed")), evidence=v.get("line"), **figures)


def referee_text(result: dict) -> str:
    eng = result["engine"]
    out = [f"ddpatch referee · {eng['kind']} at {eng['url']} · model {eng.get('model') or '?'} · {result['seconds']:.1f} s",
           f"  pair: {result['target']} + {result['draft']}",
           f"  prompts: {result['prompts_made']} · {result['max_new_tokens']} new tokens each",
           "  acceptance: mean tokens a verification round commits, the bonus included (the engine's counters, converted; "
           "docs/engines.md)", ""]
    head = f"{'prompt':>6}  {'tokens':>13}  {'engine':>11}  {'reference':>9}  {'floor':>6}  counters"
    out.append(head)
    for r in result["per_prompt"]:
        same = "exact" if r["identical"] else ("?" if r["identical"] is None else f"differs at {r['first_difference']}")
        if r.get("tokens") in ("near-tie", "undecided"):  # parts from the float32 greedy where the target barely decides
            same = f"{r['tokens']} at {r['first_difference']}"
        acc = r["acceptance"]
        how = f"{acc.get('accepted')} accepted / {acc.get('rounds')} rounds" + ("" if acc.get("exact") else " (rounds derived)")
        engine = _f(r["engine"])
        if r.get("derived") and r.get("engine_range"):  # every value the derivation allows
            low, high = r["engine_range"]
            engine = f"{_f(low)}-{_f(high)}" if abs(high - low) >= 0.005 else _f(low)
        out.append(f"{r['prompt']:>6}  {same:>13}  {engine:>11}  {_f(r['reference']):>9}  {_f(r['floor']):>6}  {how}")
    v = result["verdict"]
    out.append("")
    name = {"dflash2": "DFlash2", "dspark": "DSpark"}.get(result.get("drafter_kind"), "DFlash")
    out.append(f"  overall: engine {_f(v.get('engine'))} · a correct {name} {_f(v.get('reference'))} tokens a round")
    if result.get("ddtree") and any(m is None for m in result["ddtree"].values()):
        out.append(f"  DDTree: not judged (no tree reference for a {name} drafter)")
    elif result.get("ddtree"):
        trees = ", ".join(f"budget {b}: {_f(m)}" for b, m in result["ddtree"].items())
        out.append(f"  a correct DDTree with this pair: {trees} (what an engine without trees gives up)")
    check = verdict_check(result)
    out.append(WORDS.get(check.status, "FAIL: ") + check.evidence)
    return "\n".join(out) + "\n"
