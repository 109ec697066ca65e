"""JUnit XML of a ci run: one testsuite per evaluated commit, one testcase per step and per verify check."""

from __future__ import annotations

from ..results import GREEN, CIResult
from ..verify.check import checks_of


def render_junit(result: CIResult) -> str:
    """JUnit XML: one testsuite per evaluated commit, one testcase per step and per verify check."""
    import xml.etree.ElementTree as ET

    root = ET.Element("testsuites", name=f"ddpatch ci {result.recipe.label}")
    totals = {"tests": 0, "failures": 0, "skipped": 0}
    for ev in result.evaluated:
        suite = ET.SubElement(root, "testsuite", name=f"{ev.short} {ev.subject}"[:200], id=ev.sha, time=f"{ev.seconds:.3f}")
        props = ET.SubElement(suite, "properties")
        for key, value in (("commit", ev.sha), ("date", ev.date), ("upstream", ev.upstream or ""), ("recipe", result.recipe.label)):
            ET.SubElement(props, "property", name=key, value=value)
        counts = {"tests": 0, "failures": 0, "skipped": 0}
        classname = f"{result.recipe.name}.{ev.short}"
        for sid in result.step_ids:
            case = ET.SubElement(suite, "testcase", classname=classname, name=sid, time="0")
            counts["tests"] += 1
            entry = ev.steps.get(sid)
            if entry is None:
                anchored = any(spec.anchors for spec in result.recipe.steps if spec.id == sid)
                ET.SubElement(case, "skipped", message=f"step does not apply to upstream {ev.upstream or '(undetected)'}"
                              if anchored else "the step found no site at this commit (it has no anchors)")
                counts["skipped"] += 1
                continue
            lines = [f"{a['status']}: {a.get('path') or '-'}:{a.get('line') or '-'} {a.get('function') or ''}: {a['message']}"
                     for a in entry.get("anchors", [])]
            if entry["status"] not in GREEN:
                bad = [a["message"] for a in entry.get("anchors", []) if a["status"] not in GREEN] or ["nothing matched"]
                fail = ET.SubElement(case, "failure", message=f"{entry['status']}: {'; '.join(bad)}"[:1000], type=entry["status"])
                finding = result.change_in_effect(sid) if ev is result.tip else None
                extra = [f"in effect since: {finding.before} -> {finding.after} at {finding.commit.sha} {finding.commit.subject}"] if finding else []
                fail.text = "\n".join(lines + extra)
                counts["failures"] += 1
            else:
                ET.SubElement(case, "system-out").text = f"{entry['status']}\n" + "\n".join(lines)
        v = ev.verify
        if v is not None:
            if v.get("passed") is None:
                case = ET.SubElement(suite, "testcase", classname=f"{classname}.verify", name="verify", time="0")
                ET.SubElement(case, "skipped", message=v.get("skipped", "not run"))
                counts["tests"] += 1
                counts["skipped"] += 1
            for c in checks_of((ev.verify or {}).get("checks", [])):
                case = ET.SubElement(suite, "testcase", classname=f"{classname}.verify", name=f"{c.get('model')}: {c.name}", time="0")
                counts["tests"] += 1
                evidence = c.get("evidence", "")
                if c.passed:
                    ET.SubElement(case, "system-out").text = evidence
                else:
                    ET.SubElement(case, "failure", message=str(evidence)[:1000], type="verify").text = str(evidence)
                    counts["failures"] += 1
        suite.set("tests", str(counts["tests"]))
        suite.set("failures", str(counts["failures"]))
        suite.set("errors", "0")
        suite.set("skipped", str(counts["skipped"]))
        for k in totals:
            totals[k] += counts[k]
    root.set("tests", str(totals["tests"]))
    root.set("failures", str(totals["failures"]))
    root.set("errors", "0")
    root.set("skipped", str(totals["skipped"]))
    root.set("time", f"{result.seconds:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
