"""The workflow `ddpatch ci --print-workflow` prints for a user's fork is safe to run there.

`zizmor --offline --min-severity medium` (a GitHub Actions static analyser, in the `test`
extra) must find nothing in it; the structural tests below state the same rules without
zizmor (pinned actions, least privilege, no token left on disk, no `${{ }}` in shell code,
only the report files uploaded), and the shell of the steps that take the `since` input is
run with bash, so the hardening is seen to keep the workflow working.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from patcher.cli import main
from patcher.ci.workflow import workflow_template

#: the template before it was hardened (13 findings at medium and above): the check must see them
UNSAFE = '''\
name: unsafe
on:
  workflow_dispatch:
    inputs:
      since:
        required: false
permissions:
  contents: read
  security-events: write
jobs:
  upstream:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - name: since
        run: |
          since="${{ github.event.inputs.since }}"
          echo "since=$since"
      - uses: actions/upload-artifact@v4
        with:
          name: reports
          path: .
  other:
    runs-on: ubuntu-latest
    steps:
      - run: echo "a second job, so the workflow-level permissions are broader than either needs"
'''


def printed_workflow() -> str:
    result = CliRunner().invoke(main, ["ci", "--print-workflow"])
    assert result.exit_code == 0, result.output
    return result.output


def zizmor_binary() -> str | None:
    found = shutil.which("zizmor")
    if found:
        return found
    beside = Path(sys.executable).parent / "zizmor"  # installed into this interpreter's environment
    return str(beside) if beside.is_file() else None


def zizmor_findings(text: str, tmp_path: Path) -> tuple[int, list[dict]]:
    exe = zizmor_binary()
    if exe is None:
        pytest.skip("zizmor is not installed (pip install zizmor, or the `test` extra)")
    path = tmp_path / ".github" / "workflows" / "ddpatch-upstream-ci.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    # no config and no ignore comments: nothing in the file or the tree can silence a finding
    proc = subprocess.run([exe, "--offline", "--no-config", "--no-ignores", "--min-severity", "medium", "--format", "json", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip(), f"zizmor printed nothing (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return proc.returncode, json.loads(proc.stdout)


def test_zizmor_finds_nothing_in_the_printed_workflow(tmp_path):
    code, findings = zizmor_findings(printed_workflow(), tmp_path)
    assert findings == [], "\n".join(f"{f['ident']}: {f['desc']} at line "
                                     f"{f['locations'][0]['concrete']['location']['start_point']['row'] + 1}" for f in findings)
    assert code == 0


def test_zizmor_check_sees_the_unsafe_shapes(tmp_path):
    """The control: the same check on the old shapes reports each kind of finding the template avoids."""
    code, findings = zizmor_findings(UNSAFE, tmp_path)
    kinds = {f["ident"] for f in findings}
    assert {"template-injection", "unpinned-uses", "artipacked", "excessive-permissions"} <= kinds, kinds
    assert code != 0


# ----------------------------------------------------------------------------- the same rules, without zizmor
def workflow() -> dict:
    return yaml.safe_load(workflow_template())


def steps() -> list[tuple[str, dict]]:
    return [(job, step) for job, body in workflow()["jobs"].items() for step in body["steps"]]


def test_every_action_is_pinned_to_a_commit_sha_with_its_release_named():
    lines = [line.strip() for line in workflow_template().splitlines() if re.match(r"\s*(- )?uses:", line)]
    assert len(lines) == 8
    pins: dict[str, set[str]] = {}
    for line in lines:
        m = re.fullmatch(r"(?:- )?uses: ([\w.-]+/[\w./-]+)@([0-9a-f]{40}) # (v\d+\.\d+\.\d+)", line)
        assert m, f"not pinned to a full commit SHA with a `# vX.Y.Z` comment: {line}"
        pins.setdefault(m.group(1), set()).add(m.group(2) + " " + m.group(3))
    assert all(len(v) == 1 for v in pins.values()), pins  # one action, one pin


def test_permissions_are_none_at_the_top_and_least_per_job():
    flow = workflow()
    assert flow["permissions"] == {}
    jobs = flow["jobs"]
    assert jobs["upstream"]["permissions"] == {"contents": "read", "security-events": "write", "checks": "write"}
    assert jobs["newest-transformers"]["permissions"] == {"contents": "read"}


def test_checkout_keeps_no_token_and_only_reports_are_uploaded():
    checkouts = [s for _, s in steps() if s.get("uses", "").startswith("actions/checkout@")]
    assert len(checkouts) == 2 and all(s["with"]["persist-credentials"] is False for s in checkouts)
    uploads = [s for _, s in steps() if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert len(uploads) == 2
    for step in uploads:
        paths = step["with"]["path"].splitlines()
        assert paths and all(re.fullmatch(r"reports/[^/*]+\.(json|sarif|xml|txt)", p) for p in paths), paths


def test_no_expression_is_expanded_inside_shell_code():
    runs = [(job, s.get("name"), s["run"]) for job, s in steps() if "run" in s]
    assert len(runs) >= 5
    assert [(job, name) for job, name, run in runs if "${{" in run] == []


# ----------------------------------------------------------------------------- the shell still works
def step_named(name: str) -> dict:
    return next(s for _, s in steps() if s.get("name") == name)


def bash_step(step: dict, tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, Path]:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    output = tmp_path / "github_output"
    output.write_text("")
    full = {"PATH": os.environ["PATH"], "GITHUB_OUTPUT": str(output), "RUNNER_TEMP": str(tmp_path), "LOCK": "ddpatch-upstream.lock", **env}
    # what GitHub runs a `run:` with: bash -e {0}, with -o pipefail
    proc = subprocess.run([bash, "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
                          cwd=tmp_path, env=full, capture_output=True, text=True, timeout=60)
    return proc, output


@pytest.mark.parametrize("given, lock, expected", [
    ("", None, ""),
    ("", '[ddtree]\nlast_verified = "dafc3b9"\n', "dafc3b9"),
    ("44947fb", '[ddtree]\nlast_verified = "dafc3b9"\n', "44947fb"),  # the input wins over the lock
    ("main~3", None, "main~3"),
])
def test_since_comes_from_the_input_or_the_lock(tmp_path, given, lock, expected):
    if lock is not None:
        (tmp_path / "ddpatch-upstream.lock").write_text(lock)
    env = {"UPSTREAM": "ddtree", "SINCE_INPUT": given, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc, output = bash_step(step_named("Find the last verified commit"), tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert output.read_text() == f"since={expected}\n"


@pytest.mark.parametrize("given", ['$(touch pwned)', "a; touch pwned", "--update-lock", "a\nexit_code=0", "a b"])
def test_a_since_that_is_not_a_commit_ish_is_refused_as_data(tmp_path, given):
    proc, output = bash_step(step_named("Find the last verified commit"), tmp_path, {"UPSTREAM": "ddtree", "SINCE_INPUT": given})
    assert proc.returncode == 2 and "expected a commit-ish" in proc.stderr
    assert output.read_text() == "" and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("since, expected", [("", []), ("dafc3b9", ["--since=dafc3b9"])])
def test_the_ci_step_passes_since_only_when_there_is_one(tmp_path, since, expected):
    fake = tmp_path / "bin" / "ddpatch"  # records its arguments, one per line
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$RUNNER_TEMP/args"\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {"UPSTREAM": "ddtree", "SINCE": since, "RECIPE": "qwen3_6-gdn", "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    proc, output = bash_step(step_named("ddpatch ci"), tmp_path, env)
    args = (tmp_path / "args").read_text().splitlines()
    assert proc.returncode == 1 and output.read_text() == "exit_code=1\n"  # ddpatch's exit status is the step's
    assert args[:7] == ["ci", "--recipe", "qwen3_6-gdn", "--upstream", "ddtree", "--repo", f"{tmp_path}/ddtree.git"]
    assert [a for a in args if a.startswith("--since")] == expected
    assert "reports/ddtree.junit.xml" in args and (tmp_path / "reports" / "ddtree.txt").exists()
