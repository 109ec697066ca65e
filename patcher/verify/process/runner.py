"""``ddpatch verify``: run the patched decoder in a child process and judge it.

The parent never imports torch or the patched tree: it starts
``python .../patcher/verify/worker.py`` (by path: ddpatch is not importable there), or has
a warm verifier fork one (``warm_verifier``, ``warm.py``), with a
timeout, in a temporary working directory, offline, with bytecode writing off, passes the
child's progress lines to ``progress``, and returns the child's final result as an
``Outcome`` (``patcher.report`` renders it). It passed only if every check passed; a crash
of the verifier itself is ``VerifierCrash`` (exit 3), never a verdict; a child that died
without a result is named by how it ended (its signal, its peak memory) and what to try
(``exitstatus``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from ...errors import VerifierCrash, VerifyError
from ...results import Outcome
from ..subjects import decoders
from . import exitstatus, partial
from ..judge import rollback
from ..judge.coverage import rows as coverage_rows
from ..models.folders import FolderError, check_pair
from ..models.trained import FOLDER_PRESETS, folder_preset_options, pair_options
from ..child.warm import PARENT_ENV
from ..plumbing.environ import child_env
from .settings import narrowed, real_drafter_defaults

DEFAULTS = dict(
    presets=["tiny-qwen3_5"],
    temperature=0.0,
    sampling_runs=200,
    seeds=[0, 1],
    prompts=2,
    prompt_len=8,
    max_new_tokens=32,
    block_size=4,
    tree_budgets=[4, 8],
    mode_runs=4,  # coverage: runs per decoder for its mode parameters' other values (judge/coverage_runs.py)
)
#: Folder presets a default verify runs beside the random preset: the trained pair judges acceptance, so that a tree
#: that keeps every token but builds its tree wrong (and loses the speedup) fails what users run.
DEFAULT_PAIRS = ["trained-qwen3_5"]


def child_config(tree: Path, **options) -> dict:
    """The configuration a verify child runs (``worker.run``): the options checked and completed as ``run_verify`` takes
    them (the real drafter's defaults, the decoder plan); ``VerifyError`` for bad input."""
    tree = Path(tree)
    if not tree.is_dir():
        raise VerifyError(f"not a directory: {tree}")
    try:  # a trained pair's preset is its two folders: the --target/--draft path, unscripted (trained.py)
        options = folder_preset_options(options)
    except ValueError as exc:
        raise VerifyError(str(exc)) from None
    if options.get("pairs") is None and any(p in FOLDER_PRESETS for p in options.get("presets") or ()):
        names = options["presets"]
        options = {**options, "presets": [p for p in names if p not in FOLDER_PRESETS],
                   "pairs": [pair_options(p, options) for p in names if p in FOLDER_PRESETS]}
    for key in ("target", "draft"):  # the child runs in a temporary folder: resolve against the caller's
        if options.get(key):
            options[key] = str(Path(options[key]).expanduser().resolve())
        if options.get(key) and not Path(options[key]).exists():
            raise VerifyError(f"--{key} {options[key]} does not exist")
    if options.get("draft") and not options.get("target"):
        raise VerifyError("--draft needs --target")
    if options.get("scripted_draft") and not options.get("target"):
        raise VerifyError("--scripted-draft needs --target (or the trained-qwen3_5 preset): a random preset's draft is "
                          "always scripted already, from the target's greedy continuation (true token at rank 0, 1 or nowhere)")
    if options.get("target") and not options.get("draft") and not options.get("scripted_draft"):
        raise VerifyError("--target needs --draft, or --scripted-draft to build a scripted draft from the tree's DFlashDraftModel")
    try:  # bad model folders are the user's input, told in one line before a child starts
        check_pair(options.get("target"), options.get("draft"))
        for pair in options.get("pairs") or ():
            check_pair(pair.get("target"), pair.get("draft"))
    except FolderError as exc:
        raise VerifyError(str(exc)) from None
    options = narrowed(tree, options)
    options = real_drafter_defaults(options)
    try:
        plan = decoders.plan(tree, options.get("entries"), tuple(options.get("exclude") or ()), options.get("not_torch"))
    except ValueError as exc:
        raise VerifyError(str(exc)) from None
    plan["exclude_source"] = options.get("exclude_source")
    if not plan["decoders"]:
        raise VerifyError(f"no DDTree/DFlash decoder found in {tree} ({decoders.LOOKED_FOR})")
    if not options.get("target") and not options.get("presets"):  # the default: a random preset and the trained pair
        options = {**options, "pairs": [pair_options(name, options) for name in DEFAULT_PAIRS]}
    return {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}, "tree": str(tree.resolve()), "plan": plan}


