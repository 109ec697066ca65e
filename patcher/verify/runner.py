"""``ddpatch verify``: run the patched decoder in a child process and judge it.

The parent never imports torch or the patched tree: it starts
``python .../patcher/verify/worker.py`` (by path: ddpatch is not importable there) with a
timeout, in a temporary working directory, offline, with bytecode writing off, passes the
child's progress lines to ``progress``, and returns the child's final result as an
``Outcome`` (``patcher.report`` renders it). It passed only if every check passed; a crash
of the verifier itself is ``VerifierCrash`` (exit 3), never a verdict.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import VerifierCrash, VerifyError
from ..results import Outcome

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
)


def run_verify(tree: Path, timeout: float = 600.0, progress=None, **options) -> Outcome:
    tree = Path(tree)
    if not tree.is_dir():
        raise VerifyError(f"not a directory: {tree}")
    for key in ("target", "draft"):  # the child runs in a temporary folder: resolve against the caller's
        if options.get(key):
            options[key] = str(Path(options[key]).expanduser().resolve())
        if options.get(key) and not Path(options[key]).exists():
            raise VerifyError(f"--{key} {options[key]} does not exist")
    if options.get("draft") and not options.get("target"):
        raise VerifyError("--draft needs --target")
    if options.get("target") and not options.get("draft") and not options.get("scripted_draft"):
        raise VerifyError("--target needs --draft, or --scripted-draft to build a scripted draft from the tree's DFlashDraftModel")
    cfg = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}, "tree": str(tree.resolve())}
    env = dict(os.environ)
    env.update(
        PYTHONDONTWRITEBYTECODE="1",
        HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"),
        TRANSFORMERS_OFFLINE=env.get("TRANSFORMERS_OFFLINE", "1"),
        TRANSFORMERS_VERBOSITY="error",
    )
    start = time.perf_counter()
    log: list[str] = []
    result = None
    with tempfile.TemporaryDirectory(prefix="ddpatch-verify-") as workdir:
        proc = subprocess.Popen(
            # by path, not -m: the child must not have the patcher package importable (see worker.child_package)
            [sys.executable, str(Path(__file__).with_name("worker.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
            text=True,
            start_new_session=True,
        )
        proc.stdin.write(json.dumps(cfg))
        proc.stdin.close()
        deadline = start + timeout
        try:
            result = _read_events(proc, deadline, progress, log)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.perf_counter() - start
    if result is None:
        if seconds >= timeout:
            raise VerifyError(f"verify timed out after {timeout:.0f} s (raise --timeout, or use a smaller preset)")
        tail = " | ".join(line.strip() for line in log[-3:] if line.strip())
        raise VerifierCrash(f"internal error: the verifier process died without a result: {tail or 'no output'}")
    if result.get("crash"):
        raise VerifierCrash(f"internal error: {result['crash']}")
    if result.get("fatal"):
        raise VerifyError(result["fatal"])
    return Outcome(result, seconds, log)


def _read_events(proc, deadline: float, progress, log: list[str]) -> dict | None:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return None
        if not sel.select(timeout=min(remaining, 1.0)):
            if proc.poll() is not None:
                return None
            continue
        line = proc.stdout.readline()
        if not line:
            return None
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            log.append(line)  # warnings and prints from upstream code
            continue
        if event.get("event") == "progress" and progress is not None:
            progress(event)
        elif event.get("event") == "result":
            return event["result"]
