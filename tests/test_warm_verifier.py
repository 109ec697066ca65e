"""The warm verifier (``patcher.verify.process.runner.warm_verifier``) stands in for a fresh process
exactly: the same verdicts, no state carried from one tree to the next, and a fresh process
whenever it cannot serve a request the same way (see ``patcher/verify/child/warm.py``).

The rest of the suite runs its verifies through one (tests/conftest.py). These tests use the
session's through the ``warm_server`` fixture (started again where an earlier test ended it), run
without it to compare, and start their own to kill it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from patcher import api
from patcher.verify.process import runner

ROOT = Path(__file__).resolve().parent.parent
#: small, and still enough for the code-shape-only control to fail on tiny-qwen3_5 (it fails with one seed and 16 tokens
#: as it did with two seeds and 24)
SETTINGS = dict(presets=["tiny-qwen3_5"], seeds=[0], prompts=1, max_new_tokens=16, tree_budgets=[4], greedy_only=True)


def _patched(dest: Path, ignore: str | None = None) -> Path:
    options = {"ignore": ignore} if ignore else {}
    result = api.apply(ROOT / "vendored" / "ddtree", "qwen3_6-gdn", out=dest, **options)
    assert not result.blocked
    return dest


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("warm")
    full = _patched(base / "full")
    lossy = _patched(base / "shape-only", ignore="verify-forward,tree-commit")
    # a tree that leaves a mark in transformers at import, and one that fails to load if it finds that mark
    marks = base / "marks"
    clean = base / "clean"
    for dest, line in ((marks, "import transformers; transformers._ddpatch_test_mark = 1\n"),
                       (clean, "import transformers; assert not hasattr(transformers, '_ddpatch_test_mark'), 'a mark left by another tree'\n")):
        _patched(dest)
        path = dest / "ddtree.py"
        path.write_text(line + path.read_text())
    return {"full": full, "lossy": lossy, "marks": marks, "clean": clean}


@pytest.fixture
def counts(monkeypatch):
    """No count carried from other tests. With ``warm_server`` (tests/conftest.py), ``runner.warm_verifier()``
    below reuses the session's warm verifier, alive whatever ran before; without it, it starts one."""
    monkeypatch.setattr(runner, "warm_stats", {"fresh": 0, "forked": 0, "refused": []})


@pytest.fixture
def no_session_warm(counts, monkeypatch):
    """Not the session's warm verifier: a test that starts its own, or none."""
    monkeypatch.delenv(runner.WARM_ENV, raising=False)


def test_a_warm_verdict_equals_a_fresh_one(trees, warm_server, counts, monkeypatch):
    with monkeypatch.context() as env:
        env.delenv(runner.WARM_ENV, raising=False)
        fresh = {name: runner.run_verify(trees[name], **SETTINGS) for name in ("full", "lossy")}
    assert runner.warm_stats["fresh"] == 2 and runner.warm_stats["forked"] == 0
    with runner.warm_verifier():
        warm = {name: runner.run_verify(trees[name], **SETTINGS) for name in ("lossy", "full")}
    assert runner.warm_stats["forked"] == 2 and runner.warm_stats["fresh"] == 2, runner.warm_stats
    assert fresh["full"].passed and not fresh["lossy"].passed  # the comparison can tell a pass from a fail
    for name in fresh:
        assert runner.without_timings(warm[name].result) == runner.without_timings(fresh[name].result), name


def test_nothing_a_tree_does_reaches_the_next_tree(trees, warm_server, counts):
    with runner.warm_verifier():
        first = runner.run_verify(trees["marks"], **SETTINGS)
        second = runner.run_verify(trees["clean"], **SETTINGS)
        lossy = runner.run_verify(trees["lossy"], **SETTINGS)  # the same module names as the trees before
    assert runner.warm_stats["forked"] == 3, runner.warm_stats
    loads = {c["check"]: c for c in second.result["checks"]}["loads"]
    assert first.passed and loads["passed"] and second.passed, loads
    assert not lossy.passed, "a lossy tree judged after lossless ones passed: the child reused their modules"


def test_a_request_it_cannot_serve_the_same_way_goes_to_a_fresh_process(trees, warm_server, counts, monkeypatch):
    with runner.warm_verifier():
        monkeypatch.setenv("PYTORCH_DDPATCH_TEST", "1")  # read at import time, in principle: the warm imports predate it
        outcome = runner.run_verify(trees["full"], **SETTINGS)
    assert outcome.passed and runner.warm_stats["fresh"] == 1 and runner.warm_stats["forked"] == 0
    assert "PYTORCH_DDPATCH_TEST" in runner.warm_stats["refused"][0]


