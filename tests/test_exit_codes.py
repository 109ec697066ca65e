"""One exit-code scheme for every command, as ruff's (docs/exit-codes.md): 0 clean; 1 findings; 2 usage or
input error; 3 internal crash; 130 Ctrl-C. Each command is run through each code that it can give.

Codes 0, 1 and 2 come from real runs (the verifier's verdict is stubbed: a real one is tests/test_verify.py's);
3 and 130 from the API function each command calls raising a bug or KeyboardInterrupt.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_support import run

from patcher import api
from patcher.results import EXIT_ERROR, EXIT_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, Outcome

ROOT = Path(__file__).resolve().parent.parent
ONE = ["--recipe", "qwen3_6-gdn", "--select", "cpu-safe-timing", "-j", "1"]
TIMING = "import torch\n\n\ndef timed():\n    torch.cuda.synchronize()\n"
GUARDED = "import torch\n\n\ndef timed():\n    if torch.cuda.is_available():\n        torch.cuda.synchronize()\n"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))


def tree(tmp_path: Path, text: str, name: str = "t") -> Path:
    root = tmp_path / name
    root.mkdir()
    (root / "timing.py").write_text(text)
    return root


def outcome(passed: bool) -> Outcome:
    return Outcome({"tree": "x", "checks": [{"check": "token identity", "passed": passed, "evidence": "stub"}]}, 0.0)


def test_the_codes_are_the_documented_ones():
    assert (EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERNAL, EXIT_INTERRUPTED) == (0, 1, 2, 3, 130)
    text = (ROOT / "docs" / "exit-codes.md").read_text()
    for code in ("0", "1", "2", "3", "130"):
        assert f"| {code} " in text


# ----------------------------------------------------------------------------- 0 clean, 1 findings, 2 bad input
def test_check_diff_apply(tmp_path):
    pending, clean = tree(tmp_path, TIMING, "pending"), tree(tmp_path, GUARDED, "clean")
    for command in ("check", "diff"):
        assert run(command, clean, *ONE).exit_code == 0
        assert run(command, pending, *ONE).exit_code == 1, "changes pending are a finding"
        assert run(command, tmp_path / "missing", *ONE).exit_code == 2
    assert run("apply", clean, *ONE).exit_code == 0
    os.mkfifo(pending / "x.py")  # a skipped file is a finding: nothing is written
    assert run("apply", pending, *ONE).exit_code == 1
    (pending / "x.py").unlink()
    assert run("apply", pending, *ONE, "--jobs", "0").exit_code == 2
    assert run("apply", pending, *ONE).exit_code == 0


def test_revert(tmp_path):
    root = tree(tmp_path, TIMING)
    assert run("revert", root).exit_code == 2, "nothing recorded"
    assert run("apply", root, *ONE).exit_code == 0
    assert run("revert", root).exit_code == 0
    again = run("revert", root)
    assert again.exit_code == 0 and "already reverted" in again.output


def test_recipes():
    assert run("recipes", "list").exit_code == 0
    assert run("recipes", "show", "qwen3_6-gdn").exit_code == 0
    assert run("recipes", "show", "nope").exit_code == 2


@pytest.mark.parametrize("passed,code", [(True, 0), (False, 1)])
def test_verify(tmp_path, monkeypatch, passed, code):
    monkeypatch.setattr(api, "verify", lambda *a, **k: outcome(passed))
    assert run("verify", tmp_path).exit_code == code
    assert json.loads(run("verify", tmp_path, "--format", "json").stdout)["exit_code"] == code


def test_verify_bad_input_is_2(tmp_path):
    assert run("verify", tmp_path / "missing").exit_code == 2


@pytest.mark.parametrize("passed,code", [(True, 0), (False, 1)])
def test_demo(tmp_path, monkeypatch, passed, code):
    monkeypatch.setattr(api, "verify", lambda *a, **k: outcome(passed))
    result = run("demo", "--format", "json")
    assert result.exit_code == code, result.output
    payload = json.loads(result.stdout)
    assert payload["command"] == "demo" and payload["exit_code"] == code and payload["verify"]["passed"] is passed


def test_demo_bad_input_is_2(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert run("demo", "--out", tmp_path / "full", "--no-verify").exit_code == 2


@pytest.mark.parametrize("code", [0, 1])
def test_ci(monkeypatch, code):
    monkeypatch.setattr(api, "ci", lambda *a, **k: SimpleNamespace(exit_code=code))
    monkeypatch.setattr("patcher.commands.ci.render_ci_as", lambda result, fmt: "stub\n")
    assert run("ci", "--repo", ".").exit_code == code


def test_ci_bad_input_is_2():
    assert run("ci").exit_code == 2  # no --repo
    assert run("ci", "--repo", ".", "--preset", "foo").exit_code == 2


# ----------------------------------------------------------------------------- 3 internal error, 130 Ctrl-C
CALLS = [
    (["recipes", "list"], "recipes"),
    (["recipes", "show", "qwen3_6-gdn"], "recipe_docs"),
    (["check", "{tree}", *ONE], "check"),
    (["diff", "{tree}", *ONE], "diff"),
    (["apply", "{tree}", *ONE], "apply"),
    (["revert", "{tree}"], "revert"),
    (["verify", "{tree}"], "verify"),
    (["demo"], "patch_builtin"),
    (["ci", "--repo", "{tree}"], "ci"),
]


@pytest.mark.parametrize("args,function", CALLS, ids=[" ".join(a[:2]) for a, _ in CALLS])
@pytest.mark.parametrize("raised,code,needle", [(RuntimeError("boom"), 3, "internal error: RuntimeError: boom"),
                                                (KeyboardInterrupt(), 130, "interrupted")], ids=["crash", "ctrl-c"])
def test_every_command_gives_3_on_a_crash_and_130_on_ctrl_c(tmp_path, monkeypatch, args, function, raised, code, needle):
    def boom(*a, **k):
        raise raised

    monkeypatch.setattr(api, function, boom)
    root = tree(tmp_path, TIMING)
    argv = [a.replace("{tree}", str(root)) for a in args]
    result = run(*argv)
    assert result.exit_code == code, (argv, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpatch: error: ") and needle in lines[0], lines
    if "--format" not in argv and argv[0] != "demo" and argv[0] != "ci":
        payload = json.loads(run(*argv, "--format", "json").stdout)
        assert payload["exit_code"] == code and payload["command"] == " ".join(argv[:2] if argv[0] == "recipes" else argv[:1])


#: How long ``apply`` may take to exit after its SIGINT. One file's write delay is 20 s, so a
#: process that does not act on the signal (SIGINT ignored: inherited from a runner that
#: ignores it, as a shell does for a background job) is caught before it would finish its
#: writes and exit 0 on its own.
SIGINT_EXIT_S = 15


def _ignores_sigint(pid: int) -> bool:
    """Whether SIGINT is ignored in process ``pid`` (bit 1 of ``SigIgn`` in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigIgn:")), 0)
    return bool(mask & (1 << (signal.SIGINT - 1)))


def _default_sigint() -> None:
    # The test's runner may ignore SIGINT (a CI step run as a background job, nohup): an ignored
    # SIGINT is inherited through fork and exec, and Python then installs no KeyboardInterrupt
    # handler, so the Ctrl-C this test sends would never reach ddpatch. Ctrl-C in a terminal is
    # delivered to a process whose SIGINT is the default, as here.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_real_ctrl_c_exits_130(tmp_path):
    """A real SIGINT between two writes: one line and exit 130, within ``SIGINT_EXIT_S``.
    A run that does not exit in time is stopped with SIGABRT, which makes Python's faulthandler
    print every thread's stack: the failure shows where it was stuck."""
    root = tmp_path / "t"
    root.mkdir()
    for i in range(3):
        (root / f"timing{i}.py").write_text(TIMING)
    env = {**os.environ, "DDPATCH_TEST_WRITE_DELAY": "20", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "patcher", "apply", str(root), *ONE], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    try:
        # ready: the first file is written, so ddpatch is past its imports, in its write loop
        deadline = time.monotonic() + 120
        while all((root / f"timing{i}.py").read_text() == TIMING for i in range(3)):
            assert proc.poll() is None, f"apply exited ({proc.returncode}) before writing a file: {proc.communicate()}"
            assert time.monotonic() < deadline, "apply wrote no file within 120 s"
            time.sleep(0.05)
        ignored = _ignores_sigint(proc.pid)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=SIGINT_EXIT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack on stderr
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"apply did not exit within {SIGINT_EXIT_S} s of its SIGINT (SIGINT ignored in it: {ignored}); "
                        f"its stack at SIGABRT:\n{err}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["ddpatch: error: interrupted"]


def test_the_ctrl_c_test_reaches_ddpatch_when_its_runner_ignores_sigint(tmp_path):
    """The cause of a Ctrl-C test that waited out apply's writes: a runner that ignores SIGINT
    passes that on to ddpatch. With the test's own reset (``_default_sigint``) the child takes SIGINT."""
    code = ("import signal, subprocess, sys; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "sys.path.insert(0, sys.argv[1]); from test_exit_codes import _default_sigint\n"
            "cmd = [sys.executable, '-c', 'import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)']\n"
            "plain = subprocess.run(cmd, capture_output=True, text=True).stdout.strip()\n"
            "reset = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=_default_sigint).stdout.strip()\n"
            "print(plain, reset)\n")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.stdout.split() == ["False", "True"], done.stderr
