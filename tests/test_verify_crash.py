"""A verifier child that dies without a result: the error says how it ended (its signal, its exit
status, its peak memory) and what to try, never only "died without a result".

Most tests run ``run_verify`` with a stand-in worker (a small script that reads its request and
then dies as told), so the parent's side is tested in milliseconds; the last two run the real
worker on a tree that kills its own process when imported: fresh through the CLI (exit 3, one
error line), and forked from the session's warm verifier (status unknown there, said so).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from patcher import api
from patcher.errors import VerifierCrash, VerifyError
from patcher.verify.process import exitstatus, runner

ROOT = Path(__file__).resolve().parent.parent

FAKE_WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    cfg = json.loads(sys.stdin.read())
    print(json.dumps({"event": "progress", "done": 0, "total": 1, "label": "loaded"}), flush=True)
    print("a last word from the tree", flush=True)
    how = os.environ["DDPATCH_TEST_DEATH"]
    if os.environ.get("DDPATCH_TEST_HOLD"):  # a subprocess that keeps the output pipe open after the worker died
        import subprocess
        held = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        with open(os.environ["DDPATCH_TEST_HOLD"], "w") as f:
            f.write(str(held.pid))
    ballast = bytearray(int(os.environ.get("DDPATCH_TEST_BALLAST", "0")))
    for i in range(0, len(ballast), 4096):  # touch every page: resident, not only reserved
        ballast[i] = 1
    if os.environ.get("DDPATCH_TEST_PID"):
        with open(os.environ["DDPATCH_TEST_PID"], "w") as f:
            f.write(str(os.getpid()))
    if how == "sleep":
        time.sleep(60)
    elif how.startswith("exit"):
        os._exit(int(how[4:]))
    else:
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(5)
""")

#: the least a tree needs for verify to start its child: one function that runs a model with a cache round after round
DECODER = textwrap.dedent("""
    def dflash_generate(model, target, input_ids, past_key_values=None):
        for _ in range(3):
            target(input_ids, past_key_values=past_key_values)
""")


def a_tree(root: Path) -> Path:
    tree = root / "tree"
    tree.mkdir(exist_ok=True)
    (tree / "decoder.py").write_text(DECODER)
    return tree


@pytest.fixture
def dies(tmp_path, monkeypatch):
    """``dies("SIGKILL", ballast=N)``: the VerifierCrash message of a verify whose child dies that way."""
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(runner, "WORKER", worker)
    monkeypatch.delenv(runner.WARM_ENV, raising=False)  # a fresh child: its exit status is ours to read

    def run(how: str, ballast: int = 0, **options) -> str:
        monkeypatch.setenv("DDPATCH_TEST_DEATH", how)
        monkeypatch.setenv("DDPATCH_TEST_BALLAST", str(ballast))
        if not options.get("target"):  # one child (a default verify runs two side by side): its own peak is the figure
            options.setdefault("presets", ["tiny-qwen3_5"])
        with pytest.raises(VerifierCrash) as info:
            runner.run_verify(a_tree(tmp_path), timeout=60, **options)
        return str(info.value)

    return run


def _peak_gb(message: str) -> float:
    found = re.search(r"peak RSS (?:at least )?([0-9.]+) GiB", message)
    assert found, message
    return float(found.group(1))


def test_a_sigkill_names_the_signal_memory_and_what_to_try(dies):
    # 1.2 GB = 1.12 GiB: the child's own peak (wait4), not the parent's. The ballast is larger than a pytest worker that
    # imported torch (about 0.6 GiB): wait4's figure also covers the forked copy of the parent before its exec
    message = dies("SIGKILL", ballast=1_200_000_000)
    assert "killed by SIGKILL (signal 9)" in message, message
    assert "most likely out of memory" in message, message
    assert 1.1 <= _peak_gb(message) <= 1.3, message
    assert "--prompts 1" in message and "more memory" in message, message
    assert "a last word from the tree" in message, message