def test_a_dead_warm_verifier_falls_back_to_a_fresh_process(trees, no_session_warm):
    with runner.warm_verifier() as path:
        server = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid).endswith(path)]
        assert len(server) == 1
        os.kill(server[0], signal.SIGKILL)
        outcome = runner.run_verify(trees["full"], **SETTINGS)
    assert outcome.passed and runner.warm_stats["fresh"] == 1 and "unreachable" in runner.warm_stats["refused"][0]


def test_a_timeout_kills_the_forked_child(trees, warm_server, counts, tmp_path, monkeypatch):
    slow = _patched(tmp_path / "slow")
    (slow / "ddtree.py").write_text("import time; time.sleep(600)\n" + (slow / "ddtree.py").read_text())
    forked = []  # the pids this test's verifies were answered: only those are its children (another
    # xdist worker's verifies run in ddpatch-verify- folders too, from its own warm verifier)
    spawn = runner._ForkedChild.__init__

    def spy(self, pid, read_fd):
        forked.append(pid)
        spawn(self, pid, read_fd)

    monkeypatch.setattr(runner._ForkedChild, "__init__", spy)
    with runner.warm_verifier():
        runner.run_verify(trees["full"], **SETTINGS)  # the imports are done: the timeout is the child's alone
        with pytest.raises(runner.VerifyError, match="timed out"):
            runner.run_verify(slow, timeout=3, **SETTINGS)
        deadline = time.monotonic() + 5  # SIGKILL is sent; give the kernel a moment to take it
        while (alive := [pid for pid in forked if _group_alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert runner.warm_stats["forked"] == 2 and len(forked) == 2
    assert not alive, f"the forked child outlived its timeout: {[_describe(pid) for pid in alive]}"


def test_the_answered_child_already_leads_its_group(tmp_path, monkeypatch):
    """The warm verifier answers a pid only once that pid leads its own process group, however
    late the child runs after the fork: a caller's timeout kills the group, and a kill sent
    before the child made it would miss it (the child ran on, past every timeout)."""
    import json
    import socket
    from types import SimpleNamespace

    from patcher.verify.child import warm

    server_pid = os.getpid()

    class SlowChildOs:
        """``os``, with a child that is scheduled late after the fork: it sets its group 1 s late."""

        def __getattr__(self, name):
            return getattr(os, name)

        def _late(self, call, *args):
            if os.getpid() != server_pid:
                time.sleep(1.0)
            return call(*args)

        def setsid(self):
            return self._late(os.setsid)

        def setpgid(self, pid, pgid):
            return self._late(os.setpgid, pid, pgid)

    monkeypatch.setattr(warm, "os", SlowChildOs())
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    events_r, events_w = os.pipe()
    pid = None
    try:
        request = {"cfg": {}, "env": {}, "cwd": str(tmp_path), "worker": "w", "executable": sys.executable}
        socket.send_fds(ours, [json.dumps(request).encode()], [events_w])
        os.close(events_w)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            warm._one_request(theirs, listener, {}, lambda cfg, blocker: time.sleep(60), SimpleNamespace(attempts=[]), "w")
        pid = json.loads(ours.recv(1 << 16))["pid"]
        assert os.getpgid(pid) == pid, "the answered child does not lead a process group yet: a timeout's killpg misses it"
        os.killpg(pid, signal.SIGKILL)
        assert os.waitpid(pid, 0)[0] == pid
        pid = None
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(events_r)
        ours.close()
        theirs.close()


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is alive (a zombie is not: it has exited)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
            return True
    return False


def _describe(pid: int) -> str:
    return f"{pid}: {_cmdline(str(pid))!r} in {_cwd(str(pid))}"


def _cwd(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return "?"


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def test_a_refusal_names_another_checkout_another_python_or_an_import_time_variable():
    """Only a request from this ddpatch, this Python and the same import-time environment is forked; any
    other gets the reason it goes to a fresh process (the variables that differ by name)."""
    from patcher.verify.child import warm

    started = warm.import_time_env({"OMP_NUM_THREADS": "1", "HOME": "/a"})
    same = {"worker": "/w/worker.py", "executable": sys.executable, "env": {"OMP_NUM_THREADS": "1", "HOME": "/b"}}
    assert started == {"OMP_NUM_THREADS": "1"} and warm.refusal(same, started, "/w/worker.py") is None
    assert "another ddpatch (/x/worker.py)" in warm.refusal({**same, "worker": "/x/worker.py"}, started, "/w/worker.py")
    assert "another Python (/usr/bin/python9)" in warm.refusal({**same, "executable": "/usr/bin/python9"}, started, "/w/worker.py")
    why = warm.refusal({**same, "env": {"OMP_NUM_THREADS": "2", "PYTORCH_X": "1"}}, started, "/w/worker.py")
    assert why.endswith("differ: OMP_NUM_THREADS, PYTORCH_X"), why


# ----------------------------------------------------------------------------- a killed run leaves nothing running
#: A run that holds a warm verifier (as `ddpatch ci --verify` and each test worker do): it prints the
#: server's socket once the server serves, then (argv[1]) a verify in flight, or (argv[2]) a forked copy
#: of itself that keeps the server's stdin pipe open, so that only the parent-death signal can tell.
HOLDER = r"""
import json, os, socket, sys, threading, time
from pathlib import Path
from patcher.verify.process import runner

def say(**kw):
    print(json.dumps(kw), flush=True)

spawn = runner._ForkedChild.__init__
def spy(self, pid, fd):
    say(child=pid)
    spawn(self, pid, fd)
runner._ForkedChild.__init__ = spy

with runner.warm_verifier() as path:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:  # answered once it serves
        conn.connect(path); conn.send(b"{}"); conn.recv(1 << 16)
    say(socket=path)
    if sys.argv[1]:
        threading.Thread(target=runner.run_verify, args=(Path(sys.argv[1]),), kwargs=dict(timeout=600, **json.loads(sys.argv[3])), daemon=True).start()
    if sys.argv[2] and (sleeper := os.fork()) == 0:
        time.sleep(120); os._exit(0)
    if sys.argv[2]:
        say(sleeper=sleeper)
    time.sleep(600)
"""


def _hold(tree: Path | None = None, keep_pipe: bool = False) -> tuple[subprocess.Popen, dict]:
    env = {k: v for k, v in os.environ.items() if k != runner.WARM_ENV}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tree or ""), "1" if keep_pipe else "", json.dumps(SETTINGS)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    said: dict = {}
    wanted = {"socket"} | ({"child"} if tree else set()) | ({"sleeper"} if keep_pipe else set())
    try:
        while not wanted <= set(said):
            line = proc.stdout.readline()
            assert line, f"the holder exited ({proc.wait()}) before it said {sorted(wanted - set(said))}"
            said.update(json.loads(line))
        said["server"] = _server_of(said["socket"], proc.pid)
    except BaseException:
        proc.kill()  # its server and children follow it: the mechanism under test
        proc.wait()
        raise
    return proc, said


def _server_of(path: str, parent: int) -> int:
    """The server the run ``parent`` started (its forked children have the same command line)."""
    (server,) = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid).endswith(f"--serve {path}")
                 and _stat(pid)[1] == str(parent)]
    return server


