"""``ddpatch referee``'s text report, from the plain result of ``patcher.referee.run``."""

from __future__ import annotations


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def referee_text(result: dict) -> str:
    eng = result["engine"]
    out = [f"ddpatch referee · {eng['kind']} at {eng['url']} · model {eng.get('model') or '?'} · {result['seconds']:.1f} s",
           f"  pair: {result['target']} + {result['draft']}",
           f"  prompts: {result['prompts_made']} · {result['max_new_tokens']} new tokens each",
           "  acceptance: mean tokens a verification round commits, the bonus included (the engine's counters, converted; "
           "docs/engines.md)", ""]
    head = f"{'prompt':>6}  {'tokens':>13}  {'engine':>7}  {'reference':>9}  {'floor':>6}  counters"
    out.append(head)
    for r in result["per_prompt"]:
        same = "exact" if r["identical"] else ("?" if r["identical"] is None else f"differs at {r['first_difference']}")
        acc = r["acceptance"]
        how = f"{acc.get('accepted')} accepted / {acc.get('rounds')} rounds" + ("" if acc.get("exact") else " (rounds derived)")
        out.append(f"{r['prompt']:>6}  {same:>13}  {_f(r['engine']):>7}  {_f(r['reference']):>9}  {_f(r['floor']):>6}  {how}")
    v = result["verdict"]
    out.append("")
    name = {"dflash2": "DFlash2", "dspark": "DSpark"}.get(result.get("drafter_kind"), "DFlash")
    out.append(f"  overall: engine {_f(v.get('engine'))} · a correct {name} {_f(v.get('reference'))} tokens a round")
    if result.get("ddtree") and any(m is None for m in result["ddtree"].values()):
        out.append(f"  DDTree: not judged (no tree reference for a {name} drafter)")
    elif result.get("ddtree"):
        trees = ", ".join(f"budget {b}: {_f(m)}" for b, m in result["ddtree"].items())
        out.append(f"  a correct DDTree with this pair: {trees} (what an engine without trees gives up)")
    out.append(("PASS: " if v["passed"] else ("INCONCLUSIVE: " if v["kind"] == "inconclusive" else "FAIL: ")) + v["line"])
    return "\n".join(out) + "\n"
