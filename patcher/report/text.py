"""Text for people: the per-step status table of apply/check/diff, the recipes, verify's checks
and figures, and ci's per-commit table with the changes it found."""

from __future__ import annotations

import json

from ..results import ALREADY_APPLIED, APPLIED, EXIT_OK, FIXED_UPSTREAM, LAYOUT, NO_MATCH, PENDING, SKIPPED, ApplyResult, CIResult, Outcome, Report, StepDoc
from .console import console

STATUS_STYLE = {APPLIED: "green", PENDING: "yellow", ALREADY_APPLIED: "cyan", FIXED_UPSTREAM: "blue", NO_MATCH: "bold red",
                SKIPPED: "bold red"}


# ----------------------------------------------------------------------------- apply / diff / check
def _where(step) -> str:
    if step.anchors:
        parts = []
        for a in step.anchors:
            loc = f"{a.path}:{a.line} " if a.path else ""
            parts.append(f"{loc}{a.function}: {a.status}" + (f" ({a.message})" if a.status in (NO_MATCH, SKIPPED) else ""))
        shown = {a.path for a in step.anchors if a.status == SKIPPED}
        for s in step.sites:  # a skipped file outside the anchors still shows, once
            if s.status == SKIPPED and s.path not in shown:
                shown.add(s.path)
                parts.append(f"{s.path}:{s.line} {s.status} ({s.message})")
        return "\n".join(parts)
    return "\n".join(f"{s.path}:{s.line} {s.status}" for s in step.sites[:6]) or "no site"


def print_summary(report: Report, command: str, verbose: bool = False, color: str = "auto", stream=None) -> None:
    from rich.table import Table

    con = console(stream, color)
    up = report.upstream or "not detected"
    con.print(f"ddpatch {command} · recipe {report.recipe.label} · upstream {up} · {report.root}")
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("step")
    table.add_column("status")
    table.add_column("where")
    for step in report.steps:
        table.add_row(step.spec.id, f"[{STATUS_STYLE.get(step.status, '')}]{step.status}[/]", _where(step))
    con.print(table)
    if verbose:
        for step in report.steps:
            for s in step.sites:
                con.print(f"  {s.path}:{s.line}:{s.column} [{STATUS_STYLE.get(s.status, '')}]{s.status}[/] {step.spec.id}: {s.message}")
    if report.upstream is None:
        markers = "; ".join(f"{u.name}: {', '.join(u.markers)}" for u in report.recipe.upstreams.values())
        con.print(
            f"[yellow]upstream layout not detected[/] (markers {markers}): anchors were not checked and "
            "layout-specific steps were skipped; pass --upstream NAME to check the tree as that layout"
        )
    if report.missing_anchors:
        con.print(f"[yellow]expected but not found in the tree:[/] {', '.join(report.missing_anchors)}")


def error_lines(report: Report) -> list[str]:
    """One line per failure in ``report``, cause first: skipped files, then steps that no longer match."""
    out = [f"skipped {f.path}: {f.error}" for f in report.skipped]
    for s in report.no_match:
        reasons = "; ".join(a.message for a in s.anchors if a.status == NO_MATCH) or "nothing matched"
        out.append(f"no-match {s.spec.id}: {reasons}")
    return out



def apply_text(result: ApplyResult) -> str:
    """The line under apply's table: what was written, or that there was nothing to write."""
    if result.written:
        return f"wrote {len(result.written)} file(s) under {result.out or result.report.root}\n"
    if not result.blocked:
        return "nothing to change" + (f"; copied the tree to {result.out}" if result.out else "") + "\n"
    return ""


def apply_error_lines(result: ApplyResult) -> list[str]:
    """Why an apply wrote nothing, after the failures that caused it (``error_lines``)."""
    if not (result.blocked and result.report.changed):
        return []
    why = "a step is no-match" if result.report.no_match else "a file was skipped"
    return [f"nothing written: {why}; use --allow-partial to write the rest"]


def check_text(report: Report) -> str:
    pending = len(report.changed)
    return (f"{pending} file(s) would change" if pending else "nothing to change") + "\n"


def demo_text(report: Report, upstream: str, kept: bool) -> str:
    """Under the demo's diff: the files ddpatch added, and where the patched copy is."""
    out = [f"+ {f.path} (new file, {len((f.patched or '').splitlines())} lines: the ddpatch runtime helper)"
           for f in report.changed if f.original is None]
    where = report.root if kept else f"{report.root} (temporary: use --out DIR to keep it)"
    out.append(f"patched copy of vendored/{upstream} written to {where}\n")
    return "\n".join(out) + "\n"


def revert_text(restored: list[str]) -> str:
    return f"restored {len(restored)} file(s)\n"