def run_verify(tree: Path, timeout: float = 600.0, progress=None, **options) -> Outcome:
    cfg = child_config(tree, **options)
    env = child_env()
    start = time.perf_counter()
    log: list[str] = []
    result = None
    deadline = start + timeout
    oom_before = exitstatus.oom_kills()
    death = None
    parts = split(cfg)
    # more parts than cores (waves): the children fork from one warm verifier, torch imported once, not once a part
    warm = warm_verifier() if len(parts) > _slots() and not os.environ.get(WARM_ENV) else nullcontext()
    with warm, tempfile.TemporaryDirectory(prefix="ddpatch-verify-") as workdir:
        if len(parts) == 1:
            child = _forked_child(parts[0], env, workdir, deadline) or _FreshChild(parts[0], env, workdir)
            try:
                results = [_read_events(child, deadline, progress, log)]
                if results[0] is None and time.perf_counter() < deadline:  # its output ended: how did it end?
                    death = child.death()
            finally:
                child.kill()
            deaths = {}
        else:  # a queue: at most as many side by side as there are cores; each part's verdict kept as it comes
            results, deaths = partial.run_queue(parts, lambda part: _forked_child(part, env, workdir, deadline)
                                                or _FreshChild(part, env, workdir), _slots(), deadline, progress, log)
    finished = [r for r in results if r is not None]
    unfinished = len(finished) < len(results)
    if unfinished and finished and not any(r.get("crash") or r.get("fatal") for r in finished):
        result = partial.partial(merged(finished), results, parts, deaths, timeout, cfg)  # partial verdicts, never none
    else:
        result = merged(results)
        death = death or next(iter(deaths.values()), None)
    result = coverage_rows.settle(rollback.settle_rollback(result), finished, cfg)  # one coverage row per decoder
    seconds = time.perf_counter() - start
    if result is None:
        if death is None:
            names = ", ".join(f"{d['file']}:{d['qualname']}" for d in cfg["plan"]["decoders"])
            raise VerifyError(f"verify timed out after {timeout:.0f} s before any decoder was judged (not verified: {names}; "
                              "raise --timeout, or use a smaller preset)")
        death.oom_before, death.oom_after, death.limit = oom_before, exitstatus.oom_kills(), exitstatus.memory_limit()
        tail = " | ".join(line.strip() for line in log[-3:] if line.strip())
        raise VerifierCrash(f"internal error: the verifier process died without a result: {death.describe(cfg)}; "
                            f"last output: {tail or 'none'}")
    if result.get("crash"):
        raise VerifierCrash(f"internal error: {result['crash']}")
    if result.get("fatal"):
        raise VerifyError(result["fatal"])
    return Outcome(result, seconds, log)


#: children one verify runs at most side by side (each loads its own model)
MAX_CHILDREN = 8
#: a child's own cost (importing torch, loading its model, the reference decodes and calibration) pays off only over
#: several decoders: a model's decoders are chunked only where each child gets at least this many
DECODERS_PER_CHILD = 4
#: a child runs at most about this many decoders where the plan holds more than fit the cores at once, in at most
#: ``WAVES`` waves: a timeout then reports the waves that finished (``partial``)
WAVE_DECODERS = 6
WAVES = 3


