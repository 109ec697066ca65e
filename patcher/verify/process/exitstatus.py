"""Why a verifier child died without a result, and what to try (the parent's side; stdlib only).

``run_verify`` (``runner``) reads three things when its child's output ends without a result:

* the exit status: a fresh child is ours to wait for (``os.wait4``), so its signal or exit code is
  known, and so is its peak resident memory (the rusage of the process and what it waited for); a
  child forked by a warm verifier (``warm.py``) is reaped by that server at once, so its status is
  unknown here;
* its peak resident memory while it ran, sampled from ``/proc/PID/status`` (``VmHWM``): a lower
  bound, the only one there is for a forked child;
* the kernel's count of out-of-memory kills in this memory cgroup (``memory.events`` in cgroup v2,
  ``memory.oom_control`` in v1), before and after: ``dmesg`` is rarely readable, this often is.

A SIGKILL that ddpatch did not send is most likely the kernel's out-of-memory killer: the
message says so with the peak against the memory there is, and names the options that need
less (``--dtype``, ``--device-map``, ``--prompts``, ``--max-new-tokens``).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

GIB = float(1 << 30)
#: What a native crash's signal usually means.
NATIVE = {
    "SIGSEGV": "a segmentation fault in native code (torch, a kernel extension, or a library the tree loads)",
    "SIGBUS": "a bus error: often shared memory (/dev/shm) ran out, or a model file changed while it was mapped",
    "SIGABRT": "an abort in native code (a failed assertion or an uncaught C++ exception)",
    "SIGILL": "an illegal instruction: a binary built for another CPU",
    "SIGFPE": "an arithmetic fault in native code",
}


def rss_high_water(pid: int) -> int | None:
    """Peak resident memory of a running process in bytes (``VmHWM``), or None (gone, another OS)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _memory_cgroup() -> tuple[Path, int] | None:
    """This process's memory cgroup folder and its version (1 or 2), where it can be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            roots, version = [Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")], 1
        elif parts[0] == "0" and parts[1] == "":
            roots, version = [Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")], 2
        else:
            continue
        probe = "memory.oom_control" if version == 1 else "memory.events"
        for root in roots:  # a container may see its own cgroup as the root
            for folder in (root / parts[2].lstrip("/"), root):
                if (folder / probe).is_file():
                    return folder, version
    return None


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed in this memory cgroup, or None."""
    found = _memory_cgroup()
    if found is None:
        return None
    folder, version = found
    try:
        text = (folder / ("memory.oom_control" if version == 1 else "memory.events")).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return None


