"""``ddpatch verify --html FILE``: one offline, self-contained page that shows why the verdict is what it is.

Per model: the checks; the acceptance histograms of every method side by side, on one scale; with a real
drafter, acceptance by tree budget against DFlash and, per judged method, every round against what a correct
decoder reaches from the same start; then per method an inline SVG of |Δlogit| per new token (the worst run at
each position) against the calibrated tolerance and the noise floor, near-ties marked on the axis. No script, no network, no plotting
library: plain SVG and CSS.
"""

from __future__ import annotations

import html
import math

from ..results import Outcome
from ..verify.check import CONTROL, FAIL, INCONCLUSIVE, INFO, PASS, SKIP, WARNING, Check

#: the |Δlogit| plot: its size and margins (the right one holds the "tolerance" / "noise floor" labels)
W, H, PAD, RIGHT = 680, 220, 46, 84
#: one colour per method of the acceptance panels, in the order the methods ran
COLOURS = ("#36c", "#e67e22", "#2a6", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d")


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _y(value: float, lo: float, hi: float) -> float:
    value = min(max(value, lo), hi)
    return H - PAD + (PAD * 2 - H) * (math.log10(value) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))


def dlogit_svg(method: dict, tolerance: float, floor: float | None) -> str:
    """|Δlogit| per new token (log scale), worst over the method's runs, with the tolerance line."""
    worst: dict[int, float] = {}
    for run in method.get("runs", []):
        for i, d in run.get("logits", {}).get("trace", []):
            worst[i] = max(worst.get(i, 0.0), d)
    ties = sorted({t["position"] for run in method.get("runs", []) if run.get("ties", {}).get("kind") == "near-tie"
                   for t in run["ties"]["near_ties"]})
    n = max([*worst, *ties, 1]) + 1
    values = [v for v in worst.values() if v > 0] + [tolerance] + ([floor] if floor else [])
    lo = 10 ** math.floor(math.log10(max(min(values) / 2, 1e-12)))
    hi = 10 ** math.ceil(math.log10(max(values) * 2))
    right = W - RIGHT

    def x(i):
        return PAD + (right - PAD) * (i + 0.5) / n

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
             f'aria-label="|Δlogit| per new token for {_e(method["method"])}">',
             f'<rect x="{PAD}" y="{PAD // 2}" width="{right - PAD}" height="{H - 1.5 * PAD}" fill="#fafafa" stroke="#ccc"/>']
    decade = lo
    while decade <= hi * 1.0001:
        y = _y(decade, lo, hi)
        parts.append(f'<line x1="{PAD}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="{PAD - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{decade:.0e}</text>')
        decade *= 10
    for value, colour, label in ((tolerance, "#c00", "tolerance"), (floor, "#888", "noise floor")):
        if value:
            y = _y(value, lo, hi)
            parts.append(f'<line x1="{PAD}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="{colour}" stroke-dasharray="5,3"/>'
                         f'<text x="{right + 4}" y="{y + 4:.1f}" font-size="10" fill="{colour}">{label}</text>')
    for i in ties:
        parts.append(f'<rect x="{x(i) - 4:.1f}" y="{H - PAD + 2}" width="8" height="8" fill="#e90">'
                     f'<title>near-tie at new token {i}</title></rect>')
    for i, d in sorted(worst.items()):
        colour = "#c00" if d > tolerance else "#2a6"
        parts.append(f'<circle cx="{x(i):.1f}" cy="{_y(max(d, lo), lo, hi):.1f}" r="3" fill="{colour}">'
                     f'<title>new token {i}: |Δlogit| {d:.2e}</title></circle>')
    parts.append(f'<text x="{(PAD + right) / 2}" y="{H - 6}" font-size="11" text-anchor="middle">new token (■ near-tie)</text></svg>')
    return "".join(parts)


