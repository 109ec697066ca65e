"""Text for people: the per-step status table of apply/check/diff, the recipes, verify's checks
and figures, and ci's per-commit table with the changes it found."""

from __future__ import annotations

import json

from ..results import ALREADY_APPLIED, APPLIED, EXIT_OK, FIXED_UPSTREAM, LAYOUT, NO_MATCH, PENDING, SKIPPED, ApplyResult, CIResult, Outcome, Report, StepDoc
from ..verify.check import CONTROL, FAIL, INCONCLUSIVE, INFO, PASS, SKIP, WARNING, Check, checks_of
from .console import console, print_table
from .refusals import error_lines  # noqa: F401  (the CLI imports it from here)

STATUS_STYLE = {APPLIED: "green", PENDING: "yellow", ALREADY_APPLIED: "cyan", FIXED_UPSTREAM: "blue", NO_MATCH: "bold red",
                SKIPPED: "bold red"}


# ----------------------------------------------------------------------------- apply / diff / check
def _where(step) -> str:
    if step.anchors:
        parts = []
        for a in step.anchors:
            loc = f"{a.path}:{a.line} " if a.path else ""
            parts.append(f"{loc}{a.function}: {a.status}" + (f" ({a.message})" if a.status in (NO_MATCH, SKIPPED) else ""))
        anchored = {a.path for a in step.anchors}
        others: dict[str, int] = {}
        for s in step.sites:  # sites in files no anchor names (model/dflash.py) still show, one line per file
            if s.path not in anchored and s.status not in (SKIPPED,):
                others[s.path] = others.get(s.path, 0) + 1
        parts += [f"{path}: {n} site(s) {next(s.status for s in step.sites if s.path == path)}" for path, n in others.items()]
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
    print_table(con, table)
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
    for line in survey_lines(report, verbose):
        con.print(line, highlight=False, markup=False)


def _some(items: list[str], verbose: bool, limit: int = 3) -> str:
    return ", ".join(items if verbose else items[:limit]) + ("" if verbose or len(items) <= limit else f" and {len(items) - limit} more")


def survey_lines(report: Report, verbose: bool = False) -> list[str]:
    """What the run found besides the steps: the decoders, what was left out (folders that look vendored, and
    ``--exclude``), the sites left alone, unresolved imports."""
    out = []
    if report.decoders:
        out.append(f"decoders: {_some(sorted(report.decoders), verbose, 6)}")
    out += vendored_lines(report)
    by: dict[str, list[str]] = {}
    for path, why in report.excluded.items():
        by.setdefault(why, []).append(path)
    for why, paths in by.items():
        out.append(f"left out ({why}): {len(paths)} file(s): {_some(sorted(paths), verbose)}")
    notes = report.notes
    if notes:
        out.append(f"left alone, {len(notes)} site(s) no step could classify" + ("" if verbose else " (-v lists each)") + ":")
        per_file: dict[str, list] = {}
        for n in notes:
            per_file.setdefault(n.path, []).append(n)
        for path, found in per_file.items():
            shown = found if verbose else found[:1]
            out += [f"  {path}:{n.line}: {n.message}" for n in shown]
            if len(found) > len(shown):
                out.append(f"  {path}: and {len(found) - len(shown)} more")
    quiet = [i for i in report.import_issues if not i.blocking]  # a blocking one is an error line (error_lines)
    for heading, group in (("imports the decoders reach that are not installed here (verify cannot load them here):",
                            [i for i in quiet if i.reached]),
                           ("imports that resolve to nothing, in files no decoder imports:", [i for i in quiet if not i.reached])):
        if group:
            out.append(heading)
            out += [f"  {i.path}:{i.line}: {i.module}: {i.message}" for i in (group if verbose else group[:10])]
            if not verbose and len(group) > 10:
                out.append(f"  and {len(group) - 10} more (-v lists each)")
    return out