def memory_limit() -> int | None:
    """The memory this process may use in bytes: the machine's, or its cgroup's limit where lower."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    found = _memory_cgroup()
    if found is not None:
        folder, version = found
        try:
            value = (folder / ("memory.limit_in_bytes" if version == 1 else "memory.max")).read_text().strip()
            if value.isdigit() and int(value) < 1 << 60:
                limits.append(int(value))
        except OSError:
            pass
    return min(limits) if limits else None


@dataclass
class Death:
    """How a child that gave no result ended."""

    signal: int | None = None  # the signal that ended it (None: it exited, or unknown)
    code: int | None = None  # its exit code (None: a signal ended it, or unknown)
    known: bool = True  # False: its exit status is not ours to read (a warm verifier's fork)
    unknown_why: str = ("forked by a warm verifier, which reaps its children; run it again without "
                        "DDPATCH_WARM_VERIFIER set to read it")
    peak_rss: int | None = None  # bytes
    peak_exact: bool = False  # from its rusage (else a sample: a lower bound)
    oom_before: int | None = None
    oom_after: int | None = None
    limit: int | None = None  # memory this process may use, in bytes
    stopped_by_us: bool = False  # it closed its output but did not exit: ddpatch killed it

    @property
    def oom_killed(self) -> bool:
        return self.oom_before is not None and self.oom_after is not None and self.oom_after > self.oom_before

    def signal_name(self) -> str:
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def peak(self) -> str:
        if self.peak_rss is None:
            return ""
        text = f"peak RSS {'' if self.peak_exact else 'at least '}{self.peak_rss / GIB:.1f} GiB"
        return text + (f" of {self.limit / GIB:.1f} GiB" if self.limit else "")

    def describe(self, cfg: dict | None = None) -> str:
        """One line: how it ended, why that likely was, and what to try."""
        cfg = cfg or {}
        peak = self.peak()
        oom = (f"the kernel's out-of-memory killer killed a process of this memory cgroup during the run "
               f"(oom_kill {self.oom_before} -> {self.oom_after})") if self.oom_killed else ""
        if self.stopped_by_us:
            how = "it closed its output but had not exited 10 s later; ddpatch stopped it"
            return "; ".join(x for x in (how, peak) if x)
        if not self.known:
            how = f"exit status unknown ({self.unknown_why})"
            if oom:
                return f"{how}; most likely out of memory: {oom}; {'; '.join(x for x in (peak, memory_advice(cfg)) if x)}"
            if self.peak_rss and self.limit and self.peak_rss >= self.limit / 2:
                return "; ".join((how, peak, "if it ran out of memory, " + memory_advice(cfg)))
            return "; ".join(x for x in (how, peak) if x)
        if self.signal is None:
            how = (f"it exited with status {self.code} before reporting a result (the tree's code, or a library it "
                   "calls, exited the process: see the last output)")
            return "; ".join(x for x in (how, oom, peak) if x)
        name = self.signal_name()
        how = f"killed by {name} (signal {self.signal})"
        if self.signal == signal.SIGKILL or self.oom_killed:
            why = oom or "not sent by ddpatch: most likely out of memory (the kernel's out-of-memory killer sends SIGKILL)"
            return "; ".join(x for x in (how, why, peak, memory_advice(cfg)) if x)
        if name in NATIVE:
            return "; ".join(x for x in (how, NATIVE[name], peak, native_advice(cfg)) if x)
        return "; ".join(x for x in (how, "sent from outside ddpatch", peak) if x)


def memory_advice(cfg: dict) -> str:
    """The options that make a verify need less memory, for this run's settings."""
    tips = []
    if cfg.get("target"):
        if (cfg.get("dtype") or "bfloat16") == "float32":
            tips.append("--dtype bfloat16 (half the weights' memory)")
        if not cfg.get("device_map"):
            tips.append("--device-map auto (spread the target over the GPUs, or offload it)")
    if (cfg.get("prompts") or 2) > 1:
        tips.append("--prompts 1")
    if (cfg.get("max_new_tokens") or 32) > 16:
        tips.append("--max-new-tokens 16")
    return "try " + ", ".join(tips) + (", or " if tips else "") + "a machine with more memory"


def native_advice(cfg: dict) -> str:
    text = "run the tree's decoder once outside ddpatch: does it crash there too?"
    tips = []
    if cfg.get("target"):
        tips.append("--attn-implementation eager")
        if (cfg.get("dtype") or "bfloat16") != "float32":
            tips.append("--dtype float32")
    return text + (" Or try " + ", ".join(tips) if tips else "")


def reap(pid: int, grace: float) -> Death:
    """Wait up to ``grace`` seconds for our child ``pid`` to exit by itself, kill what is left of its
    process group, and reap it with its rusage. A child still running after ``grace`` is killed
    (``stopped_by_us``)."""
    import time

    deadline = time.monotonic() + grace
    stopped = False
    while True:
        try:
            exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return Death(known=False, unknown_why="another waiter reaped it")
        if exited is not None:
            break
        if time.monotonic() >= deadline:
            stopped = True
            break
        time.sleep(0.05)
    try:  # its own subprocesses (the leader is a zombie until reaped: the group id is still its own)
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        _, status, usage = os.wait4(pid, 0)
    except ChildProcessError:
        return Death(known=False, unknown_why="another waiter reaped it")
    death = Death(peak_rss=usage.ru_maxrss * 1024, peak_exact=True, stopped_by_us=stopped)
    if os.WIFSIGNALED(status):
        death.signal = os.WTERMSIG(status)
    else:
        death.code = os.WEXITSTATUS(status)
    return death
