"""Coverage, stated by line and by flag: one row per decoder, ``coverage: LABEL``, from the lines its runs executed
(``coverage_runs`` collects them in the child, coverage.py) and what its code is (``subjects.coverage``).

The row names how many of the decoder's lines and of the tree's helpers it reaches ran, and every branch that never
ran, with its lines, its test, the decoder parameter that guards it (``trim_kv``) and why no run took that value.

**The rule.** An unrun branch that can change tokens or caches (a model or drafter call, a cache call or a new cache,
an edit of a cache's layers, a ddpatch runtime call, a call with a cache, or a call into a helper holding one) and
that a decoder parameter selects (a flag, a mode, a role such as ``block_size``) is *unproven*: the row fails. A user
who passes that value runs code no run of this verify ran, so an exit 0 would claim what was not shown. Every other
unrun branch is listed and the row warns (it passes): code that only prints, logs, asserts, raises or times cannot
make the output lossy, and a branch no parameter selects (``kept == 0``, a stop token, an exception path) is one
that the data reaches or not, as every other input a verify samples; naming its lines is what can be done.
A branch behind the sampling parameters, in a verify that ran no sampled pass (``--greedy-only``), warns: the user
chose to leave sampling out, and the row says so.

Plain Python (no torch): the parent settles the rows over its children (``settle``), the child plans its mode runs
with ``findings``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...check import Check
from ...subjects import binding
from ...subjects.decoder_code import DecoderCode, decoder_code
from ...subjects.reach import Tree

#: findings a row's text names (the JSON holds them all)
SHOWN = 6
SAMPLING_ROLES = ("temperature", "top_p", "top_k")


@dataclass
class Finding:
    file: str
    function: str
    first: int
    last: int
    kind: str  # an arm's kind (if, else, loop, except ...), "lines" (after an early exit), "function" (never entered)
    test: str
    guards: list
    sites: list  # what in it can change tokens or caches
    statements: int
    why: dict = field(default_factory=dict)  # guard -> why no run took the value that reaches it
    unproven: bool = False
    elsewhere: list = field(default_factory=list)  # the other decoders whose runs ran these lines (a shared helper)

    @property
    def lines(self) -> str:
        return f"line {self.first}" if self.first == self.last else f"line {self.first}-{self.last}"

    def describe(self) -> str:
        where = f"{self.file}:{self.function} {self.lines}"
        what = self.test if self.kind == "lines" else "never entered" if self.kind == "function" else f"{self.kind} {self.test}"
        if self.elsewhere:
            behind = f"ran in the runs of {', '.join(self.elsewhere)}"
        elif self.sites:
            behind = "; ".join(f"behind {g}, {self.why.get(g, 'not run')}" for g in self.guards) or "no parameter selects it"
        else:  # a path behind a parameter left None is said to be unproven (``own_findings``)
            behind = "; ".join(f"behind {g}" + (f", {self.why[g]}" if "defaults to None" in self.why.get(g, "") else "")
                               for g in self.guards) or "no parameter selects it"
        return f"{where} ({what}; {behind}; {self.sites[0] if self.sites else 'no token or cache change'})"

    def brief(self) -> str:
        where = f"{self.file}:{self.function} {self.lines}"
        return where + (f" (behind {', '.join(self.guards)})" if self.guards else "")

    def as_dict(self) -> dict:
        return {**asdict(self), "lines": [self.first, self.last]}


def ran_statements(code, lines: set) -> set:
    return {s for s, own in code.statements.items() if lines.intersection(own)}


def findings(dc: DecoderCode, ran: dict, elsewhere: dict | None = None) -> tuple[list, list]:
    """(per-function counts, findings) for the decoder and its helpers, given the lines that ran per file.
    ``elsewhere``: another decoder's label -> its lines per file: a helper's branch that another decoder's runs ran is
    proven code (named so), though this decoder never reached it."""
    per_function, out = [], []
    funcs = dc.functions()
    ran_by = {k: ran_statements(c, set(ran.get(k[0], ()))) for k, c in funcs.items()}
    unrun_spans = []
    for k, code in funcs.items():
        done, total = ran_by[k], set(code.statements)
        per_function.append({"function": code.where, "ran": len(done), "total": len(total),
                             "never_ran": sorted(total - done), "helper": k != dc.decoder.key})
        if not done:
            continue
        left = total - done
        kept = []
        for arm in code.arms:  # outermost first (sorted by first line, longest first)
            stmts = code.arm_statements(arm)
            if not stmts or not set(stmts) <= left or any(a.first <= arm.first and arm.last <= a.last for a in kept):
                continue
            kept.append(arm)
            sites = [s for st in stmts for s in dc.sites.get(k, {}).get(st, ())]
            out.append(Finding(k[0], k[1], arm.first, arm.last, arm.kind, arm.test, dc.guards(code, arm), sites, len(stmts)))
            unrun_spans.append((k[0], arm.first, arm.last))
            left -= set(stmts)
        for group in _runs(sorted(left), sorted(total)):
            sites = [s for st in group for s in dc.sites.get(k, {}).get(st, ())]
            # the last statement that ran before them: the end of an arm that returns (`if temperature < 1e-5: return`)
            # puts them behind that arm's test; any other statement raised or left the block
            prev = max((st for st in done if st < group[0]), default=None)
            exit_arm = next((a for a in code.arms if a.exits and prev is not None and prev == code.arm_statements(a)[-1]), None)
            test = f"after line {prev} ({exit_arm.kind} {exit_arm.test})" if exit_arm else \
                f"after line {prev}, which ran: it raised or left the block" if prev else "never reached"
            out.append(Finding(k[0], k[1], group[0], max(code.statements[group[-1]]), "lines", test,
                               dc.guards(code, exit_arm) if exit_arm else [], sites, len(group)))
    for f in out:
        code = funcs[(f.file, f.function)]
        stmts = {st for st in code.statements if f.first <= st <= f.last}
        f.elsewhere = sorted(label for label, files in (elsewhere or {}).items()
                             if stmts and f.sites and stmts <= ran_statements(code, set(files.get(f.file, ()))))
    for k, code in funcs.items():  # a helper never entered though a line that calls it ran
        if ran_by[k] or k == dc.decoder.key:
            continue
        callers = [(c, line) for c, lines in _call_lines(dc, k).items() for line in lines]
        if callers and not all(any(f == c[0] and a <= line <= b for f, a, b in unrun_spans) for c, line in callers):
            out.append(Finding(k[0], k[1], code.node.lineno, code.node.end_lineno, "function", "", [],
                               [dc.risky[k]] if dc.risky.get(k) else [], len(code.statements)))
    return per_function, out


def _call_lines(dc: DecoderCode, callee) -> dict:
    """caller -> the lines that call ``callee``."""
    out: dict = {}
    for k, calls in dc.calls.items():
        for line, c in calls:
            if c == callee:
                out.setdefault(k, []).append(line)
    return out


def _runs(left: list, order: list) -> list:
    """``left`` cut into runs of statements that follow each other in ``order``."""
    pos = {s: i for i, s in enumerate(order)}
    groups: list = []
    for s in left:
        if groups and pos[s] == pos[groups[-1][-1]] + 1:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


#: the option that sets what a role's parameter gets
ROLE_OPTIONS = {"block_size": "--block-size", "tree_budget": "--tree-budgets", "max_new_tokens": "--max-new-tokens",
                "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                "stop_token_ids": "stop tokens come with a real target's tokenizer: --target"}


def classify(items: list, modes: dict, sampled: bool) -> None:
    """Mark the unproven findings and say, for each guard, why no run took the value that reaches the branch.
    ``modes``: the child's record for the decoder (its runs and the values not run, with the reason)."""
    not_run = modes.get("not_run", {})
    ran = [r for r in modes.get("runs", [])]
    roles = modes.get("roles", {})
    for f in items:
        for g in f.guards:
            tried = [r for r in ran if g in r["values"]]
            if tried:
                f.why[g] = "ran with " + ", ".join(_values(r["values"]) for r in tried) + ": the branch still did not run"
            elif g in not_run:
                f.why[g] = "not run: " + not_run[g]
            elif roles.get(g) in SAMPLING_ROLES and not sampled:
                f.why[g] = "not run: this verify ran no sampled pass (--greedy-only)"
            elif g in roles:
                f.why[g] = f"not run: an input this verify sets ({ROLE_OPTIONS.get(roles[g], roles[g])})"
            else:
                f.why[g] = "not run: no value was tried"
        # every parameter it reads ran with each value a run could give it, and it still did not run: what reaches it
        # is the data (or a path through the callers), as for a branch no parameter selects
        exhausted = all(g in [p for r in ran for p in r["values"]] and g not in not_run for g in f.guards)
        excused = all(roles.get(g) in SAMPLING_ROLES and not sampled for g in f.guards)
        f.unproven = bool(f.sites) and bool(f.guards) and not excused and not exhausted and not f.elsewhere


