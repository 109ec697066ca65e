"""A warm verifier: one process that has imported torch and transformers once, and forks a
fresh child for every tree it is asked to judge.

A verify child spends about half its time importing: a tiny-qwen3_5 verify of a DDTree tree
took 6.8 s in a fresh child and 3.5 s forked from here, on a 2-core machine
(``python benchmarks/bench_verify.py --warm``); building a tiny preset takes 20 ms. Over many trees
(``ddpatch ci --verify`` over a range of commits, or the test suite) that import is paid
once here. Each tree is still judged in a process of its own, a fork taken before any tree
was imported and before any model was built: a tree's patches, its module names and
whatever it changes in transformers die with its child and never reach the next tree's
verdict, as they would not between two fresh processes.

Run as ``python worker.py --serve SOCKET`` (by ``runner.warm_verifier``). It listens on a
Unix socket in a private folder. A request is one packet, ``{"cfg", "env", "cwd", "worker",
"executable"}``, with one file descriptor attached: the write end of the pipe the child
speaks its events on (``events``). The answer is ``{"pid": N}``, or ``{"refused": reason}``
when this process cannot stand in for a fresh one (another ddpatch checkout, another
Python, or an environment variable read at import time that differs): the caller then
starts a fresh process, so a warm verifier never changes a verdict.

It never outlives the run that started it: it exits, killing the process groups of the children it
forked, when that run closes its standard input (on exit, or when the kernel closes it for a run
that was killed, SIGKILL included), when the kernel sends the parent-death signal (Linux), when it
gets SIGTERM, and after ``DDPATCH_WARM_IDLE`` seconds (default 900, ``0`` never) with no request and
no child running. A later request finds no server and goes to a fresh process.

This module imports only the stdlib at import time, like the rest of the child's side.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import stat
import sys
import time
from pathlib import Path

#: Environment variables read when torch, transformers or huggingface_hub are imported (or
#: by the interpreter at start): a request whose values differ from this process's gets a
#: fresh process instead of a fork.
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "OPENBLAS_",
                   "CUDA_", "PYTHON", "LD_", "TOKENIZERS_", "XDG_CACHE_HOME", "NVIDIA_")

#: Model classes of the built-in presets and their Auto classes, imported once here (each
#: modeling file costs 0.1-0.5 s in every child otherwise). A name this transformers lacks is skipped.
PRELOAD = (
    "DynamicCache", "AutoConfig", "AutoModelForCausalLM", "AutoModelForImageTextToText",
    "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3ForCausalLM", "LlamaForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM",
    "OlmoHybridForCausalLM", "KimiLinearForCausalLM", "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM",
    "FalconH1ForCausalLM", "Lfm2ForCausalLM",
)

MAX_REQUEST = 4 << 20

#: Seconds with no request and no child running after which a warm verifier exits (0: never).
IDLE_ENV, IDLE_DEFAULT = "DDPATCH_WARM_IDLE", 900.0
#: The pid of the process that started this warm verifier (set by ``runner.warm_verifier``).
PARENT_ENV = "DDPATCH_WARM_PARENT"
PR_SET_PDEATHSIG = 1
#: The process groups of the children this server forked (each led by its child), recorded at the
#: fork, before the pid is answered: an exit a moment later must find it.
CHILDREN: set[int] = set()


def idle_seconds(env=os.environ) -> float | None:
    """``DDPATCH_WARM_IDLE`` in seconds (None: never exit for idleness)."""
    try:
        value = float(env.get(IDLE_ENV, IDLE_DEFAULT))
    except ValueError:
        value = IDLE_DEFAULT
    return value if value > 0 else None


def die_with_parent(sig: int) -> bool:
    """Ask the kernel for ``sig`` when the parent exits (Linux ``PR_SET_PDEATHSIG``); False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        ulong = ctypes.c_ulong  # prctl reads its variadic arguments as unsigned long
        return ctypes.CDLL(None, use_errno=True).prctl(ctypes.c_int(PR_SET_PDEATHSIG), ulong(sig), ulong(0), ulong(0), ulong(0)) == 0
    except (OSError, AttributeError):
        return False


#: ...but not these: torch sets ``TORCHINDUCTOR_CACHE_DIR`` itself the first time anything imports ``torch._inductor``
#: (a bfloat16 model's kernels can), naming a cache folder; a caller that did so is no other environment
SET_BY_TORCH = ("TORCHINDUCTOR_CACHE_DIR",)


def import_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in SET_BY_TORCH}


def preload() -> None:
    """Import what every child imports, and nothing that runs a kernel (no thread pool is
    started before a fork)."""
    import torch  # noqa: F401
    import transformers

    for name in PRELOAD:
        try:
            getattr(transformers, name)
        except (AttributeError, ImportError):
            pass
    from ..judge import calibration, logits, neartie, one_model  # noqa: F401
    from ..models import context, load, presets  # noqa: F401
    from ..plumbing import events  # noqa: F401
    from ..subjects import binding  # noqa: F401


