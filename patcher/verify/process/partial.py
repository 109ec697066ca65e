"""Partial verdicts, never none: the children of one verify run as a queue, and a timeout (or one child that dies)
keeps every verdict the finished children gave.

``runner.split`` cuts a verify into parts (a model group, a chunk of its decoders); ``run_queue`` runs them at most
``slots`` at a time, reading each one's events as they come. Where some parts end without a result, ``partial``
merges the finished parts' rows and names each decoder of the others "not verified on MODEL: timed out after N s"
(or how its child died), in the ``decoders`` row and in a failing ``verify finished`` row: exit 1, findings, with
every decoder judged so far in the report.

Plain Python (no torch): the parent's side.
"""

from __future__ import annotations

import json
import time


def read_event(line: str, progress, log: list[str]) -> dict | None:
    """One line of a child's output: a progress event (handed to ``progress``), its result (returned), or anything else
    upstream code printed (kept in ``log``)."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        log.append(line)  # warnings and prints from upstream code
        return None
    if event.get("event") == "progress" and progress is not None:
        progress(event)
    return event["result"] if event.get("event") == "result" else None


def run_queue(parts: list, start, slots: int, deadline: float, progress, log: list[str]) -> tuple[list, dict]:
    """Each part's result (None where it gave none) and, by part index, how the child that died before the deadline
    ended (``exitstatus.Death``). ``start(part)`` starts a child; at most ``slots`` run side by side."""
    import selectors

    sel = selectors.DefaultSelector()
    results: dict[int, dict | None] = {}
    deaths: dict = {}
    running: dict[int, object] = {}
    started: list = []
    waiting = sorted(range(len(parts)), key=lambda i: parts[i].get("wave", 0))  # each chunk on every model, then the next
    sampled = 0.0

    def finish(i: int, result) -> None:
        child = running.pop(i)
        sel.unregister(child.stdout)
        results[i] = result
        if result is None and time.perf_counter() < deadline:
            deaths[i] = child.death()

    try:
        while len(results) < len(parts):
            while waiting and len(running) < max(1, slots) and time.perf_counter() < deadline:
                i = waiting.pop(0)
                running[i] = start(parts[i])
                started.append(running[i])
                sel.register(running[i].stdout, selectors.EVENT_READ, i)
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or not running:
                break
            if time.perf_counter() - sampled >= 1.0:  # their peak memory, for the message if one dies
                for child in running.values():
                    child.sample()
                sampled = time.perf_counter()
            ready = sel.select(timeout=min(remaining, 1.0))
            if not ready:
                for i in [i for i, child in running.items() if child.exited()]:
                    finish(i, None)
                continue
            for key, _ in ready:
                i = key.data
                if i not in running:
                    continue
                line = running[i].stdout.readline()
                if not line:
                    finish(i, None)
                    continue
                result = read_event(line, progress, log)
                if result is not None:
                    finish(i, result)
    finally:
        for child in started:
            child.kill()
    return [results.get(i) for i in range(len(parts))], deaths


def _models_of(part: dict) -> list[str]:
    return list(part.get("presets") or []) + [p.get("label", "?") for p in part.get("pairs") or ()] or \
        [part.get("label") or "the model"]


def _keys_of(part: dict) -> list[tuple[str, str]]:
    if part.get("run_only") is not None:
        return [tuple(k) for k in part["run_only"]]
    return [(d["file"], d["qualname"]) for d in part["plan"]["decoders"]]


def partial(result: dict, results: list, parts: list, deaths: dict, timeout: float, cfg: dict) -> dict:
    """``result`` (the finished parts merged) with every decoder of an unfinished part named not verified, and why."""
    not_done: dict[tuple[str, str], list[str]] = {}
    whys = []
    for i, (part, got) in enumerate(zip(parts, results)):
        if got is not None:
            continue
        death = deaths.get(i)
        why = f"its verifier child died: {death.describe(cfg)}" if death is not None else f"timed out after {timeout:.0f} s"
        whys.append(why)
        for key in _keys_of(part):
            not_done.setdefault(key, []).extend(f"{m}: {why}" for m in _models_of(part))
    names = []
    for d in result.get("decoders") or []:
        key = (d["file"], d["qualname"])
        if key in not_done and d.get("verified"):
            d.update(verified=False, reason="not verified on " + "; ".join(dict.fromkeys(not_done[key])), unfinished=True)
            names.append(f"{d['file']}:{d['qualname']}")
    for row in result.get("checks", []):
        if row.get("check") == "decoders" and names:
            row["passed"] = False
            row["evidence"] = (f"{len(names)} decoder(s) not verified: {', '.join(names)} ({'; '.join(dict.fromkeys(whys))}); "
                               + row["evidence"])
    done = sum(r is not None for r in results)
    result.setdefault("checks", []).append({
        "check": "verify finished", "passed": False,
        "evidence": (f"{done} of {len(parts)} part(s) judged; {'; '.join(dict.fromkeys(whys))}: not verified "
                     f"{', '.join(names) or 'the rest'}; every decoder judged so far is in the rows above (raise --timeout, "
                     f"narrow the run with --entry or --exclude, or run it on a less loaded machine)"),
        "unfinished": names})
    return result
