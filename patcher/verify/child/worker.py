"""The verifier's child process: imports the patched tree, loads the models, decodes, checks.

It runs in its own process (``python .../patcher/verify/child/worker.py``, by path), started by
``ddpatch verify`` with a timeout, because it executes upstream code: the tree's
generic module names (``model``, ``dflash``) stay out of the CLI's ``sys.path``, a hang
or crash cannot take the CLI with it, and nothing is written: bytecode writing is off,
the working directory is a temporary folder, and models load with
``local_files_only=True``.

It prints one JSON object per line (``events``): ``{"event": "progress", ...}`` while it
works and a final ``{"event": "result", ...}``. The work is in the floors below, imported relatively
(inside functions: run by path, this file is re-entered as a module of the private package first, ``main``):
``models.load`` (loading, the greedy reference), ``subjects.methods`` (calling upstream's decoders),
``judge.one_model`` (the checks on one model) and its oracles.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

# ----------------------------------------------------------------------------- ddpatch stays out of the tree's reach
#: The name the verifier's own modules (this folder) are imported under in the child.
PRIVATE_PACKAGE = "_ddpatch_verify"


def child_package() -> str:
    """The package this folder's modules are imported from.

    Imported as ``patcher.verify.child.worker`` (by the tests), that is ``patcher.verify``. Run as a
    script, as ``ddpatch verify`` runs it, the folder is loaded by path under a private name
    and nothing of the ``patcher`` package is imported: a patched tree must run with ddpatch
    absent (it ships only its ``_ddpatch_runtime`` copy), so an ``import patcher`` in the tree
    must fail here as it would on a user's machine, instead of finding the verifier's own
    package. The folder's modules import only each other (relatively), the stdlib, torch and
    transformers.
    """
    if __package__:  # patcher.verify.child -> patcher.verify
        return __package__.rpartition(".")[0]
    if PRIVATE_PACKAGE not in sys.modules:
        import importlib.util

        here = Path(__file__).resolve().parent.parent  # patcher/verify: this file is in its child/ folder
        spec = importlib.util.spec_from_file_location(PRIVATE_PACKAGE, here / "__init__.py", submodule_search_locations=[str(here)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PRIVATE_PACKAGE] = module
        spec.loader.exec_module(module)
    return PRIVATE_PACKAGE


def sibling(name: str):
    """The verifier's module ``name`` (``judge.one_model``, ``models.load``) in the package the child runs under: for a
    caller outside the child (``benchmarks/bench_real_shapes.py --profile`` wraps the modules the child uses); the
    child's own code imports them relatively."""
    return importlib.import_module(f"{child_package()}.{name}")


class NoDdpatch:
    """A meta-path finder that makes ``patcher`` unimportable (also when it is pip-installed)
    and remembers who tried."""

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "patcher" or fullname.startswith("patcher."):
            self.attempts.append(fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r} (ddpatch is not importable from a patched tree)", name=fullname)
        return None


def hide_ddpatch() -> NoDdpatch:
    # The script's folder (patcher/verify) and patcher/ leave the path: their module names (models,
    # checks, runtime, api...) must not shadow the tree's. The folder holding patcher/ may stay (it
    # can be site-packages): the blocker makes ``patcher`` itself unimportable from anywhere.
    here = Path(__file__).resolve().parent  # patcher/verify/child
    hidden = {here, here.parent, here.parent.parent}
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() not in hidden]
    for name in [m for m in sys.modules if m == "patcher" or m.startswith("patcher.")]:
        del sys.modules[name]
    blocker = NoDdpatch()
    sys.meta_path.insert(0, blocker)
    return blocker


def ddpatch_modules() -> list[str]:
    return sorted(m for m in sys.modules if m == "patcher" or m.startswith("patcher."))


# ----------------------------------------------------------------------------- main
TINY_PARAMS = 50_000_000


def single_thread_for_tiny_models() -> None:
    """On tiny models thread hand-offs cost more than the matmuls: measured 8 ms against
    60-150 ms per decode step on a busy 2-core machine."""
    import torch

    torch.set_num_threads(1)


