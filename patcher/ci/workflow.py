"""A GitHub Actions workflow that runs ``ddpatch ci`` on a schedule (``ddpatch ci --print-workflow``)."""

from __future__ import annotations

WORKFLOW_TEMPLATE = "ddpatch-upstream-ci.yml"


def workflow_template() -> str:
    from importlib import resources

    return resources.files("patcher.ci").joinpath("templates").joinpath(WORKFLOW_TEMPLATE).read_text(encoding="utf-8")