def acceptance_svg(methods: list[dict], checks: list[dict] | None = None) -> str:
    """The acceptance histograms of every method side by side, on one scale: the same lengths across, each bar
    the share of that method's rounds (its count above it), its mean marked, and where an ``acceptance:`` check
    was judged against a stored floor, the mean of ddpatch's from-scratch reference decode on the same prompts."""
    drafted = [m for m in methods if m.get("acceptance_histogram")]
    if not drafted:
        return "<p>no acceptance lengths</p>"
    judged = {c.name.split(": ", 1)[1]: c for c in checks or [] if c.name.startswith("acceptance: ")}
    hists = [{int(k): v for k, v in m["acceptance_histogram"].items()} for m in drafted]
    references = [c.get("reference_mean") for c in judged.values() if c.get("reference_mean")]
    longest = max([max(h) for h in hists] + [math.ceil(r) for r in references])  # the same lengths in every panel
    top = max(v / sum(h.values()) for h in hists for v in h.values())
    top = min(1.0, math.ceil(top * 1.1 * 10) / 10)  # the shared y scale: headroom, rounded up to a tenth
    gap, left, head, foot, plot_h = 3, 34, 40, 30, 120
    bar = max(16, (140 - gap) // longest - gap)  # a panel at least as wide as its title
    panel = longest * (bar + gap) + gap
    width = max(left + len(drafted) * (panel + 18), 600)  # room for the caption
    height = head + plot_h + foot
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="acceptance histograms, all methods, one scale">']
    for tick in (0.0, top / 2, top):
        y = head + plot_h * (1 - tick / top)
        parts.append(f'<text x="{left - 4}" y="{y + 3:.1f}" font-size="9" text-anchor="end">{tick:.0%}</text>')
    for j, (m, h) in enumerate(zip(drafted, hists)):
        x0, colour, rounds = left + j * (panel + 18), COLOURS[j % len(COLOURS)], sum(h.values())
        mean = m.get("acceptance_mean", sum(k * v for k, v in h.items()) / rounds)
        parts.append(f'<rect x="{x0}" y="{head}" width="{panel}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>'
                     f'<text x="{x0 + panel / 2}" y="12" font-size="11" font-weight="bold" text-anchor="middle">{_e(m["method"])}</text>'
                     f'<text x="{x0 + panel / 2}" y="25" font-size="10" text-anchor="middle">mean {mean:.2f} · {rounds} rounds</text>')
        for k in range(1, longest + 1):
            v = h.get(k, 0)
            bh = plot_h * (v / rounds) / top
            x = x0 + gap + (k - 1) * (bar + gap)
            if v:
                parts.append(f'<rect x="{x}" y="{head + plot_h - bh:.1f}" width="{bar}" height="{bh:.1f}" fill="{colour}">'
                             f'<title>{_e(m["method"])}: {v} of {rounds} rounds accepted {k} ({v / rounds:.0%})</title></rect>'
                             f'<text x="{x + bar / 2}" y="{head + plot_h - bh - 3:.1f}" font-size="9" text-anchor="middle">{v}</text>')
            parts.append(f'<text x="{x + bar / 2}" y="{head + plot_h + 12}" font-size="9" text-anchor="middle">{k}</text>')

        def mark(value, stroke, label, x0=x0):  # x0: this method's panel (bound now, not the loop's last)
            xm = x0 + gap + (value - 0.5) * (bar + gap)
            return (f'<line x1="{xm:.1f}" x2="{xm:.1f}" y1="{head}" y2="{head + plot_h}" stroke="{stroke}" stroke-dasharray="4,2">'
                    f'<title>{label}</title></line>')

        parts.append(mark(mean, "#000", f"mean acceptance {mean:.2f}"))
        reference = (judged.get(m["method"]) or {}).get("reference_mean")
        if reference:
            parts.append(mark(reference, "#c00", f"ddpatch's from-scratch reference decode: mean {reference:.2f} on the same prompts"))
    parts.append(f'<text x="{left}" y="{height - 4}" font-size="10">'
                 "tokens committed per round (share of rounds; count above each bar; dashed: the mean, red: ddpatch's reference decode)</text></svg>")
    return "".join(parts)


def rounds_svg(check: Check) -> str:
    """One method's judged rounds, prompt after prompt: what it accepted (a dot: red where no correct decoder could
    from that start) against what a correct one reaches from the same start (a grey band: the reachable set, from
    ddpatch's reference)."""
    rounds = [(p["prompt"], r) for p in check.get("per_prompt", []) for r in p.get("judged", []) if r.get("reachable")]
    if not rounds:
        return ""
    top = max(max(r["accepted"], max(r["reachable"])) for _, r in rounds) + 1
    left, head, plot_w, plot_h = 34, 18, W - 34 - 20, 140
    step = plot_w / len(rounds)

    def y(v):
        return head + plot_h * (1 - v / top)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{head + plot_h + 34}" role="img" '
             f'aria-label="acceptance per round against the reference for {_e(check.name)}">',
             f'<rect x="{left}" y="{head}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>']
    for tick in range(0, top + 1, max(1, top // 4)):
        parts.append(f'<text x="{left - 4}" y="{y(tick) + 3:.1f}" font-size="9" text-anchor="end">{tick}</text>')
    last = None
    for i, (prompt, r) in enumerate(rounds):
        x = left + step * (i + 0.5)
        if prompt != last:
            parts.append(f'<line x1="{x - step / 2:.1f}" x2="{x - step / 2:.1f}" y1="{head}" y2="{head + plot_h}" stroke="#ddd"/>'
                         f'<text x="{x - step / 2 + 2:.1f}" y="{head - 4}" font-size="9">prompt {prompt}</text>')
            last = prompt
        lo, hi = min(r["reachable"]), max(r["reachable"])
        parts.append(f'<rect x="{x - max(step * 0.4, 1):.1f}" y="{y(hi + 0.3):.1f}" width="{max(step * 0.8, 2):.1f}" '
                     f'height="{y(lo - 0.3) - y(hi + 0.3):.1f}" fill="#ddd"><title>a correct decoder accepts {lo}..{hi} from new token '
                     f'{r["start"] + 1}</title></rect>')
        off = r["accepted"] not in r["reachable"]
        parts.append(f'<circle cx="{x:.1f}" cy="{y(r["accepted"]):.1f}" r="{2.5 if step > 4 else 1.5}" fill="{"#c00" if off else "#36c"}">'
                     f'<title>round {r["round"]} at new token {r["start"] + 1}: accepted {r["accepted"]}</title></circle>')
    parts.append(f'<text x="{left}" y="{head + plot_h + 24}" font-size="10">tokens committed per round (dot) against what a '
                 "correct decoder reaches from the same start (grey; red dot: outside it)</text></svg>")
    return "".join(parts)


def budgets_svg(checks: list[Check]) -> str:
    """Acceptance by tree budget against DFlash's: the tree's mean at each budget and the reference's (what a correct
    DDTree reaches with the pair), DFlash's as a line across."""
    rows = {c.name.split(": ", 1)[1]: c for c in checks if c.name.startswith("acceptance: ") and c.get("judged_mean")}
    trees = sorted(((int(n.rsplit("tb", 1)[1]), c) for n, c in rows.items() if n.startswith("ddtree_tb") and n.rsplit("tb", 1)[1].isdigit()))
    if not trees:
        return ""
    chain = rows.get("dflash")
    values = [c.get("judged_mean") for _, c in trees] + [c.get("reference_mean") or 0 for _, c in trees]
    values += [chain.get("judged_mean"), chain.get("reference_mean") or 0] if chain else []
    top = math.ceil(max(values) + 0.5)
    left, head, plot_w, plot_h = 40, 14, W - 40 - 120, 140

    def x(i):
        return left + plot_w * (i + 0.5) / len(trees)

    def y(v):
        return head + plot_h * (1 - v / top)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{head + plot_h + 36}" role="img" '
             'aria-label="acceptance by tree budget against DFlash">',
             f'<rect x="{left}" y="{head}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>']
    for tick in range(0, top + 1):
        parts.append(f'<text x="{left - 4}" y="{y(tick) + 3:.1f}" font-size="9" text-anchor="end">{tick}</text>')
    if chain:
        for value, dash, label in ((chain.get("judged_mean"), "", "DFlash"), (chain.get("reference_mean"), "4,2", "correct DFlash")):
            if value:
                parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="#e67e22" '
                             f'stroke-dasharray="{dash}"/><text x="{left + plot_w + 4}" y="{y(value) + 3:.1f}" font-size="10" '
                             f'fill="#e67e22">{label} {value:.2f}</text>')
    for key, colour, dash in (("reference_mean", "#888", "4,2"), ("judged_mean", "#36c", "")):
        pts = [(x(i), y(c.get(key))) for i, (_, c) in enumerate(trees) if c.get(key)]
        if len(pts) > 1:
            parts.append(f'<polyline points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in pts)}" fill="none" stroke="{colour}" '
                         f'stroke-dasharray="{dash}"/>')
        parts += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{colour}"/>' for a, b in pts]
    for i, (budget, _c) in enumerate(trees):
        parts.append(f'<text x="{x(i):.1f}" y="{head + plot_h + 12}" font-size="9" text-anchor="middle">{budget}</text>')
    parts.append(f'<text x="{left}" y="{head + plot_h + 28}" font-size="10">mean tokens per judged round by tree budget: the '
                 "tree (blue), a correct DDTree with this pair (grey), DFlash (orange)</text></svg>")
    return "".join(parts)