# ----------------------------------------------------------------------------- recipes
def recipes_text(recipes: list) -> str:
    """``ddpatch recipes list``: one line per recipe, and where it was verified or refused."""
    out = []
    for r in recipes:
        out.append(f"{r.name:<16} v{r.version}  {r.description.splitlines()[0] if r.description else ''}")
        if r.verified:
            out.append(f"{'':<16}  verified on: " + ", ".join(f"{t} ({p})" for t, p in r.verified.items()))
        if r.refused:
            out.append(f"{'':<16}  refused: " + ", ".join(f"{t} ({p})" for t, p in r.refused.items()))
    return "\n".join(out) + ("\n" if out else "")


def recipe_text(r, docs: list[StepDoc]) -> str:
    """``ddpatch recipes show``: what each step matches and writes, with an example of each."""
    out = [f"{r.name} v{r.version} (transformers {r.transformers})", r.description]
    if r.verified:
        out.append("\nverified lossless on (model type: ddpatch verify --preset):")
        out += [f"   {model_type:<18} {preset}" for model_type, preset in r.verified.items()]
    if r.refused:
        out.append("refused in one line (model type: preset):")
        out += [f"   {model_type:<18} {preset}" for model_type, preset in r.refused.items()]
    for i, d in enumerate(docs, 1):
        s = d.spec
        out.append(f"\n{i}. {s.id}  [{s.codemod}]" + (f"  (only {', '.join(s.upstreams)})" if s.upstreams else ""))
        out.append(f"   matches/writes: {d.description}")
        if s.why:
            out.append("   why: " + " ".join(s.why.split()))
        for up, fns in s.anchors.items():
            out.append(f"   anchors ({up}): {', '.join(fns)}")
        for ex in d.examples[:2]:
            label = "example (left alone)" if ex.before == ex.after else "example"
            out.append(f"   {label}{': ' + ex.note if ex.note else ''}")
            if ex.before == ex.after:
                out.append(_indent(ex.before, "     | "))
            else:
                out.append(_indent(ex.before, "     - "))
                out.append(_indent(ex.after, "     + "))
    return "\n".join(out) + "\n"


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines())


# ----------------------------------------------------------------------------- verify
def render_verify(outcome: Outcome, color: str = "auto") -> None:
    from rich.table import Table


    con = console(color=color)
    res = outcome.result
    env = res.get("environment", {})
    con.print(
        f"ddpatch verify · {res.get('tree')} · transformers {env.get('transformers')} · torch {env.get('torch')}"
        f" · {outcome.seconds:.1f} s"
    )
    checks = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("model", "check", "result", "evidence"):
        checks.add_column(col, overflow="fold")
    for c in res.get("checks", []):
        checks.add_row("-", c["check"], _mark(c["passed"]), _evidence(c))
    for m in res.get("models", []):
        for c in m["checks"]:
            checks.add_row(m["model"], c["check"], _mark(c["passed"]), _evidence(c))
    con.print(checks)
    for m in res.get("models", []):
        if not m.get("methods"):
            continue
        table = Table(box=None, header_style="bold", pad_edge=False, title=None)
        sampled = bool(m.get("sampling"))
        columns = ["model", "method", "identical", "max |Δlogit| (at)"] + (["distribution p"] if sampled else [])
        for col in columns + ["acceptance", "accept histogram", "tok/s", "speedup"]:
            table.add_column(col)
        base = m["baseline"]
        identical = "sampled" if sampled else f"{base['identical_runs']}/{len(base['runs'])}"
        table.add_row(m["model"], base["method"], identical, "-", *(["-"] if sampled else []), "-", "-",
                      f"{base['tokens_per_s']:.1f}", "1.00x")
        for s in m["methods"]:
            hist = " ".join(f"{k}:{v}" for k, v in s.get("acceptance_histogram", {}).items())
            dlogit = f"{s['max_dlogit']:.1e} ({s['max_dlogit_at']})" if "max_dlogit" in s else "-"
            dist = [f"{s['distribution']['p_value']:.3g}" if "distribution" in s else "-"] if sampled else []
            table.add_row(
                m["model"],
                s["method"],
                "sampled" if sampled else f"{s['identical_runs']}/{len(s['runs'])}",
                dlogit,
                *dist,
                f"{s.get('acceptance_mean', 0):.2f}",
                hist,
                f"{s['tokens_per_s']:.1f}",
                f"{s.get('speedup', 0):.2f}x",
            )
        con.print(table)
        if m.get("plumbing_figures"):
            con.print("  (tiny random CPU model: speed figures measure plumbing, not model quality)")
    verdict = "[bold green]PASS[/]: every check passed" if outcome.passed else "[bold red]FAIL[/]: see the failed checks above"
    con.print(verdict)