def test_memory_advice_follows_the_run(dies, tmp_path):
    target = tmp_path / "target"  # a folder the parent takes for a model (it checks the folder before a child starts)
    target.mkdir()
    (target / "config.json").write_text('{"architectures": ["Qwen3_5ForCausalLM"]}')
    header = b'{"__metadata__":{}}'
    (target / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    message = dies("SIGKILL", target=str(target), scripted_draft=True, dtype="float32", prompts=1)
    assert "--dtype bfloat16" in message and "--device-map auto" in message, message
    assert "--prompts 1" not in message, message  # it already ran one


def test_a_segfault_is_a_native_crash_not_memory(dies):
    message = dies("SIGSEGV")
    assert "killed by SIGSEGV (signal 11)" in message, message
    assert "segmentation fault" in message and "out of memory" not in message, message


def test_an_exit_without_a_result_names_its_status(dies):
    for code in (0, 7):
        message = dies(f"exit{code}")
        assert f"exited with status {code} before reporting a result" in message, message
        assert "signal" not in message, message


def test_a_subprocess_holding_the_output_open_does_not_hide_the_status(dies, tmp_path, monkeypatch):
    held = tmp_path / "held.pid"
    monkeypatch.setenv("DDPATCH_TEST_HOLD", str(held))
    message = dies("SIGKILL")  # no end of output: the parent sees the exit, without reaping it before it reads why
    assert "killed by SIGKILL (signal 9)" in message, message
    pid = int(held.read_text())
    for _ in range(100):  # and what the worker left running is stopped with it
        if not Path(f"/proc/{pid}").exists() or " Z " in Path(f"/proc/{pid}/stat").read_text():
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the worker's subprocess {pid} still runs")


def test_the_oom_killers_count_is_named_when_it_rises(dies, monkeypatch):
    counts = iter([3, 4])
    monkeypatch.setattr(exitstatus, "oom_kills", lambda: next(counts))
    message = dies("SIGKILL")
    assert "out-of-memory killer killed a process of this memory cgroup during the run (oom_kill 3 -> 4)" in message


def test_a_timeout_is_still_a_timeout(dies, tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_TEST_DEATH", "sleep")
    with pytest.raises(VerifyError) as info:
        runner.run_verify(a_tree(tmp_path), timeout=2)
    assert not isinstance(info.value, VerifierCrash) and "timed out" in str(info.value)


def test_a_killed_ddpatch_takes_its_child_with_it(tmp_path):
    """The child leads a session of its own: a SIGKILL to the verify's process must still end it (PR_SET_PDEATHSIG),
    or it runs on, holding the target's memory, after the command that started it is gone."""
    worker, pid_file = tmp_path / "fake_worker.py", tmp_path / "worker.pid"
    worker.write_text(FAKE_WORKER)
    script = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); from patcher.verify.process import runner; "
              "runner.WORKER = Path(sys.argv[2]); runner.run_verify(Path(sys.argv[3]), timeout=120)")
    env = {k: v for k, v in os.environ.items() if k != runner.WARM_ENV}
    env.update(DDPATCH_TEST_DEATH="sleep", DDPATCH_TEST_PID=str(pid_file))
    parent = subprocess.Popen([sys.executable, "-c", script, str(ROOT), str(worker), str(a_tree(tmp_path))], env=env)
    try:
        for _ in range(200):
            if pid_file.is_file() and pid_file.read_text():
                break
            time.sleep(0.05)
        child = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        for _ in range(100):
            if not _running(child):
                return
            time.sleep(0.05)
        os.kill(child, signal.SIGKILL)
        pytest.fail("the verifier's child outlived the process that started it")
    finally:
        if parent.poll() is None:
            parent.kill()


def _running(pid: int) -> bool:
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False


def test_exitstatus_reads_this_machine():
    limit = exitstatus.memory_limit()
    assert limit is None or limit > 1e8
    assert exitstatus.rss_high_water(os.getpid()) is None or exitstatus.rss_high_water(os.getpid()) > 1e6
    kills = exitstatus.oom_kills()
    assert kills is None or kills >= 0


# ----------------------------------------------------------------------------- the real worker
@pytest.fixture(scope="module")
def suicidal(tmp_path_factory) -> Path:
    """vendored/ddtree patched, with a line that kills its own process when the verifier imports it."""
    dest = tmp_path_factory.mktemp("crash") / "tree"
    assert not api.apply(ROOT / "vendored" / "ddtree", "qwen3_6-gdn", out=dest).blocked
    path = dest / "ddtree.py"
    path.write_text("import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n" + path.read_text())
    return dest


def test_the_cli_names_a_fresh_childs_signal(suicidal):
    env = {k: v for k, v in os.environ.items() if k != runner.WARM_ENV}
    proc = subprocess.run([sys.executable, "-m", "patcher", "verify", str(suicidal)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("ddpatch: error: internal error: the verifier process died without a result: "
                                "killed by SIGKILL (signal 9)"), proc.stderr
    assert "peak RSS" in lines[-1], lines[-1]


def test_a_forked_child_says_its_status_is_unknown(suicidal, warm_server):
    with runner.warm_verifier():
        with pytest.raises(VerifierCrash) as info:
            runner.run_verify(suicidal, timeout=120)
    assert "exit status unknown (forked by a warm verifier" in str(info.value), info.value