def _stat(pid: str) -> list[str]:
    """State, ppid, pgrp, ... of ``/proc/PID/stat`` ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def _gone_within(seconds: float, *groups: int) -> list[int]:
    """The process groups among ``groups`` still alive after ``seconds`` (each server and child leads one)."""
    deadline = time.monotonic() + seconds
    while (alive := [g for g in groups if _group_alive(g)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_run_leaves_neither_the_warm_verifier_nor_its_verify_running(tmp_path):
    """SIGKILL a run while a forked verify runs (a tree that sleeps at import): within seconds neither the
    server nor the child's process group is left (each was about 345 MB, with parent 1, for hours)."""
    slow = _patched(tmp_path / "slow")
    (slow / "ddtree.py").write_text("import time; time.sleep(600)\n" + (slow / "ddtree.py").read_text())
    proc, said = _hold(tree=slow)
    try:
        assert _group_alive(said["server"]) and _group_alive(said["child"])
        proc.kill()
        proc.wait()
        alive = _gone_within(10, said["server"], said["child"])
        assert not alive, f"left running after the run was killed: {[_describe(p) for p in alive]}"
        folder = os.path.dirname(said["socket"])
        assert not os.path.exists(folder), f"the server left its private folder behind: {os.listdir(folder)}"
    finally:
        _kill_groups(proc, said["server"], said["child"])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's; reads /proc")
