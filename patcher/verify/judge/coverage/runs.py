"""The child's side of coverage: every decoder call runs under line coverage (coverage.py, restricted to the tree's
files), each decoder in its own context, and the decoder's mode parameters get runs of their own.

``start`` makes the collector (once per child); ``measuring(method)`` wraps one decoder call (``decode_loop.DecodeLoop.decode``
calls it around ``call_generate``: only the decoder's own calls are measured, not the oracles' forwards, so the lines
are the decoder's); ``mode_runs`` runs, on the first greedy random preset, each mode value that reaches a branch the
default runs left unrun and that can change tokens or caches, judged for token identity and logits like a default
run (one prompt); ``collected`` is what the child sends the parent (``rows.settle`` makes the rows).

A mode value is run when it guards such a branch; values behind which only prints, logging or raising sit are not
(named, with that reason). At most ``cfg["mode_runs"]`` runs per decoder (``MODE_RUNS``) and ``MODE_SECONDS`` in all;
the values left over are named "over budget".
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from .. import logits, neartie
from ..tokens import compare
from ...check import Check
from ...models.script import ScriptedDraft
from .rows import classify, findings
from ...models.load import greedy
from ...plumbing.events import emit, error_summary
from ...subjects.binding import BindError, bind_roles, call_generate
from ...subjects.coverage import MODE_ROLES
from ...subjects.decoder_code import decoder_code
from ...subjects.reach import Tree

#: mode runs per decoder (``verify --mode-runs N``) and seconds for all of them in one child
MODE_RUNS = 4
MODE_SECONDS = 120.0

_STATE: dict = {"collector": None, "why": "not started", "modes": {}, "done": set()}


class Collector:
    """coverage.py over the tree's files (the copied ``_ddpatch_runtime`` is ddpatch's, not the decoder's)."""

    def __init__(self, tree: Path):
        import coverage

        self.tree = Path(tree).resolve()
        self.cov = coverage.Coverage(data_file=None, source=[str(self.tree)], omit=["*/_ddpatch_runtime/*"],
                                     config_file=False)
        self.cov.set_option("run:disable_warnings", ["no-data-collected", "module-not-measured", "module-not-imported",
                                                     "no-ctracer", "couldnt-parse"])
        self.depth = 0

    @contextlib.contextmanager
    def measuring(self, context: str):
        if self.depth:  # a decoder that calls another: the outer context keeps the lines
            yield
            return
        self.depth += 1
        self.cov.start()
        self.cov.switch_context(context)
        try:
            yield
        finally:
            self.cov.stop()
            self.depth -= 1

    def contexts(self) -> dict:
        """context -> file relative to the tree -> the lines that ran."""
        data = self.cov.get_data()
        out: dict = {}
        for path in data.measured_files():
            try:
                rel = Path(path).resolve().relative_to(self.tree).as_posix()
            except ValueError:
                continue
            for line, contexts in (data.contexts_by_lineno(path) or {}).items():
                for ctx in contexts:
                    if ctx:
                        out.setdefault(ctx, {}).setdefault(rel, []).append(line)
        return {ctx: {rel: sorted(set(lines)) for rel, lines in files.items()} for ctx, files in out.items()}


def start(cfg: dict) -> None:
    """Make this child's collector; without coverage.py the rows say it was not measured."""
    _STATE.update(collector=None, modes={}, done=set(), why="")
    try:
        _STATE["collector"] = Collector(Path(cfg["tree"]))
    except ImportError:
        _STATE["why"] = "the coverage package is not installed (pip install 'coverage>=7', a dependency of ddpatch)"
    except Exception as exc:
        _STATE["why"] = f"coverage.py could not start: {error_summary(exc)['error']}"


def context_of(method, values: dict | None = None) -> str:
    key = f"{method.decoder['file']}:{method.decoder['qualname']}"
    return key + ("|" + json.dumps(values, sort_keys=True) if values else "")


def measuring(method, values: dict | None = None):
    """A context manager around one call of ``method``'s decoder (does nothing without a collector)."""
    collector = _STATE["collector"]
    return collector.measuring(context_of(method, values)) if collector is not None else contextlib.nullcontext()