def vendored_lines(report: Report) -> list[str]:
    """The folders that look like copies of third-party packages: those left out, in one line, and
    each one checked after all because it holds a decoder signal."""
    out = []
    left = [v for v in report.vendored if v.left_out]
    if left:
        shown = ", ".join(f"{v.path}/ ({v.reason})" for v in left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        out.append(f"left out {len(left)} folder(s) that look vendored ({sum(v.files for v in left)} file(s), no decoder in them; "
                   f"--include-vendored checks them): {shown}")
    for v in report.vendored:
        if not v.left_out:
            out.append(f"checked {v.path}/ although it looks vendored ({v.reason}): it {v.decoder}")
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
    if not (result.report.no_match or result.report.skipped or result.report.blocking_imports):  # the selection alone: its own line
        return []
    why = ("a step is no-match" if result.report.no_match else "a file was skipped" if result.report.skipped
           else "an import the decoders need resolves to nothing")
    return [f"nothing written: {why}; use --allow-partial to write the rest"]


def check_text(report: Report) -> str:
    """Under check's table: every file that would change, with its pending sites (the runtime copy has none)."""
    changed = report.changed
    if not changed:
        return "nothing to change\n"
    sites: dict[str, int] = {}
    for step in report.steps:
        for s in step.sites:
            if s.status in (PENDING, APPLIED):
                sites[s.path] = sites.get(s.path, 0) + 1
    out = [f"{len(changed)} file(s) would change:"]
    runtime: dict[str, list] = {}  # the runtime copy: one line per folder it goes to, not one per file
    for f in changed:
        parts = f.path.split("/")
        if RUNTIME_NAME in parts[:-1] or parts[-1] == RUNTIME_NAME + ".py":
            at = parts.index(RUNTIME_NAME) if RUNTIME_NAME in parts[:-1] else len(parts) - 1
            runtime.setdefault("/".join(parts[:at] + [parts[at]]), []).append(f)
            continue
        what = f"{sites[f.path]} site(s)" if f.path in sites else "new file" if f.original is None else "updated"
        out.append(f"  {f.path}  {what}")
    for where, files in runtime.items():
        new = sum(f.original is None for f in files)
        what = ", ".join(p for p in (f"{new} new" if new else "", f"{len(files) - new} updated" if len(files) > new else "") if p)
        out.append(f"  {where}{'/' if not where.endswith('.py') else ''}  ddpatch runtime copy ({what} file(s))")
    return "\n".join(out) + "\n"


RUNTIME_NAME = "_ddpatch_runtime"


def demo_text(report: Report, upstream: str, kept: bool) -> str:
    """Under the demo's diff: the files ddpatch added, and where the patched copy is."""
    out = [f"+ {f.path} (new file, {len((f.patched or '').splitlines())} lines: the ddpatch runtime helper)"
           for f in report.changed if f.original is None]
    where = report.root if kept else f"{report.root} (temporary: use --out DIR to keep it)"
    out.append(f"patched copy of vendored/{upstream} written to {where}\n")
    return "\n".join(out) + "\n"


def revert_text(result) -> str:
    """``revert``'s lines: what was restored, each later edit it overwrote (and its backup), or that nothing was left to do."""
    if result.already_reverted:
        return f"already reverted: the latest apply on this tree was reverted (journal {result.already_reverted}); nothing to do\n"
    out = [f"overwrote your later edits to {path} (kept as {backup})" for path, backup in result.overwritten]
    out.append(f"restored {len(result.restored)} file(s)")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- recipes
def recipes_text(recipes: list) -> str:
    """``ddpatch recipes list``: one line per recipe, and where it was verified or refused."""
    out = []
    for r in recipes:
        out.append(f"{r.name:<16} v{r.version}  {' '.join(r.description.split())}")  # whole sentences, never cut
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
                out.append(_changes(ex.before, ex.after))
    return "\n".join(out) + "\n"


def _changes(before: str, after: str) -> str:
    """An example as a diff with all its context: unchanged lines once (``|``), only changed ones as ``-``/``+``."""
    import difflib

    lines = difflib.unified_diff(before.rstrip("\n").splitlines(), after.rstrip("\n").splitlines(), n=10**6, lineterm="")
    marks = {" ": "     | ", "-": "     - ", "+": "     + "}
    return "\n".join((marks[line[0]] + line[1:]).rstrip() for line in list(lines)[3:] if line[:1] in marks)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines())


# ----------------------------------------------------------------------------- verify
def _tested_words(version) -> str:
    """``inside the tested range`` / ``BELOW the tested range 5.21 <= transformers < 5.26`` (patcher.env)."""
    from ..env import range_text, tested_range_status

    status = tested_range_status("transformers", version)
    return f"{status} the tested range" if status == "inside" else f"{status.upper()} the tested range {range_text('transformers')}"


def render_verify(outcome: Outcome, color: str = "auto") -> None:
    from rich.table import Table


    con = console(color=color)
    res = outcome.result
    env = res.get("environment", {})
    con.print(
        f"ddpatch verify · {res.get('tree')} · transformers {env.get('transformers')} ({_tested_words(env.get('transformers'))})"
        f" · torch {env.get('torch')} · {outcome.seconds:.1f} s"
    )
    _verify_setup(con, res)
    checks = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("model", "check", "result", "evidence"):
        checks.add_column(col, overflow="fold")
    for c in map(Check.from_json, res.get("checks", [])):
        checks.add_row("-", c.name, _mark(c), _evidence(c))
    for m in res.get("models", []):
        for c in map(Check.from_json, m["checks"]):
            checks.add_row(m["model"], c.name, _mark(c), _evidence(c))
    print_table(con, checks)
    for m in res.get("models", []):
        if not m.get("methods"):
            continue
        table = Table(box=None, header_style="bold", pad_edge=False, title=None)
        sampled = bool(m.get("sampling"))
        columns = ["model", "method", "identical", "near-ties", "max |Δlogit| (at)"] + (["distribution p"] if sampled else [])
        for col in columns + ["acceptance", "accept histogram", "tok/s", "speedup"]:
            table.add_column(col)
        base = m["baseline"]
        identical = "sampled" if sampled else f"{base['identical_runs']}/{len(base['runs'])}"
        table.add_row(m["model"], base["method"], identical, "-", "-", *(["-"] if sampled else []), "-", "-",
                      f"{base['tokens_per_s']:.1f}", "1.00x")
        for s in m["methods"]:
            hist = " ".join(f"{k}:{v}" for k, v in s.get("acceptance_histogram", {}).items())
            dlogit = f"{s['max_dlogit']:.1e} ({s['max_dlogit_at']})" if "max_dlogit" in s else "-"
            dist = [f"{s['distribution']['p_value']:.3g}" if "distribution" in s else "-"] if sampled else []
            table.add_row(
                m["model"],
                s["method"],
                "sampled" if sampled else f"{s['identical_runs']}/{len(s['runs'])}",
                str(s.get("near_ties", 0)),
                dlogit,
                *dist,
                f"{s.get('acceptance_mean', 0):.2f}",
                hist,
                f"{s['tokens_per_s']:.1f}",
                f"{s.get('speedup', 0):.2f}x",
            )
        print_table(con, table)
        if m.get("plumbing_figures"):
            con.print("  (tiny random CPU model: speed figures measure plumbing, not model quality)")
    con.print(verify_verdict(outcome))