def test_the_parent_death_signal_ends_a_server_whose_pipe_is_still_open():
    """The run is SIGKILLed, and a process it forked still holds the write end of the server's stdin
    (no EOF comes): the kernel's parent-death signal alone must end the server."""
    proc, said = _hold(keep_pipe=True)
    try:
        proc.kill()
        proc.wait()
        alive = _gone_within(10, said["server"])
        assert not alive, f"the server outlived its parent: {_describe(said['server'])}"
    finally:
        _kill_groups(proc, said["server"])
        _kill(said["sleeper"])


def test_the_server_exits_when_its_pipe_closes_and_when_idle(tmp_path):
    """Closing the server's stdin (what the kernel does for a killed parent on any OS) ends it at once;
    with ``DDPATCH_WARM_IDLE`` it also ends on its own after that many seconds without a request."""
    import socket

    from patcher.verify.child import warm

    servers = {}
    for name, idle in (("pipe", "0"), ("idle", "1")):
        folder = tmp_path / name
        folder.mkdir()
        env = {**runner.child_env(), warm.IDLE_ENV: idle}
        servers[name] = (subprocess.Popen([sys.executable, str(runner.WORKER), "--serve", str(folder / "s")], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=folder, env=env, start_new_session=True),
                         str(folder / "s"))
    try:
        for proc, path in servers.values():  # both serve (their imports are done): ask a bad question, get an answer
            while not os.path.exists(path):
                assert proc.poll() is None, "the server exited before it bound its socket"
                time.sleep(0.05)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
                conn.settimeout(300)
                conn.connect(path)
                conn.send(b"{}")
                assert json.loads(conn.recv(1 << 16)) == {"refused": "no pipe attached"}
        pipe, idle = servers["pipe"][0], servers["idle"][0]
        pipe.stdin.close()
        assert pipe.wait(timeout=10) == 0, "the server outlived the close of its stdin pipe"
        assert idle.wait(timeout=30) == 0 and idle.stdin.closed is False, "DDPATCH_WARM_IDLE=1 did not end an idle server"
        assert not os.path.exists(servers["idle"][1]), "the idle server left its socket behind"
        assert warm.idle_seconds({}) == warm.IDLE_DEFAULT and warm.idle_seconds({warm.IDLE_ENV: "0"}) is None
    finally:
        for proc, _ in servers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_groups(proc: subprocess.Popen, *groups: int) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ----------------------------------------------------------------------------- the test session's own warm verifier
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_sessions_warm_verifier_never_idles_out(warm_server):
    """A worker can go longer than ``DDPATCH_WARM_IDLE``'s default 15 minutes between two verifies: the
    session's server, had it idled out, left the later tests that assert a fork a missing socket."""
    from patcher.verify.child import warm

    server = _server_of(warm_server, os.getpid())
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{server}/environ").read_text().split("\0") if "=" in item)
    assert environ.get(warm.IDLE_ENV) == "0", environ.get(warm.IDLE_ENV)
    assert os.environ.get(runner.WARM_ENV) == warm_server


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_warm_verifier_that_is_gone_is_started_again(no_session_warm):
    """``warm_server`` (tests/conftest.py) serves whatever an earlier test did to the session's server: killed
    (its socket file left, no listener) or ended (its socket removed, as an idle exit does)."""
    import socket

    from warm_support import WarmServer, reachable

    own = WarmServer()
    try:
        first = own.live()
        deadline = time.monotonic() + 60
        while not os.path.exists(first) and time.monotonic() < deadline:  # bound (a busy machine starts Python slowly)
            time.sleep(0.05)
        killed = _server_of(first, os.getpid())
        os.kill(killed, signal.SIGKILL)
        assert not _gone_within(10, killed) and os.path.exists(own.path)  # dead, its socket file left
        assert reachable(own.live()) and own.starts == 2
        ended = _server_of(own.path, os.getpid())
        assert ended != killed
        os.kill(ended, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while reachable(own.path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not reachable(own.path)
        last = own.live()
        assert own.starts == 3 and os.environ[runner.WARM_ENV] == last
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:  # it serves: a bad question gets an answer
            conn.settimeout(300)
            conn.connect(last)
            conn.send(b"{}")
            assert json.loads(conn.recv(1 << 16)) == {"refused": "no pipe attached"}
    finally:
        own.close()
    assert runner.WARM_ENV not in os.environ and not reachable(last)