def collected() -> dict:
    collector = _STATE["collector"]
    if collector is None:
        return {"available": False, "why": _STATE["why"]}
    try:
        return {"available": True, "contexts": collector.contexts(), "modes": _STATE["modes"]}
    except Exception as exc:
        return {"available": False, "why": f"coverage.py could not read its data: {error_summary(exc)['error']}"}


# ----------------------------------------------------------------------------- mode runs
def _lines(contexts: dict, key: str) -> dict:
    out: dict = {}
    for ctx, files in contexts.items():
        if ctx.split("|")[0] == key:
            for rel, lines in files.items():
                out.setdefault(rel, set()).update(lines)
    return out


def plan(dc, ran: dict, roles: dict, tried: list = ()) -> tuple[list, dict]:
    """(the runs to try, the parameters not worth a run with the reason) for one decoder, from what its runs so far
    left unrun: first each value of a mode that guards an unproven branch; once those ran (``tried``), the
    combination of the modes a branch still unrun reads (``if chain_attention and dynamic_branching:``; ``block_size``
    stays as verified)."""
    _, items = findings(dc, ran)
    classify(items, {"roles": roles}, True)
    needing = [f for f in items if f.unproven]
    runs, not_run = [], {}
    for p, mode in dc.modes.items():
        if any(p in f.guards for f in needing):
            runs += [{p: v} for v in mode["values"] if {p: v} not in tried]
        elif any(p in f.guards for f in items):
            not_run[p] = "behind it only code that cannot change tokens or caches (prints, logging, asserts, raising)"
    for f in needing:
        for g in f.guards:
            if g not in dc.modes and g not in not_run and roles.get(g) not in MODE_ROLES:
                not_run[g] = (f"{roles[g]} is an input this verify sets, not a mode" if g in roles else
                              f"cannot bind: {g} is no bool, Literal or string mode")
        modes = [g for g in f.guards if g in dc.modes and "role" not in dc.modes[g]]
        combo = {g: dc.modes[g]["values"][0] for g in modes}
        if tried and len(modes) > 1 and combo not in tried and combo not in runs:
            runs.append(combo)
    return runs if not tried else [r for r in runs if len(r) > 1], not_run


def mode_runs(cfg: dict, loaded, target, drafts: dict, mask_token_id, prompts, model: dict) -> list[dict]:
    """The mode runs of every decoder (once per child, on its first greedy random preset): their lossless and logits
    rows, for the model ``model`` (its tolerance and near-tie ε)."""
    collector = _STATE["collector"]
    budget = int(cfg.get("mode_runs", MODE_RUNS))
    if collector is None or not prompts:  # a sampled-only run (--temperature) gets them too: mode runs decode greedily
        return []
    tree, rows = Tree(Path(cfg["tree"])), []
    deadline = time.perf_counter() + float(cfg.get("mode_seconds", MODE_SECONDS))
    drafter_names = tuple(loaded.drafters)
    prompt = prompts[0].to(target.get_input_embeddings().weight.device)
    max_new, stop_ids = cfg["max_new_tokens"], cfg.get("stop_token_ids") or None
    reference = None
    for method in _one_method_each(loaded, cfg):
        key = context_of(method)
        if key in _STATE["done"]:
            continue
        _STATE["done"].add(key)
        draft = drafts.get(method.drafter)
        try:
            roles = bind_roles(method.callable_for(draft), method.required())
        except BindError:
            continue
        dc = decoder_code(tree, (method.decoder["file"], method.decoder["qualname"]), roles,
                          {"block_size": cfg["block_size"]}, drafter_names)
        record = {"roles": roles, "runs": [], "not_run": {}}
        _STATE["modes"][key] = record
        if dc is None or not dc.modes:
            continue
        ran = _lines(collector.contexts(), key)
        if not ran:
            record["not_run"] = {p: "the default runs of this decoder did not complete" for p in dc.modes}
            continue
        todo, record["not_run"] = plan(dc, ran, roles)
        tried: list = []
        combined = False
        while todo:
            values = todo.pop(0)
            if len(tried) >= budget or time.perf_counter() > deadline:
                why = "--mode-runs 0" if budget == 0 else f"over budget ({budget} mode runs per decoder, --mode-runs)" \
                    if len(tried) >= budget else f"over budget ({cfg.get('mode_seconds', MODE_SECONDS):g} s of mode runs)"
                for p in values:
                    record["not_run"].setdefault(p, why)
                continue
            if reference is None:
                reference = greedy(target, prompt, max_new, stop_ids or ())
            run, made = _run(method, values, roles, cfg, target, draft, mask_token_id, prompt, reference, model)
            record["runs"].append(run)
            tried.append(values)
            rows += made
            emit("progress", done=0, total=1, label=f"{model['model']}: {method.name} with {_text(values)}")
            if not todo and not combined:  # what one value at a time left unrun: the combinations its tests read
                combined = True
                todo = plan(dc, _lines(collector.contexts(), key), roles, tried)[0]
    return rows