def refusal(request: dict, started_env: dict, worker: str) -> str | None:
    if request.get("worker") != worker:
        return f"another ddpatch ({request.get('worker')}) than this warm verifier's ({worker})"
    if request.get("executable") != sys.executable:
        return f"another Python ({request.get('executable')})"
    asked = import_time_env(request.get("env") or {})
    if asked != started_env:
        differ = sorted(k for k in set(asked) | set(started_env) if asked.get(k) != started_env.get(k))
        return f"environment variables read at import time differ: {', '.join(differ)}"
    return None


def serve(path: str, answer, blocker, worker: str) -> int:
    """Answer requests on the socket at ``path`` until the run that started it is gone (its end of
    our standard input closed, the parent-death signal, SIGTERM) or idle (``answer(cfg)`` judges one
    tree in the forked child and prints its events)."""
    started_env = import_time_env(dict(os.environ))
    children = CHILDREN
    server = os.getpid()
    signal.signal(signal.SIGTERM, lambda *_: _exit(children, path) if os.getpid() == server else os._exit(1))
    die_with_parent(signal.SIGTERM)
    parent = os.environ.pop(PARENT_ENV, None)
    if parent and os.getppid() != int(parent):  # it died before the kernel was asked to tell us
        _exit(children, path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # before the imports: a first request waits in the backlog meanwhile. Bound under another name and renamed once
    # it listens: a client that sees the path between bind and listen would be refused
    listener.bind(path + ".binding")
    listener.listen(16)
    os.rename(path + ".binding", path)
    preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ, "request")
    if stat.S_ISFIFO(os.fstat(0).st_mode):  # the starting run holds the other end: EOF when it is gone
        events.register(0, selectors.EVENT_READ, "parent")
    idle = idle_seconds()
    last = time.monotonic()
    while True:
        children -= {pid for pid in children if not _group_alive(pid)}
        if children:  # a verify running is not idleness; polled, since the kernel reaps them unseen
            last, timeout = time.monotonic(), 1.0
        elif idle is None:
            timeout = None
        elif (timeout := last + idle - time.monotonic()) <= 0:
            _exit(children, path)
        for key, _ in events.select(timeout=timeout):
            if key.data == "parent":
                if not os.read(0, 1 << 12):
                    _exit(children, path)
                continue
            conn, _ = listener.accept()
            last = time.monotonic()
            with conn:
                try:
                    _one_request(conn, listener, started_env, answer, blocker, worker)
                except Exception:  # noqa: BLE001  (a bad request, a caller gone: the next one is served)
                    pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit(children: set[int], path: str) -> None:
    """Kill the process groups of the children still running (a tree's own subprocesses with them), remove the socket, exit."""
    for pid in list(children):
        for kill in (os.killpg, os.kill):  # the child too, should its group not be made yet
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for remove in (os.unlink, os.rmdir):  # the socket, then its private folder (the starting run removes it too)
        try:
            remove(path)
        except OSError:
            pass
        path = os.path.dirname(path)
    os._exit(0)


def _one_request(conn, listener, started_env: dict, answer, blocker, worker: str) -> None:
    data, fds, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST, 1)
    try:
        request = json.loads(data)
        why = refusal(request, started_env, worker) if len(fds) == 1 else "no pipe attached"
    except ValueError:
        why = "not a request"
    if why is not None:
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"refused": why}).encode())
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        _child(request, fds[0], answer, blocker)  # never returns
    CHILDREN.add(pid)
    os.close(fds[0])
    # The child leads its own process group before its pid is answered: the caller's timeout
    # kills that group (os.killpg(pid)), and a group the child had not made yet (it had not
    # been scheduled since the fork) would be no group at all: the kill would miss it and the
    # child would run on. Both sides set it (the classic fork/setpgid race), whoever runs first.
    _own_group(pid)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode())
    except OSError:  # the caller gave up waiting (its timeout): nobody reads this child
        os.killpg(pid, signal.SIGKILL)


def _own_group(pid: int) -> None:
    """Make ``pid`` (0: this process) the leader of a process group of its own."""
    try:
        os.setpgid(pid, 0)
    except PermissionError:  # EPERM: it already leads one (the child set it first)
        pass
    except ProcessLookupError:  # it already exited (and was reaped): there is nothing left to kill
        pass


def _child(request: dict, out_fd: int, answer, blocker) -> None:
    code = 0
    try:
        _own_group(0)  # its own process group (the server sets it too): a timeout kills it and whatever it started
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the tree's own subprocesses must be waitable
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.dont_write_bytecode = True
        blocker.attempts.clear()
        answer(request["cfg"], blocker)
    except BaseException:  # noqa: BLE001  (the child must never return into the server's loop)
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def worker_path() -> str:
    return str(Path(__file__).resolve().with_name("worker.py"))