def own_findings(dc: DecoderCode, items: list, modes: dict) -> set:
    """The findings in the decoder's own code (its own branches that can change tokens or caches, the helpers it never
    entered, and any branch behind a parameter of its that defaults to None): what a fork adds, named first in the text
    (a branch that only prints stays in the short list). A branch behind such a
    parameter that the verifier passed nothing for is said to be unproven in the text, whatever it holds."""
    import ast

    decoder = dc.functions().get(dc.decoder.key)
    roles = modes.get("roles", {})
    nones = {p for p, d in (getattr(decoder, "defaults", None) or {}).items()
             if isinstance(d, ast.Constant) and d.value is None and p not in roles}
    out = set()
    for f in items:
        behind_none = [g for g in f.guards if g in nones and not any(g in r["values"] for r in modes.get("runs", []))]
        for g in behind_none:
            f.why[g] = (f"it defaults to None and no run gave it a value: this path is unproven (the verifier has no value it "
                        f"can build for {g}; give one with a wrapper that passes it, picked with --entry)")
        if ((f.file, f.function) == tuple(dc.decoder.key) and f.sites) or f.kind == "function" or behind_none:
            out.add(id(f))
    return out


def _values(values: dict) -> str:
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())


def row(label: str, dc: DecoderCode, ran: dict, modes: dict, sampled: bool, elsewhere: dict | None = None) -> dict:
    """``coverage: LABEL``: fails on an unproven branch, warns on any other unrun line, else passes."""
    per_function, items = findings(dc, ran, elsewhere)
    classify(items, modes, sampled)
    own = own_findings(dc, items, modes)
    items.sort(key=lambda f: (not f.unproven, id(f) not in own, not f.sites, f.file, f.first))
    helpers = [p for p in per_function if p["helper"] and p["ran"]]
    done = sum(p["ran"] for p in per_function if p["ran"] or not p["helper"])
    total = sum(p["total"] for p in per_function if p["ran"] or not p["helper"])
    head = f"ran {done}/{total} lines of {dc.decoder.where} and {len(helpers)} helper(s)"
    runs = modes.get("runs", [])
    tail = ""
    if runs:
        tail += "; mode runs: " + ", ".join(_values(r["values"]) + ("" if r.get("passed") else " (FAILED: see its rows)") for r in runs)
    unproven = [f for f in items if f.unproven]
    if not items:
        evidence = f"{head}: every line ran{tail}"
    else:
        first = [f for f in items if id(f) in own]  # what the fork adds: named first, whole, by name and line
        risky, benign = [f for f in items if f.sites and id(f) not in own], [f for f in items if not f.sites and id(f) not in own]
        parts = [f.describe() for f in first[:2 * SHOWN]] + [f.describe() for f in risky[:SHOWN]]
        if benign:
            parts.append("no token or cache change in: " + ", ".join(f.brief() for f in benign[:SHOWN]))
        hidden = max(0, len(first) - 2 * SHOWN) + max(0, len(risky) - SHOWN) + max(0, len(benign) - SHOWN)
        shown = "; ".join(parts) + (f"; {hidden} more in the JSON" if hidden else "")
        lead = f"{len(unproven)} unproven branch(es) that can change tokens or caches: " if unproven else ""
        evidence = f"{lead}{head}; never ran: {shown}{tail}"
    return Check.of(f"coverage: {label}", passed=not unproven, warning=bool(items) and not unproven, evidence=evidence,
                    decoder={"file": dc.decoder.key[0], "function": dc.decoder.key[1]},
                    coverage={"ran": done, "total": total, "functions": per_function,
                              "never_ran": [f.as_dict() for f in items], "mode_runs": runs,
                              "modes_not_run": modes.get("not_run", {})}).to_json()