def _one_method_each(loaded, cfg: dict) -> list:
    """One method per decoder: the primary drafter class, the smallest tree budget."""
    out: dict = {}
    budgets = sorted(cfg.get("tree_budgets") or [0])
    for m in loaded.methods:
        k = (m.decoder["file"], m.decoder["qualname"])
        best = out.get(k)
        rank = (m.drafter not in (None, loaded.primary), m.budget not in (None, budgets[0]))
        if best is None or rank < best[0]:
            out[k] = (rank, m)
    return [m for _, m in out.values()]


def _text(values: dict) -> str:
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())


def _run(method, values, roles, cfg, target, draft, mask_token_id, prompt, reference, model) -> tuple[dict, list]:
    """One mode run: (its record, its lossless and logits rows)."""
    block_size = next((v for p, v in values.items() if roles.get(p) in MODE_ROLES), cfg["block_size"])
    extra = {p: v for p, v in values.items() if roles.get(p) not in MODE_ROLES}
    name = f"{method.name} [{_text(values)}]"
    decoder = {"file": method.decoder["file"], "function": method.decoder["qualname"], "kind": method.kind,
               "drafter": method.drafter, "mode": values}
    hook = None
    if draft is not None:
        hook = ScriptedDraft(target, prompt[0].tolist() + reference, seed=0, forbidden=[mask_token_id]).attach(draft)
    recorder = logits.LogitsRecorder(target)
    try:
        with recorder, measuring(method, values):
            new, _, _ = call_generate(method.callable_for(draft), model=draft, target=target, input_ids=prompt,
                                      mask_token_id=mask_token_id, max_new_tokens=cfg["max_new_tokens"], block_size=block_size,
                                      stop_token_ids=cfg.get("stop_token_ids") or None, tree_budget=method.budget,
                                      required=method.required(), extra=extra)
    except Exception as exc:
        err = error_summary(exc)
        row = Check.of(f"lossless: {name}", passed=False, **err, decoder=decoder,
                       evidence=f"{method.where} with {_text(values)} (a mode run): {err['error']}").to_json()
        return {"values": values, "method": method.name, "passed": False, "error": err["error"]}, [row]
    finally:
        if hook is not None:
            hook.remove()
    final = prompt[0].tolist() + new
    forced = logits.reference_logits(target, final)
    verdict = compare(reference, new)
    prompt_len = prompt.shape[1]
    ties = neartie.judge_ties(reference, new, forced, prompt_len, (model.get("calibration") or {}).get("epsilon", 0.0),
                              mask_token_id, cfg.get("stop_token_ids") or (), cfg["max_new_tokens"])
    judged = logits.judge_logits(recorder.calls, final, forced, prompt_len, model["logit_tolerance"])
    rows = [Check.of(f"lossless: {name}", passed=ties.ok, decoder=decoder,
                     evidence=f"a mode run, one prompt: {verdict.describe()}" + ("" if verdict.identical else f"; {ties.describe()}")),
            Check.of(f"logits == from-scratch: {name}", passed=judged.passed, decoder=decoder,
                     evidence=f"a mode run, one prompt: {judged.describe()}")]
    return {"values": values, "method": method.name, "passed": ties.ok and judged.passed}, [r.to_json() for r in rows]