def _mark(passed: bool) -> str:
    return "[green]pass[/]" if passed else "[bold red]FAIL[/]"


def _evidence(check: dict) -> str:
    text = check.get("evidence", "")
    if isinstance(text, dict):  # an error summary: show its message
        text = text.get("error") or json.dumps(text)
    text = str(text)
    if check.get("frame"):
        text += f" (at {check['frame']})"
    if check.get("hint"):
        text += f" - hint: recipe step {check['hint']}"
    return text


# ----------------------------------------------------------------------------- ci
_SHORT = {APPLIED: "applied", ALREADY_APPLIED: "already", FIXED_UPSTREAM: "fixed-up", NO_MATCH: "NO-MATCH", None: "-"}


def render_ci(result: CIResult) -> str:
    out: list[str] = []
    steps = result.step_ids
    rng = f"{result.since[:12]}..{result.rev}" if result.since else result.rev
    out.append(
        f"ddpatch ci · recipe {result.recipe.label} · {result.repo.path} · {rng}: {len(result.commits)} commit(s), "
        f"{len(result.evals)} evaluated{' (bisected)' if result.bisected else ''}"
    )
    out.append("steps: " + ", ".join(f"{i} {sid}" for i, sid in enumerate(steps, 1)))
    width = max(len(v) for v in _SHORT.values())
    up_width = max([8, *(len(e.upstream or "-") for e in result.evaluated)])
    head = f"{'commit':<8} {'date':<10} {'upstream':<{up_width}} " + " ".join(f"{i:<{width}}" for i in range(1, len(steps) + 1))
    if result.verify:
        head += f" {'verify':<6}"
    out.append(head + "  subject")
    last = -1
    for i, sha in enumerate(result.commits):
        ev = result.evals.get(sha)
        if ev is None:
            continue
        if i - last > 1:
            out.append(f"{'':<8} ... {i - last - 1} commit(s) not evaluated (bisection)")
        last = i
        row = f"{ev.short:<8} {ev.date:<10} {(ev.upstream or '-'):<{up_width}} " + " ".join(
            f"{_SHORT.get(ev.status(s), ev.status(s) or '-'):<{width}}" for s in steps
        )
        if result.verify:
            v = ev.verify or {}
            row += f" {'pass' if v.get('passed') else 'skip' if v.get('passed') is None else 'FAIL':<6}"
        tag = " (baseline)" if result.since and i == 0 else ""
        out.append(f"{row}  {ev.subject[:60]}{tag}")
        if ev.error:
            out.append(f"{'':<8} error: {ev.error}")
    if result.findings:
        out.append("")
        out.append("changes (the first commit at which a step's status changed):")
    for f in result.findings:
        label = "upstream layout" if f.step == LAYOUT else f.step
        order = "first change" if f.first else "then"
        out.append(f"* {label}: {f.before or '-'} -> {f.after or '-'} at {f.commit.short} {f.commit.date} \"{f.commit.subject}\""
                   f" ({order}; previous {f.previous.short})")
        entry = f.commit.steps.get(f.step)
        for a in (entry or {}).get("anchors", []):
            where = f"{a['path']}:{a['line']} " if a.get("path") else ""
            out.append(f"    {a['status']}: {where}{a.get('function') or ''}: {a['message']}")
        if f.hunk:
            out.extend("    | " + line for line in f.hunk.rstrip("\n").splitlines())
    if result.verify:
        for ev in result.evaluated:
            v = ev.verify or {}
            failed = [c for c in v.get("checks", []) if not c["passed"]]
            if v.get("skipped") or failed:
                out.append("")
                out.append(f"verify {ev.short}: {v.get('skipped') or 'FAIL'}")
                out.extend(f"    FAIL {c['model']}: {c['check']}: {c['evidence']}" for c in failed)
    tip = result.tip
    out.append("")
    if result.exit_code == EXIT_OK:
        out.append(f"OK: every step matches at {tip.short}" + (" and verify passed" if result.verify else ""))
    else:
        why = []
        if tip.no_match:
            why.append("no-match: " + ", ".join(tip.no_match))
        if tip.verify_failed:
            why.append("verify failed")
        if tip.error:
            why.append(tip.error)
        if tip.upstream is None and not tip.error:
            why.append("no upstream layout detected, so no anchor was checked (pass --upstream NAME)")
        out.append(f"FAIL at {tip.short}: " + "; ".join(why))
    if result.lock:
        lock = result.lock
        out.append(f"lock {lock['path']}: " + (f"[{lock['upstream']}] last_verified = {lock['commit'][:12]}" if lock["updated"] else lock.get("reason", "")))
    return "\n".join(out) + "\n"