# ----------------------------------------------------------------------------- the parent: one row per decoder
def settle(result: dict | None, results: list, cfg: dict) -> dict | None:
    """Add the coverage rows to the merged ``result`` from every child's lines (``result["coverage"]``)."""
    if not result or result.get("crash") or result.get("fatal"):
        return result
    payloads = [r.get("coverage") for r in results if r and r.get("coverage")]
    result.pop("coverage", None)
    if not result.get("decoders"):  # the tree did not load: its rows say why, and nothing ran
        return result
    if not payloads or not any(p.get("available") for p in payloads):
        why = next((p.get("why") for p in payloads if p.get("why")), "no decoder ran")
        result.setdefault("checks", []).append(Check.of("coverage", passed=True, warning=True,
                                                         evidence=f"not measured: {why}").to_json())
        return result
    contexts: dict = {}
    modes: dict = {}
    for p in payloads:
        for ctx, files in (p.get("contexts") or {}).items():
            for rel, lines in files.items():
                contexts.setdefault(ctx.split("|")[0], {}).setdefault(rel, set()).update(lines)
        for key, record in (p.get("modes") or {}).items():
            modes.setdefault(key, record)
    tree = Tree(Path(result["tree"]))
    sampled = any(m.get("sampling") for m in result.get("models", []))
    drafters = tuple(d["name"] for d in (cfg.get("plan") or {}).get("drafters", ()))
    rows = []
    for d in result.get("decoders") or []:
        if not d.get("verified"):
            continue
        key = f"{d['file']}:{d['qualname']}"
        record = modes.get(key, {})
        ran = contexts.get(key)
        if not ran:
            rows.append(Check.of(f"coverage: {d['label']}", passed=True, warning=True,
                                 evidence=f"no line of {key} was measured: no run of it completed (its rows say why), "
                                          "or the collector saw none").to_json())
            continue
        roles = record.get("roles") or roles_by_name(tree, (d["file"], d["qualname"]))
        extra = {tree.enclosing(rel, line) for rel, lines in ran.items() if rel in tree.files for line in lines} - {None}
        dc = decoder_code(tree, (d["file"], d["qualname"]), roles, {"block_size": cfg.get("block_size")}, drafters, extra)
        if dc is None:
            continue
        elsewhere = {o["label"]: contexts[f"{o['file']}:{o['qualname']}"] for o in result.get("decoders") or []
                     if f"{o['file']}:{o['qualname']}" in contexts and f"{o['file']}:{o['qualname']}" != key}
        rows.append(row(d["label"], dc, ran, record, sampled, elsewhere))
    result.setdefault("checks", []).extend(rows)
    return result


def roles_by_name(tree: Tree, key) -> dict:
    """The roles the binding gives a decoder's parameters by their names (the child, which binds the real function,
    sends the exact ones)."""
    node = tree.function(key)
    names = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)] if node is not None else []
    by_name = {alias: role for role, aliases in binding.ROLE_NAMES.items() for alias in aliases}
    return {n: by_name[n.lower()] for n in names if n.lower() in by_name}