#: How the HTML report shows each status (``Check.status``): its word and its CSS class (a control row shows as a pass).
_MARKS = {PASS: ("pass", "pass"), FAIL: ("FAIL", "fail"), INCONCLUSIVE: ("inconclusive", "inc"), CONTROL: ("pass", "pass"),
          INFO: ("info", "info"), SKIP: ("skip", "info"), WARNING: ("warn", "info")}


def render_html(outcome: Outcome, verdict: str) -> str:
    res = outcome.result
    env = res.get("environment", {})
    loaded = res.get("loaded") or {}
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>ddpatch verify</title><style>",
           "body{font-family:system-ui,sans-serif;margin:2em;max-width:60em}td,th{padding:2px 8px;text-align:left;vertical-align:top}"
           ".pass{color:#2a6}.fail{color:#c00;font-weight:bold}.inc{color:#b70;font-weight:bold}.info{color:#36c}section{margin-bottom:2em}"
           "svg{max-width:100%;height:auto}",
           "</style></head><body>",
           f"<h1>ddpatch verify</h1><p>{_e(res.get('tree'))}<br>transformers {_e(env.get('transformers'))} · torch {_e(env.get('torch'))}"
           f" · {outcome.seconds:.1f} s</p>"]
    if loaded:
        out.append(f"<p>dtype {_e(loaded.get('dtype'))} · device {_e(loaded.get('device'))} · device_map {_e(loaded.get('device_map') or 'none')}"
                   f" · attention {_e(loaded.get('attn_implementation'))}</p>")
    cls = "pass" if outcome.passed else ("inc" if verdict.startswith("INCONCLUSIVE") else "fail")
    out.append(f"<h2 class='{cls}'>{_e(verdict)}</h2>")
    for m in res.get("models", []):
        cal = m.get("calibration") or {}
        tolerance = m.get("logit_tolerance") or cal.get("tolerance") or 0.0
        out.append(f"<section><h2>{_e(m['model'])}</h2>")
        if cal:
            out.append(f"<p>noise floor {cal['floor']:.2e} ({_e(cal['dtype'])}) × {cal['multiple']:g} = tolerance {tolerance:.2e}"
                       f"{' (set by --logit-tolerance)' if cal.get('override') is not None else ''}; near-tie ε {cal['epsilon']:.2e}</p>")
        out.append("<table><tr><th>check</th><th>result</th><th>evidence</th></tr>")
        checks = [Check.from_json(c) for c in m["checks"]]
        for c in checks:
            mark, css = _MARKS[c.status]
            out.append(f"<tr><td>{_e(c.name)}</td><td class='{css}'>{mark}</td><td>{_e(c.get('evidence', ''))}</td></tr>")
        out.append("</table>")
        if m.get("methods"):
            out.append("<h3>acceptance lengths, every method on one scale</h3>" + acceptance_svg(m["methods"], checks))
        by_budget = budgets_svg(checks)
        if by_budget:
            out.append("<h3>acceptance by tree budget, against DFlash</h3>" + by_budget)
        for c in checks:
            picture = rounds_svg(c) if c.name.startswith("acceptance: ") else ""
            if picture:
                out.append(f"<h3>{_e(c.name)}: every round against a correct decoder's from the same start</h3>" + picture)
        for s in m.get("methods", []):
            out.append(f"<h3>{_e(s['method'])}: {s.get('identical_runs', 0)}/{len(s.get('runs', []))} identical, "
                       f"{s.get('near_ties', 0)} near-tie(s)</h3>")
            out.append(dlogit_svg(s, tolerance, cal.get("floor")))
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out)


def plain_verdict(outcome: Outcome) -> str:
    import re

    from .text import verify_verdict

    return re.sub(r"\[/?(bold )?(green|red|yellow)?\]", "", verify_verdict(outcome))


def write_html(outcome: Outcome, path) -> None:
    from pathlib import Path

    Path(path).write_text(render_html(outcome, plain_verdict(outcome)), encoding="utf-8")
