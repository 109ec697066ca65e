"""``ddpatch verify --html FILE``: one offline, self-contained page that shows why the verdict is what it is.

Per model: the checks, then per method an inline SVG of |Δlogit| per new token (the worst run at each
position) against the calibrated tolerance and the noise floor, near-ties marked on the axis, and
the acceptance histogram. No script, no network, no plotting library: plain SVG and CSS.
"""

from __future__ import annotations

import html
import math

from ..results import Outcome

W, H, PAD = 640, 220, 46


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

    def x(i):
        return PAD + (W - 2 * PAD) * (i + 0.5) / n

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" '
             f'aria-label="|Δlogit| per new token for {_e(method["method"])}">',
             f'<rect x="{PAD}" y="{PAD // 2}" width="{W - 2 * PAD}" height="{H - 1.5 * PAD}" fill="#fafafa" stroke="#ccc"/>']
    decade = lo
    while decade <= hi * 1.0001:
        y = _y(decade, lo, hi)
        parts.append(f'<line x1="{PAD}" x2="{W - PAD}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="{PAD - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{decade:.0e}</text>')
        decade *= 10
    for value, colour, label in ((tolerance, "#c00", "tolerance"), (floor, "#888", "noise floor")):
        if value:
            y = _y(value, lo, hi)
            parts.append(f'<line x1="{PAD}" x2="{W - PAD}" y1="{y:.1f}" y2="{y:.1f}" stroke="{colour}" stroke-dasharray="5,3"/>'
                         f'<text x="{W - PAD + 2}" y="{y + 4:.1f}" font-size="10" fill="{colour}">{label}</text>')
    for i in ties:
        parts.append(f'<rect x="{x(i) - 4:.1f}" y="{H - PAD + 2}" width="8" height="8" fill="#e90">'
                     f'<title>near-tie at new token {i}</title></rect>')
    for i, d in sorted(worst.items()):
        colour = "#c00" if d > tolerance else "#2a6"
        parts.append(f'<circle cx="{x(i):.1f}" cy="{_y(max(d, lo), lo, hi):.1f}" r="3" fill="{colour}">'
                     f'<title>new token {i}: |Δlogit| {d:.2e}</title></circle>')
    parts.append(f'<text x="{W / 2}" y="{H - 6}" font-size="11" text-anchor="middle">new token (■ near-tie)</text></svg>')
    return "".join(parts)


def histogram_svg(histogram: dict) -> str:
    if not histogram:
        return "<p>no acceptance lengths</p>"
    items = sorted((int(k), v) for k, v in histogram.items())
    top = max(v for _, v in items)
    bar, h = 28, 90
    width = len(items) * (bar + 6) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h + 30}" role="img" aria-label="acceptance histogram">']
    for j, (k, v) in enumerate(items):
        bh = h * v / top
        x = 5 + j * (bar + 6)
        parts.append(f'<rect x="{x}" y="{h - bh + 5:.1f}" width="{bar}" height="{bh:.1f}" fill="#36c"><title>{v} rounds accepted {k}</title></rect>'
                     f'<text x="{x + bar / 2}" y="{h + 18}" font-size="10" text-anchor="middle">{k}</text>'
                     f'<text x="{x + bar / 2}" y="{h - bh + 2:.1f}" font-size="9" text-anchor="middle">{v}</text>')
    return "".join(parts) + "</svg>"


def render_html(outcome: Outcome, verdict: str) -> str:
    res = outcome.result
    env = res.get("environment", {})
    loaded = res.get("loaded") or {}
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>ddpatch verify</title><style>",
           "body{font-family:system-ui,sans-serif;margin:2em;max-width:60em}td,th{padding:2px 8px;text-align:left;vertical-align:top}"
           ".pass{color:#2a6}.fail{color:#c00;font-weight:bold}.inc{color:#b70;font-weight:bold}section{margin-bottom:2em}",
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
        for c in m["checks"]:
            mark = "pass" if c["passed"] else ("inconclusive" if c.get("inconclusive") else "FAIL")
            css = "pass" if c["passed"] else ("inc" if c.get("inconclusive") else "fail")
            out.append(f"<tr><td>{_e(c['check'])}</td><td class='{css}'>{mark}</td><td>{_e(c.get('evidence', ''))}</td></tr>")
        out.append("</table>")
        for s in m.get("methods", []):
            out.append(f"<h3>{_e(s['method'])}: {s.get('identical_runs', 0)}/{len(s.get('runs', []))} identical, "
                       f"{s.get('near_ties', 0)} near-tie(s)</h3>")
            out.append(dlogit_svg(s, tolerance, cal.get("floor")))
            out.append("<p>acceptance lengths</p>" + histogram_svg(s.get("acceptance_histogram", {})))
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
