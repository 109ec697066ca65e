"""SARIF 2.1.0 of a ci run, for code-scanning dashboards: rules are the recipe's steps, results the
anchors that no longer match at the newest commit (and verify's failed checks)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .. import __version__, shipped
from ..results import GREEN, CIResult
from ..verify.check import checks_of


def _recipe_location(recipe, step: str | None) -> dict:
    """Where a step is declared in the recipe file (for results that have no upstream location)."""
    uri = recipe.source or f"recipes/{recipe.name}.toml"
    text = None
    try:
        if recipe.source.startswith("recipes/"):
            text = (shipped("recipes") / recipe.source[len("recipes/"):]).read_text(encoding="utf-8")
        elif recipe.source and Path(recipe.source).is_file():
            text = Path(recipe.source).read_text(encoding="utf-8")
    except OSError:
        text = None
    loc: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": uri}}}
    if text and step:
        for i, line in enumerate(text.splitlines(), 1):
            if re.match(rf'\s*id\s*=\s*"{re.escape(step)}"', line):
                loc["physicalLocation"]["region"] = {"startLine": i}
                break
    return loc


def render_sarif(result: CIResult) -> dict:
    """SARIF 2.1.0: one run; rules are the recipe's steps; results are the no-match anchors at the newest commit."""
    recipe, tip = result.recipe, result.tip
    rules = [
        {
            "id": s.id,
            "name": "".join(part.capitalize() for part in re.split(r"[-_]", s.id)),
            "shortDescription": {"text": f"recipe {recipe.name} step {s.id} (codemod {s.codemod}) no longer matches upstream"},
            "fullDescription": {"text": " ".join(s.why.split()) or s.id},
            "defaultConfiguration": {"level": "error"},
            "properties": {"codemod": s.codemod, "anchors": {k: list(v) for k, v in s.anchors.items()}},
        }
        for s in recipe.steps
    ]
    if result.verify:
        rules.append({"id": "verify", "name": "Verify", "shortDescription": {"text": "ddpatch verify failed on the patched upstream tree"},
                      "fullDescription": {"text": "Speculative decoding of the patched tree must equal the target's greedy decoding."},
                      "defaultConfiguration": {"level": "error"}})
    index = {r["id"]: i for i, r in enumerate(rules)}
    results = []
    for sid, entry in tip.steps.items():
        if entry["status"] in GREEN:
            continue
        finding = result.change_in_effect(sid)
        since = (f" ({finding.after} since {finding.commit.short} \"{finding.commit.subject}\")"
                 if finding and finding.after == entry["status"] else "")
        bad = [a for a in entry.get("anchors", []) if a["status"] not in GREEN] or [
            {"function": None, "message": "nothing matched", "path": None, "line": None}]
        for a in bad:
            if a.get("path"):
                loc: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": a["path"]}}}
                if a.get("line"):
                    loc["physicalLocation"]["region"] = {"startLine": int(a["line"])}
            else:
                loc = _recipe_location(recipe, sid)
            results.append({
                "ruleId": sid,
                "ruleIndex": index[sid],
                "level": "error",
                "message": {"text": f"{sid}: {a['message']} at upstream {tip.short}{since}"},
                "locations": [loc],
                "partialFingerprints": {"ddpatchAnchor/v1": f"{sid}:{a.get('function') or '-'}"},
                "properties": {"commit": tip.sha, "function": a.get("function"), "upstream": tip.upstream},
            })
    if result.verify and tip.verify_failed:
        for c in checks_of((tip.verify or {}).get("checks", [])):
            if not c.passed:
                results.append({"ruleId": "verify", "ruleIndex": index["verify"], "level": "error",
                                "message": {"text": f"verify {c.get('model')}: {c.name}: {c.evidence}"},
                                "locations": [_recipe_location(recipe, None)],
                                "properties": {"commit": tip.sha}})
    upstream = recipe.upstreams.get(result.forced_upstream or tip.upstream or "")
    repo_uri = upstream.repository if upstream and upstream.repository else result.repo.path.as_uri()
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "ddpatch", "version": __version__, "semanticVersion": __version__, "rules": rules}},
            "automationDetails": {"id": f"ddpatch-ci/{recipe.name}/{tip.upstream or 'upstream'}/"},
            "versionControlProvenance": [{"repositoryUri": repo_uri, "revisionId": tip.sha}],
            "invocations": [{"executionSuccessful": True, "exitCode": result.exit_code}],
            "results": results,
            "properties": {"recipe": recipe.label, "range": result.commits, "findings": [
                {k: v for k, v in f.as_dict().items() if k != "hunk"} for f in result.findings]},
        }],
    }
