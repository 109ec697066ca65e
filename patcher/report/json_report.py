"""JSON for programs: every command's payload is its result object's plain data, with the command's
name and exit code (``--format json`` prints one on every path, errors included)."""

from __future__ import annotations

from typing import Any

from ..results import ApplyResult, CIResult, Outcome, Report, StepDoc
from ..verify.check import INCONCLUSIVE, checks_of


def patch_payload(report: Report, command: str, code: int, **extra: Any) -> dict:
    """apply / diff / check."""
    return {"command": command, **report.as_dict(), "exit_code": code, **extra}


def apply_payload(result: ApplyResult, code: int) -> dict:
    return patch_payload(result.report, "apply", code, written=result.written, out=str(result.out) if result.out else None)


def verify_payload(outcome: Outcome, code: int) -> dict:
    return {"command": "verify", "passed": outcome.passed, "verdict": verify_verdict_word(outcome), "seconds": round(outcome.seconds, 2),
            **outcome.result, **_tested_environment(outcome.result), "exit_code": code}


def verify_verdict_word(outcome: Outcome) -> str:
    """pass, fail, or inconclusive (every failed check is one that cannot judge in this dtype: never a pass)."""
    if outcome.passed:
        return "pass"
    failed = [c for c in checks_of(outcome.checks) if not c.passed]
    return "inconclusive" if failed and all(c.status == INCONCLUSIVE for c in failed) else "fail"


def _tested_environment(result: dict) -> dict:
    """The worker's ``environment``, plus whether its transformers is inside ddpatch's tested range."""
    env = result.get("environment")
    if not isinstance(env, dict) or "transformers" not in env:
        return {}
    from ..env import range_text, tested_range_status

    return {"environment": {**env, "transformers_tested_range": range_text("transformers"),
                            "transformers_in_tested_range": tested_range_status("transformers", env["transformers"])}}


def error_payload(command: str | None, message: str, code: int, **extra: Any) -> dict:
    """What a script gets on stdout when a command stops with an error."""
    return {"command": command, **extra, "error": message, "exit_code": code}


def revert_payload(root: str, result, code: int) -> dict:
    return {"command": "revert", "root": root, "restored": result.restored,
            "overwritten": [{"path": p, "backup": b} for p, b in result.overwritten],
            "already_reverted": result.already_reverted is not None, "exit_code": code}


def recipes_payload(recipes: list) -> dict:
    return {"recipes": [{"name": r.name, "version": r.version, "description": r.description,
                         "verified": r.verified, "refused": r.refused} for r in recipes]}


def recipe_payload(recipe, docs: list[StepDoc]) -> dict:
    steps = []
    for d in docs:
        s = d.spec
        steps.append(
            {
                "id": s.id,
                "codemod": s.codemod,
                "description": d.description,
                "why": s.why,
                "params": d.params,
                "anchors": {k: list(v) for k, v in s.anchors.items()},
                "upstreams": list(s.upstreams),
                "examples": [{"before": e.before, "after": e.after, "note": e.note} for e in d.examples],
            }
        )
    return {"name": recipe.name, "version": recipe.version, "transformers": recipe.transformers, "steps": steps,
            "verified": recipe.verified, "refused": recipe.refused}


def ci_payload(result: CIResult) -> dict:
    return result.as_dict()