def _verify_setup(con, res: dict) -> None:
    """What the verdict was reached with: dtype, device, device_map, attention; the noise floor and tolerance."""
    loaded = res.get("loaded")
    if loaded:
        attn = loaded.get("attn_implementation")
        if loaded.get("fell_back_from"):
            attn = f"{attn} (requested {loaded.get('attn_requested')}: unsupported by this model)"
        con.print(f"  target loaded with: dtype {loaded.get('dtype')} · device {loaded.get('device')} · device_map "
                  f"{loaded.get('device_map') or 'none'} · attention {attn} · {loaded.get('auto_class')}")
        settings, where = loaded.get("settings") or {}, loaded.get("settings_from") or {}
        if settings:
            con.print("  decoded with: " + " · ".join(
                f"{k.replace('_', ' ')} {','.join(map(str, v)) if isinstance(v, list) else v}" + (f" ({where[k]})" if k in where else "")
                for k, v in settings.items() if v is not None))
    for m in res.get("models", []):
        if m.get("prompts_made"):
            con.print(f"  {m['model']}: prompts: {m['prompts_made']}")
        cal = m.get("calibration")
        if cal:
            how = "set by --logit-tolerance" if cal.get("override") is not None else f"{cal['multiple']:g} x floor"
            con.print(f"  {m['model']}: noise floor {cal['floor']:.2e} in {cal['dtype']}, tolerance {cal['tolerance']:.2e} ({how}), "
                      f"near-tie ε {cal['epsilon']:.2e}")


def verify_verdict(outcome: Outcome) -> str:
    """PASS, FAIL, or INCONCLUSIVE (only inconclusive checks failed: never a pass)."""
    if outcome.passed:
        return "[bold green]PASS[/]: every check passed"
    failed = [c for c in checks_of(outcome.checks) if not c.passed]
    if failed and all(c.status == INCONCLUSIVE for c in failed):
        command = next((c.get("float32_command") for c in failed if c.get("float32_command")), None)
        text = "; ".join(dict.fromkeys(c.evidence.split(":")[0] for c in failed))
        return "[bold yellow]INCONCLUSIVE[/]: " + text + (f"; judge it in float32: {command}" if command else "")
    return "[bold red]FAIL[/]: see the failed checks above"


#: How the text report shows each status (``Check.status``).
_MARKS = {PASS: "[green]pass[/]", FAIL: "[bold red]FAIL[/]", INCONCLUSIVE: "[bold red]FAIL[/]", CONTROL: "[cyan]control[/]",
          INFO: "[blue]info[/]", SKIP: "[yellow]skip[/]", WARNING: "[yellow]warn[/]"}


def _mark(check: Check) -> str:
    """pass / FAIL; a control row (it passes whatever it shows, e.g. verify --generate's native run) says so, and
    so does a check that could not judge (the drafter oracle on a drafter it cannot bind: ``skip``, never a pass),
    and a figure reported with nothing to judge it against (acceptance without a stored floor: ``info``), and a
    finding that does not fail the verdict (code no run executed, none of it able to change tokens: ``warn``)."""
    return _MARKS[check.status]


def _evidence(check: Check) -> str:
    text = check.get("evidence", "")
    if isinstance(text, dict):  # an error summary: show its message
        text = text.get("error") or json.dumps(text)
    text = str(text)
    if check.get("frame"):
        text += f" (at {check.get('frame')})"
    if check.get("hint"):
        text += f" - hint: recipe step {check.get('hint')}"
    if check.get("inside"):
        text += f" - {check.get('inside')}"
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
            failed = [c for c in checks_of((ev.verify or {}).get("checks", [])) if not c.passed]
            if v.get("skipped") or failed:
                out.append("")
                out.append(f"verify {ev.short}: {v.get('skipped') or 'FAIL'}")
                out.extend(f"    FAIL {c.get('model')}: {c.name}: {c.evidence}" for c in failed)
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