def run(cfg: dict) -> dict:
    import torch
    import transformers

    from ..judge import one_model
    from ..judge.coverage import runs as coverage_runs
    from ..models import load as models
    from ..plumbing import events
    from ..subjects import decoders, methods

    tree = Path(cfg["tree"]).resolve()
    events.TREE[:] = [str(tree)]
    env = {"transformers": transformers.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    result: dict[str, Any] = {"tree": str(tree), "environment": env, "checks": [], "models": []}
    plan = cfg.get("plan") or decoders.plan(tree, cfg.get("entries"), tuple(cfg.get("exclude") or ()))
    if not plan["decoders"]:
        result["fatal"] = f"no DDTree/DFlash decoder found in {tree} ({decoders.LOOKED_FOR})"
        return result
    budgets = sorted(set(cfg["tree_budgets"]) | {b for pair in cfg.get("pairs") or () for b in pair.get("tree_budgets") or ()})
    loaded = methods.load(tree, plan, budgets, events.error_summary)
    # a decoder that does not import fails its own rows; every other decoder is still judged in this run
    result["checks"] += methods.load_rows(plan, loaded)
    result["checks"].append(methods.coverage_check(loaded.decoders, plan["unparsed"], loaded.drafter_notes, plan.get("excluded"),
                                                    plan.get("exclude_source"), plan.get("not_torch")))
    result["decoders"] = loaded.decoders
    if cfg.get("run_only") is not None:  # one of several children: it runs its chunk of the decoders (runner.split)
        mine = {tuple(k) for k in cfg["run_only"]}
        loaded.methods = [m for m in loaded.methods if (m.decoder["file"], m.decoder["qualname"]) in mine]
    if not loaded.methods:
        return result
    if not cfg.get("target"):
        single_thread_for_tiny_models()
    if cfg.get("target"):
        target, drafts, mask, notes = models.load_real(cfg, loaded.drafters, loaded.primary)
        if sum(p.numel() for p in target.parameters()) < TINY_PARAMS:
            single_thread_for_tiny_models()
        for draft in drafts.values():
            models.check_fit(target, draft)
        vocab = target.config.get_text_config(decoder=True).vocab_size
        prompts, stops, made = models.tokenized_prompts(cfg, cfg["prompts"], min(vocab, mask if mask is not None else vocab), target)
        prompts, floor, missing, made = stored_floor_prompts(cfg, prompts, made)
        run_cfg = {**cfg, "stop_token_ids": stops, "acceptance_floor": floor, "acceptance_floor_missing": missing, "prompts_made": made}
        events.emit("progress", done=0, total=1, label="loaded " + Path(cfg["target"]).name)
        result["models"].append(one_model.verify_model(cfg.get("label") or Path(cfg["target"]).name, run_cfg, loaded, target, drafts,
                                                    mask, False, prompts, scripted=bool(cfg.get("scripted_draft")),
                                                    choose_mask=bool(cfg.get("scripted_draft")) and not cfg.get("draft"), notes=notes))
        if not one_model.sampling_of(run_cfg):  # the decoders' mode parameters on the user's own model (one short prompt each)
            result["models"][-1]["checks"] += coverage_runs.mode_runs(
                run_cfg, loaded, target, drafts, result["models"][-1].get("mask_token_id", mask), prompts[:1], result["models"][-1])
        result["loaded"] = models.loaded_with(target, cfg)
        return result
    for preset in cfg["presets"]:
        for sampled in passes(cfg, loaded):
            pass_cfg = {**cfg, **sampled}
            target, drafts, mask, notes = models.load_preset(preset, cfg["seeds"][0], loaded.drafters, cfg["block_size"],
                                                             bool(cfg.get("default_init")), sampling=one_model.sampling_of(pass_cfg) is not None)
            for draft in drafts.values():
                models.check_fit(target, draft)
            prompts = models.random_prompts(pass_cfg["prompts"] * len(pass_cfg["seeds"]), cfg["prompt_len"], cfg["seeds"][0], mask)
            label = preset if not sampled.get("sampled_pass") else f"{preset} (sampled)"
            result["models"].append(one_model.verify_model(label, pass_cfg, loaded, target, drafts, mask, True, prompts, notes=notes))
            if not sampled:  # coverage: the decoders' mode parameters get runs of their own (judge/coverage/runs.py)
                result["models"][-1]["checks"] += coverage_runs.mode_runs(pass_cfg, loaded, target, drafts, mask,
                                                                          prompts[:1], result["models"][-1])
    for pair in cfg.get("pairs") or ():
        pair_cfg = {**cfg, **pair}
        target, drafts, mask, notes = models.load_real(pair_cfg, loaded.drafters, loaded.primary)
        prompts, stops, made = models.tokenized_prompts(pair_cfg, pair_cfg["prompts"], target.config.get_text_config(decoder=True).vocab_size,
                                                        target)
        prompts, floor, missing, made = stored_floor_prompts(pair_cfg, prompts, made)
        pair_cfg.update(stop_token_ids=stops, acceptance_floor=floor, acceptance_floor_missing=missing, prompts_made=made)
        events.emit("progress", done=0, total=1, label=f"loaded {pair['label']}")
        result["models"].append(one_model.verify_model(pair["label"], pair_cfg, loaded, target, drafts, mask, False, prompts, notes=notes))
    return result


def stored_floor_prompts(cfg: dict, prompts: list, made: str):
    """A pair with a stored acceptance floor runs on the floor's prompts (the fast path: nothing to compute), unless
    the user gave a prompts file: then the run's own reference judges it. Returns (prompts, floor, why none, made)."""
    import torch

    from ..judge.acceptance import floor as acceptance
    floor, missing = acceptance.find(cfg)
    if floor is None or cfg.get("prompt_records"):
        return prompts, floor, missing, made
    ids = acceptance.prompts_of(floor, cfg["prompts"])
    return [torch.tensor([i]) for i in ids], floor, missing, f"{len(ids)} prompt(s) of the stored acceptance floor"


def passes(cfg: dict, loaded) -> list[dict]:
    """The passes over a random preset: greedy, then, by default, sampled for the decoders that take a temperature
    (``--temperature`` alone: only sampled; ``--greedy-only``: only greedy)."""
    if cfg.get("temperature"):
        return [{}]
    out = [{}]
    takes = any(m.takes_temperature() for m in loaded.methods if not m.drafter_method)
    if takes and not cfg.get("greedy_only"):
        out.append({"temperature": SAMPLED_PASS["temperature"], "sampled_pass": True, "prompts": SAMPLED_PASS["prompts"],
                    "seeds": cfg["seeds"][:1], "max_new_tokens": max(cfg["max_new_tokens"], SAMPLED_PASS["max_new_tokens"]),
                    "sampling_runs": cfg.get("sampled_pass_runs", SAMPLED_PASS["sampling_runs"])})
    return out


#: The sampled pass a default verify adds where a decoder takes a temperature: the logits oracle on every committed
#: row of a few sampled decodes, and a distributional test of the second new token.
SAMPLED_PASS = {"temperature": 1.0, "prompts": 2, "max_new_tokens": 32, "sampling_runs": 200}


def answer(cfg: dict, blocker: NoDdpatch) -> None:
    """Judge one tree and print the final ``result`` event."""
    from ..check import Check
    from ..plumbing import events

    try:
        from ..judge.coverage import runs as coverage  # every decoder call runs under line coverage

        coverage.start(cfg)
        result = run(cfg)
        result["coverage"] = coverage.collected()
        leaked = ddpatch_modules()
        if blocker.attempts or leaked:
            result.setdefault("checks", []).append(Check.of(
                "runs without ddpatch", passed=False,
                evidence=f"the tree imported {', '.join(sorted(set(blocker.attempts + leaked)))}").to_json())
        elif result.get("checks"):
            result["checks"].append(Check.of("runs without ddpatch", passed=True,
                                             evidence="no module of the patcher package was imported").to_json())
    except (FileNotFoundError, ValueError) as exc:
        result = {"fatal": str(exc).splitlines()[0]}
    except Exception as exc:
        result = {"crash": "verifier crashed: " + events.error_summary(exc)["error"], "trace": traceback.format_exc()[-4000:]}
    events.emit("result", result=result)


def main() -> int:
    blocker = hide_ddpatch()
    if not __package__:  # run by path, as ddpatch verify runs it: the rest runs as this module of the private package
        return importlib.import_module(f"{child_package()}.child.worker").serve_or_answer(blocker)
    return serve_or_answer(blocker)


def serve_or_answer(blocker: NoDdpatch) -> int:
    """``--serve PATH``: a warm verifier (see warm.py) that imports once and forks a child per tree; else judge the
    tree of the settings on standard input."""
    if sys.argv[1:2] == ["--serve"]:
        from . import warm

        return warm.serve(sys.argv[2], answer, blocker, warm.worker_path())
    answer(json.loads(sys.stdin.read()), blocker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
