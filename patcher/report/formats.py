"""One entry point per result kind for the formats it has: ``render_ci`` gives text, JSON, JUnit or SARIF."""

from __future__ import annotations

import json

from ..results import CIResult
from .json_report import ci_payload
from .junit import render_junit
from .sarif import render_sarif
from .text import render_ci

CI_FORMATS = ("text", "json", "junit", "sarif")


def render_ci_as(result: CIResult, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(ci_payload(result), indent=2) + "\n"
    if fmt == "junit":
        return render_junit(result)
    if fmt == "sarif":
        return json.dumps(render_sarif(result), indent=2) + "\n"
    return render_ci(result)
