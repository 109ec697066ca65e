"""``ddpatch verify``: run the patched decoder in a child process and judge it.

The parent never imports torch or the patched tree: it starts
``python .../patcher/verify_worker.py`` (by path: ddpatch is not importable there) with a
timeout, in a temporary working directory, offline, with bytecode writing off, shows a
progress bar from the child's progress lines, and renders the child's final result.
Exit 0 only if every check passed; a crash of the verifier itself is ``VerifierCrash``
(exit 3), never a verdict.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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


class VerifyError(Exception):
    """Bad input, or a run stopped by its timeout, that produced no result (one line for the user)."""

    exit_code = 2


class VerifierCrash(VerifyError):
    """An internal error: the verifier itself crashed or died. Never a verdict on the tree."""

    exit_code = 3


@dataclass
class Outcome:
    result: dict
    seconds: float
    log: list[str] = field(default_factory=list)

    @property
    def checks(self) -> list[dict]:
        return list(self.result.get("checks", [])) + [c for m in self.result.get("models", []) for c in m["checks"]]

    @property
    def passed(self) -> bool:
        checks = self.checks
        return bool(checks) and all(c["passed"] for c in checks) and not self.result.get("fatal")


def run_verify(tree: Path, timeout: float = 600.0, progress=None, **options) -> Outcome:
    tree = Path(tree)
    if not tree.is_dir():
        raise VerifyError(f"not a directory: {tree}")
    for key in ("target", "draft"):
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
            # by path, not -m: the child must not have the patcher package importable (see verify_worker.sibling)
            [sys.executable, str(Path(__file__).with_name("verify_worker.py"))],
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


# ----------------------------------------------------------------------------- rendering
def render(outcome: Outcome, color: str = "auto") -> None:
    from rich.table import Table

    from .report import console

    con = console(color=color)
    res = outcome.result
    env = res.get("environment", {})
    con.print(
        f"ddpatch verify · {res.get('tree')} · transformers {env.get('transformers')} · torch {env.get('torch')}"
        f" · {outcome.seconds:.1f} s"
    )
    checks = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("model", "check", "result", "evidence"):
        checks.add_column(col, overflow="fold")
    for c in res.get("checks", []):
        checks.add_row("-", c["check"], _mark(c["passed"]), _evidence(c))
    for m in res.get("models", []):
        for c in m["checks"]:
            checks.add_row(m["model"], c["check"], _mark(c["passed"]), _evidence(c))
    con.print(checks)
    for m in res.get("models", []):
        if not m.get("methods"):
            continue
        table = Table(box=None, header_style="bold", pad_edge=False, title=None)
        sampled = bool(m.get("sampling"))
        columns = ["model", "method", "identical", "max |Δlogit| (at)"] + (["distribution p"] if sampled else [])
        for col in columns + ["acceptance", "accept histogram", "tok/s", "speedup"]:
            table.add_column(col)
        base = m["baseline"]
        identical = "sampled" if sampled else f"{base['identical_runs']}/{len(base['runs'])}"
        table.add_row(m["model"], base["method"], identical, "-", *(["-"] if sampled else []), "-", "-",
                      f"{base['tokens_per_s']:.1f}", "1.00x")
        for s in m["methods"]:
            hist = " ".join(f"{k}:{v}" for k, v in s.get("acceptance_histogram", {}).items())
            dlogit = f"{s['max_dlogit']:.1e} ({s['max_dlogit_at']})" if "max_dlogit" in s else "-"
            dist = [f"{s['distribution']['p_value']:.3g}" if "distribution" in s else "-"] if sampled else []
            table.add_row(
                m["model"],
                s["method"],
                "sampled" if sampled else f"{s['identical_runs']}/{len(s['runs'])}",
                dlogit,
                *dist,
                f"{s.get('acceptance_mean', 0):.2f}",
                hist,
                f"{s['tokens_per_s']:.1f}",
                f"{s.get('speedup', 0):.2f}x",
            )
        con.print(table)
        if m.get("plumbing_figures"):
            con.print("  (tiny random CPU model: speed figures measure plumbing, not model quality)")
    verdict = "[bold green]PASS[/]: every check passed" if outcome.passed else "[bold red]FAIL[/]: see the failed checks above"
    con.print(verdict)


def _mark(passed: bool) -> str:
    return "[green]pass[/]" if passed else "[bold red]FAIL[/]"


def _evidence(check: dict) -> str:
    text = check.get("evidence", "")
    if isinstance(text, dict):  # an error summary: show its message
        text = text.get("error") or json.dumps(text)
    text = str(text)
    if check.get("frame"):
        text += f" (at {check['frame']})"
    if check.get("hint"):
        text += f" - hint: recipe step {check['hint']}"
    return text
