"""The rollback oracle: could the run see a rollback bug at all? A commit that keeps the wrong number of tokens
shows only after a round that accepted part of its block; the run's acceptance histogram (its recorder: the
acceptance lengths each decode returns, or the logits oracle reads off its forwards) says whether such rounds ran.

``rollback_check`` is the verdict and the ``rollback seen: METHOD`` row, ``method_rows`` names the scripted draft
that made the rounds (or, for a real drafter, the command that scripts one), ``settle_rollback`` is the parent's
settling over the models of a run."""

from __future__ import annotations

from ..check import Check


def first_partial(acceptance: list[int], block_size: int) -> int | None:
    """The first new token decided after a round that rejected part of its block (None: every round accepted it all)."""
    done = 1  # the prefill decides new token 0; a round of acceptance a decides the next a
    for a in acceptance:
        done += a
        if a < block_size:  # the state now holds rejected tokens: the next round's logits read it
            return done
    return None


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
    histogram = {str(k): v for k, v in sorted(hist.items())}
    prefix = f"{where}: " if where else ""
    tail = f"; {scripted}" if scripted else ""
    if not acceptance:
        evidence = f"{prefix}inconclusive: no round ran{tail}"
    elif not partial:
        why = ("no round accepted part of its block (1 < accepted < block size)" if block_size > 2 else "no round rejected a proposal")
        evidence = f"{prefix}inconclusive: the run could not see a rollback bug: {why}; accept histogram {shown}{tail}"
    elif len(hist) < need:
        evidence = (f"{prefix}inconclusive: the run could not see a rollback bug: {len(hist)} distinct acceptance lengths, at least "
                    f"{need} needed; accept histogram {shown}{tail}")
    else:
        return Check.of(f"rollback seen: {name}", histogram=histogram, passed=True, evidence=(
            f"{prefix}{len(partial)} of {len(acceptance)} rounds accepted part of their block; accept histogram {shown}{tail}")).to_json()
    return Check.of(f"rollback seen: {name}", histogram=histogram, passed=False, inconclusive=True, evidence=evidence).to_json()


def method_rows(loop, method, earlier: list) -> list[dict]:
    """``rollback seen: METHOD`` for a method with a drafter, naming the scripted draft of its first run; a real
    drafter's inconclusive row says how to script one (and is marked ``real_drafter`` for ``settle_rollback``)."""
    if method.kind == "target":
        return []
    described = "; ".join(dict.fromkeys(s.describe() for s in loop.scripts[method.name][:1]))
    row = rollback_check(method.name, loop.stats[method.name].acceptance, loop.block_size,
                         scripted=f"scripted draft: {described}" if described else "")
    if loop.real and row.get("inconclusive") and loop.cfg.get("target"):
        row["evidence"] += ("; a real drafter's rounds accept what it predicts: run the same command with --scripted-draft "
                            "in place of --draft, whose scripted draft accepts part of its blocks")
    return [{**row, "real_drafter": loop.real}]


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