def split(cfg: dict, cores: int | None = None) -> list[dict]:
    """The children one verify runs side by side, one loaded model each: the random presets and the model pairs (the
    trained pair) apart, and where cores are left over, each one's decoders in chunks (every child imports the whole
    tree, so the tree's own rows agree; it runs its chunk's methods: ``run_only``). A ``--target`` run is one child:
    its model may fill a GPU. One core: one child."""
    cores = min(cores or os.cpu_count() or 1, MAX_CHILDREN)
    if cfg.get("target") or cores < 2:
        return [cfg]
    groups = [g for g in ({**cfg, "pairs": None} if cfg.get("presets") else None,
                          {**cfg, "presets": []} if cfg.get("pairs") else None) if g is not None]
    if not groups:
        return [cfg]
    keys = [[d["file"], d["qualname"]] for d in cfg["plan"]["decoders"]]
    chunks = max(1, min(len(keys) // DECODERS_PER_CHILD, cores // len(groups)))
    # many decoders: more chunks than run at once, in waves, so that a timeout keeps the waves that finished
    chunks = max(chunks, min(-(-len(keys) // WAVE_DECODERS), len(keys) // DECODERS_PER_CHILD, chunks * WAVES))
    if chunks == 1:
        return groups
    return [{**g, "run_only": keys[i::chunks], "wave": i} for g in groups for i in range(chunks)]


def _slots() -> int:
    return max(1, min(os.cpu_count() or 1, MAX_CHILDREN))


def merged(results: list) -> dict | None:
    """One result from the children's: the tree's own rows once (every child imported the whole tree), each model
    once, its rows and methods gathered from the children that ran a chunk of its decoders."""
    if any(r is None for r in results):
        return None
    for key in ("crash", "fatal"):
        bad = next((r for r in results if r.get(key)), None)
        if bad is not None:
            return bad
    first = dict(results[0])
    first["checks"] = _unique(c for r in results for c in r.get("checks", []))
    models: dict[str, dict] = {}
    for r in results:
        for m in r.get("models", []):
            if m["model"] not in models:
                models[m["model"]] = dict(m)
                continue
            into = models[m["model"]]
            into["checks"] = _unique(into.get("checks", []) + m.get("checks", []))
            names = {x["method"] for x in into.get("methods", [])}
            into["methods"] = into.get("methods", []) + [x for x in m.get("methods", []) if x["method"] not in names]
            into["partial_acceptances"] = into.get("partial_acceptances", 0) + m.get("partial_acceptances", 0)
    first["models"] = list(models.values())
    for other in results[1:]:
        for key, value in other.items():
            first.setdefault(key, value)
    return first


def _unique(rows) -> list[dict]:
    """Rows in order, each check once: a model's own rows (the noise floor, the reference's soundness) come from every
    child that loaded it; a decoder's rows from the child that ran it."""
    out, at = [], {}
    for row in rows:
        key = (row["check"], json.dumps(row.get("decoder"), sort_keys=True))
        if key not in at:
            at[key] = len(out)
            out.append(row)
        elif out[at[key]]["passed"] and not row["passed"]:  # a summary row (warms up): a chunk's failure stands
            out[at[key]] = row
    return out


WORKER = Path(__file__).resolve().parent.parent / "child" / "worker.py"


def _parent_death_signal():
    """A ``preexec_fn`` that has the child SIGKILLed when this process dies (Linux ``PR_SET_PDEATHSIG``), or None.

    The child leads a session of its own (a timeout kills its group), so a signal to this process's group never
    reaches it: without this, a ``ddpatch verify`` killed from outside (SIGKILL, SIGTERM, a closed terminal) would
    leave its child running on, holding the target's memory. Resolved here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


class _FreshChild:
    """``python worker.py`` in a process of its own (by path, not -m: the child must not have
    the patcher package importable, see worker.child_package)."""

    def __init__(self, cfg: dict, env: dict, workdir: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
            text=True,
            start_new_session=True,
            preexec_fn=_parent_death_signal(),
        )
        self.stdout = self.proc.stdout
        self.peak_rss = None  # bytes, sampled while it runs (``sample``)
        self.proc.stdin.write(json.dumps(cfg))
        self.proc.stdin.close()
        warm_stats["fresh"] += 1

    def sample(self) -> None:
        self.peak_rss = exitstatus.rss_high_water(self.proc.pid) or self.peak_rss

    def exited(self) -> bool:
        if self.proc.returncode is not None:
            return True
        try:  # without reaping it: its exit status and rusage are read by ``death``
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def death(self, grace: float = 10.0) -> exitstatus.Death:
        """How it ended: waits up to ``grace`` s for it to exit, then reaps it with its rusage."""
        death = (exitstatus.reap(self.proc.pid, grace) if self.proc.returncode is None
                 else exitstatus.Death(known=False, unknown_why="already reaped"))
        if death.known:
            self.proc.returncode = -death.signal if death.signal is not None else death.code
        if death.peak_rss is None:
            death.peak_rss = self.peak_rss
        return death

    def kill(self) -> None:
        if self.proc.returncode is None:  # not reaped yet (a zombie still holds its group id): what its group left runs
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
        self.stdout.close()


# ----------------------------------------------------------------------------- the warm verifier
#: Set (to a socket path) while a warm verifier serves this process and its subprocesses.
WARM_ENV = "DDPATCH_WARM_VERIFIER"
#: How verify children were started in this process (for the tests and benchmarks):
#: ``fresh``, ``forked``, and the reasons a warm verifier refused a request.
warm_stats: dict = {"fresh": 0, "forked": 0, "refused": []}

#: The fields of a verify result that differ between two runs of the same tree (wall-clock figures).
TIMINGS = frozenset({"seconds", "tokens_per_s", "speedup"})


def without_timings(value):
    """A verify result (or part of one) without its ``TIMINGS``: what two runs of the same tree,
    fresh or forked, must agree on."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


class _ForkedChild:
    """A child forked by the warm verifier (``warm.py``): the same ``worker.answer`` in a
    process of its own, its events on a pipe of ours. It leads its own process group."""

    def __init__(self, pid: int, read_fd: int) -> None:
        self.pid = pid
        self.stdout = os.fdopen(read_fd, "r", encoding="utf-8")
        self.peak_rss = None  # bytes, sampled while it runs: the only figure left once the server reaped it
        warm_stats["forked"] += 1

    def sample(self) -> None:
        self.peak_rss = exitstatus.rss_high_water(self.pid) or self.peak_rss

    def death(self) -> exitstatus.Death:
        """Its exit status is the warm verifier's to read (it reaps at once): unknown here."""
        return exitstatus.Death(known=False, peak_rss=self.peak_rss)

    def exited(self) -> bool:
        try:
            os.kill(self.pid, 0)  # the warm verifier reaps its children at once: gone means exited
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def kill(self) -> None:
        if not self.exited():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.stdout.close()


def _forked_child(cfg: dict, env: dict, workdir: str, deadline: float) -> _ForkedChild | None:
    """A child from the warm verifier named by ``DDPATCH_WARM_VERIFIER``, or None (none runs,
    it cannot be reached, or it cannot stand in for a fresh process): the caller starts a fresh one."""
    import socket

    path = os.environ.get(WARM_ENV)
    if not path:
        return None
    request = {"cfg": cfg, "env": env, "cwd": workdir, "worker": str(WORKER.resolve()), "executable": sys.executable}
    read_fd, write_fd = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(max(1.0, deadline - time.perf_counter()))
            conn.connect(path)
            socket.send_fds(conn, [json.dumps(request).encode()], [write_fd])
            os.close(write_fd)
            write_fd = -1
            reply = json.loads(conn.recv(1 << 16) or b"{}")
    except (OSError, ValueError) as exc:
        reply = {"refused": f"unreachable: {exc}"}
    finally:
        if write_fd >= 0:
            os.close(write_fd)
    if "pid" not in reply:
        warm_stats["refused"].append(reply.get("refused", "no answer"))
        os.close(read_fd)
        return None
    return _ForkedChild(int(reply["pid"]), read_fd)


@contextmanager
def warm_verifier():
    """Within this block, ``run_verify`` (here and in subprocesses that inherit the
    environment) forks its children from one process that imported torch and transformers
    once, instead of starting a fresh Python per tree: about half of a tiny-preset verify's
    time. Every tree is still judged in a process of its own (see ``warm.py``). A request it
    cannot serve exactly, or a warm verifier that died, falls back to a fresh process.

    The server's standard input is a pipe that only this process writes to: when this process
    ends, however it ends (SIGKILL included), the kernel closes it and the server exits with
    its children; on Linux the parent-death signal tells it too (the kernel sends it when the
    thread that entered this block ends: leave the block in the thread that entered it).
    ``DDPATCH_WARM_IDLE`` (seconds, default 900, 0 never) ends a server nobody asked anything for that long."""
    if os.environ.get(WARM_ENV):
        yield os.environ[WARM_ENV]  # one already serves this process
        return
    folder = tempfile.mkdtemp(prefix="ddpatch-warm-")
    path = os.path.join(folder, "socket")
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "--serve", path],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=folder, env={**child_env(), PARENT_ENV: str(os.getpid())}, start_new_session=True,
    )
    for _ in range(200):  # it binds before it imports: a request waits in its backlog, not on a missing file
        if os.path.exists(path) or proc.poll() is not None:
            break
        time.sleep(0.01)
    os.environ[WARM_ENV] = path
    try:
        yield path
    finally:
        if os.environ.get(WARM_ENV) == path:
            del os.environ[WARM_ENV]
        proc.stdin.close()  # the server's cue to exit with its children (the SIGTERM below is the same)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _read_events(child, deadline: float, progress, log: list[str]) -> dict | None:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ)
    sampled = 0.0
    while True:
        now = time.perf_counter()
        remaining = deadline - now
        if remaining <= 0:
            return None
        if now - sampled >= 1.0:  # its peak memory, for the message if it dies
            child.sample()
            sampled = now
        if not sel.select(timeout=min(remaining, 1.0)):
            if child.exited():
                return None
            continue
        line = child.stdout.readline()
        if not line:
            return None
        result = partial.read_event(line, progress, log)
        if result is not None:
            return result
