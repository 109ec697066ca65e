"""The README and docs/ describe only what exists: every `ddpatch` command and option they mention is in the
click command tree, every repository path they name exists, every relative link resolves, and none of the
contradictions issue 24 found survives."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from patcher.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
SETUP = ["python3 -m pip install torch==2.13.0 -e . && ddpatch demo",
         'python3 -m pip install -q torch==2.13.0 -e ".[test]" && python3 -m pytest -q']
PATH = re.compile(r"^(?:patcher|tests|benchmarks|tools|recipes|vendored|docs|\.ci)/[\w./-]*$|^(?:README|CONTRIBUTING)\.md$|^LICENSE$|^pyproject\.toml$")
INTERNAL = ["these machines", "this 2-CPU machine", "this 2-core machine", "no GPU was available to this work", "no GPU was lent"]


def command_tree() -> dict[tuple[str, ...], click.Command]:
    out: dict[tuple[str, ...], click.Command] = {(): main}

    def walk(prefix, group):
        for name, cmd in group.commands.items():
            out[prefix + (name,)] = cmd
            if isinstance(cmd, click.Group):
                walk(prefix + (name,), cmd)

    walk((), main)
    return out


def options_of(cmd: click.Command) -> set[str]:
    opts = {"--help", "-h"}
    for p in cmd.params:
        if isinstance(p, click.Option):
            opts |= set(p.opts) | set(p.secondary_opts)
    return opts


TREE = command_tree()
ALL_OPTIONS = set().union(*(options_of(c) for c in TREE.values()))


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def inline_code(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", prose)


def invocations(text: str) -> list[str]:
    """Every `ddpatch ...` command line: in code blocks (continuation lines joined) and in inline code."""
    found = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            for part in re.split(r"&&|\||;|>", line):
                part = part.strip()
                if part.startswith("ddpatch ") or part == "ddpatch":
                    found.append(part)
    found += [c for c in inline_code(text) if c.startswith("ddpatch ")]
    return found


def check_invocation(line: str) -> list[str]:
    tokens = line.split()[1:]
    path: tuple[str, ...] = ()
    while tokens and path + (tokens[0],) in TREE:
        path += (tokens.pop(0),)
    if tokens and not path and not tokens[0].startswith("-"):
        return [f"{line!r}: no command {tokens[0]!r}"]
    cmd = TREE[path]
    problems = []
    for token in tokens:
        if re.match(r"^--?[a-zA-Z]", token):
            name = token.split("=")[0]
            if name not in options_of(cmd):
                problems.append(f"{line!r}: `ddpatch {' '.join(path)}` has no option {name}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_command_and_option_mentioned_exists(doc):
    text = doc.read_text(encoding="utf-8")
    problems = [p for line in invocations(text) for p in check_invocation(line)]
    scripts = [ROOT / c.split()[-1] for c in inline_code(text) + re.findall(r"python3? ([\w/.-]+\.(?:py|sh))", text)
               if re.match(r"^[\w/.-]+\.(py|sh)$", c.split()[-1]) and (ROOT / c.split()[-1]).is_file()]
    script_text = "".join(p.read_text(encoding="utf-8") for p in set(scripts))
    for code in inline_code(text):  # an option named on its own, `--allow-lossy` or `--lock FILE`
        m = re.match(r"^(--[a-z][\w-]*)(?:[ =].*)?$", code)
        if m and m.group(1) not in ALL_OPTIONS and m.group(1) not in script_text:  # else an option of a script the page runs
            problems.append(f"`{code}`: no ddpatch command (nor a script the page names) has {m.group(1)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_repository_path_and_link_exists(doc):
    text = doc.read_text(encoding="utf-8")
    missing = []
    for code in inline_code(text):
        token = code.split()[0] if code.split() else code
        token = token.split(":")[0].rstrip("/.,")
        if PATH.match(token) and "<" not in token and "*" not in token and not (ROOT / token).exists():
            missing.append(f"`{code}`")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (doc.parent / target.split("#")[0]).exists():
            missing.append(f"link {target}")
    assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_no_internal_wording(doc):
    text = doc.read_text(encoding="utf-8")
    assert not [w for w in INTERNAL if w in text]


def test_readme_starts_where_the_user_is():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    commands = [line for line in code_blocks(text)[0].splitlines() if line and not line.startswith("#")]
    assert commands[:2] == SETUP, "the two set-up commands stay the README's first commands"
    assert SETUP[1] in (ROOT / ".ci" / "run").read_text(), ".ci/run runs the README's test command"
    order = [text.index(f"ddpatch {c} ") for c in ("check", "diff", "apply", "verify")]
    assert order == sorted(order) and order[0] < text.index("## Next, on a GPU")
    for heading in ("## Install", "## Supported versions", "## Troubleshooting", "## Cleanup", "## License"):
        assert heading in text
    assert "clone URL" in text and "$DDPATCH_HOME" in text and "~/.cache/ddpatch" in text
    assert (ROOT / "LICENSE").read_text().startswith("MIT License") and "ddpatch contributors" in (ROOT / "LICENSE").read_text()


def test_the_contradictions_issue_24_found_are_gone():
    from patcher.ci.workflow import WORKFLOW_TEMPLATE
    from patcher.results import ALREADY_APPLIED, APPLIED, FIXED_UPSTREAM, NO_MATCH, PENDING, SKIPPED

    texts = {d.name: d.read_text(encoding="utf-8") for d in DOCS}
    everything = "\n".join(texts.values())
    for name in re.findall(r"\.github/workflows/([\w.-]+\.yml)", everything):
        assert name == WORKFLOW_TEMPLATE, f"the workflow file is {WORKFLOW_TEMPLATE}, not {name}"
    statuses = texts["statuses.md"]
    for status in (APPLIED, ALREADY_APPLIED, FIXED_UPSTREAM, NO_MATCH, PENDING, SKIPPED):
        assert f"`{status}`" in statuses, status
    # exit codes are defined once, in docs/exit-codes.md; nothing says no-match is 2
    assert not re.search(r"no-match[^.\n]*\b(exit|exits)\s+2\b", everything)
    # one figure per measurement: the verify time of the default preset is given once
    assert len(re.findall(r"\b\d+\.\d+ s\b.*median of 3", everything)) <= 1
    assert "17.8 s" not in everything


def test_the_checker_catches_a_made_up_command_and_option():
    assert check_invocation("ddpatch frobnicate x")
    assert check_invocation("ddpatch demo --format yaml --no-such-flag")
    assert not check_invocation("ddpatch demo --format json")
    assert not check_invocation("ddpatch recipes show qwen3_6-gdn --format json")
    assert check_invocation("ddpatch recipes list --stat")
