"""The verifier's child process: imports the patched tree, loads the models, decodes, checks.

It runs in its own process (``python .../patcher/verify/worker.py``, by path), started by
``ddpatch verify`` with a timeout, because it executes upstream code: the tree's
generic module names (``model``, ``dflash``) stay out of the CLI's ``sys.path``, a hang
or crash cannot take the CLI with it, and nothing is written: bytecode writing is off,
the working directory is a temporary folder, and models load with
``local_files_only=True``.

It prints one JSON object per line (``events``): ``{"event": "progress", ...}`` while it
works and a final ``{"event": "result", ...}``. The work is in its sibling modules:
``models`` (loading, the greedy reference), ``binding`` (calling upstream's decoders),
``checks`` (the checks on one model) and ``oracle``.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

#: role -> the names it has in the upstream layouts the recipe declares (first found wins):
#: DFlash's April 2026 layout has its chain decoder as benchmark.py's private ``_dflash_generate``.
ENTRY_POINTS = {
    "dflash_generate": ("dflash_generate", "_dflash_generate"),
    "ddtree_generate": ("ddtree_generate",),
    "DFlashDraftModel": ("DFlashDraftModel",),
}


# ----------------------------------------------------------------------------- ddpatch stays out of the tree's reach
#: The name the verifier's own modules (this folder) are imported under in the child.
PRIVATE_PACKAGE = "_ddpatch_verify"


def child_package() -> str:
    """The package this folder's modules are imported from.

    Imported as ``patcher.verify.worker`` (by the tests), that is ``patcher.verify``. Run as a
    script, as ``ddpatch verify`` runs it, the folder is loaded by path under a private name
    and nothing of the ``patcher`` package is imported: a patched tree must run with ddpatch
    absent (it ships only its ``_ddpatch_runtime`` copy), so an ``import patcher`` in the tree
    must fail here as it would on a user's machine, instead of finding the verifier's own
    package. The folder's modules import only each other (relatively), the stdlib, torch and
    transformers.
    """
    if __package__:
        return __package__
    if PRIVATE_PACKAGE not in sys.modules:
        import importlib.util

        here = Path(__file__).resolve().parent
        spec = importlib.util.spec_from_file_location(PRIVATE_PACKAGE, here / "__init__.py", submodule_search_locations=[str(here)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PRIVATE_PACKAGE] = module
        spec.loader.exec_module(module)
    return PRIVATE_PACKAGE


def sibling(name: str):
    """This folder's module ``name`` (``events``, ``models``, ``binding``, ``checks``, ``oracle``, ``presets``)."""
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
    here = Path(__file__).resolve().parent
    hidden = {here, here.parent}
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() not in hidden]
    for name in [m for m in sys.modules if m == "patcher" or m.startswith("patcher.")]:
        del sys.modules[name]
    blocker = NoDdpatch()
    sys.meta_path.insert(0, blocker)
    return blocker


def ddpatch_modules() -> list[str]:
    return sorted(m for m in sys.modules if m == "patcher" or m.startswith("patcher."))


# ----------------------------------------------------------------------------- the tree
def _excluded(rel: Path, pattern: str) -> bool:
    """``--exclude``'s reading (patcher.engine.pipeline.exclude_globs): a name anywhere, or a path from the root."""
    pattern = pattern.strip().removeprefix("./").rstrip("/")
    if "/" not in pattern:
        return any(fnmatch.fnmatch(part, pattern) for part in rel.parts)
    return any(fnmatch.fnmatch(rel.as_posix(), g) for g in (pattern, pattern + "/*"))


def find_entry_points(tree: Path, exclude=()) -> dict[str, tuple[str, str]]:
    """Per role, the module and the name defining it, from a static scan (nothing is imported); ``exclude``: the
    ``--exclude`` patterns (a name anywhere, or a path from the tree's root), as check reads them."""
    found: dict[str, tuple[str, str]] = {}
    for path in sorted(tree.rglob("*.py")):
        rel = path.relative_to(tree)
        if any(part.startswith(".") or part in ("tests", "build", "__pycache__") for part in rel.parts):
            continue
        if any(_excluded(rel, p) for p in exclude):
            continue
        try:
            module = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        names = {n.name for n in module.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        dotted = ".".join(rel.with_suffix("").parts)
        if dotted.endswith(".__init__"):
            dotted = dotted[: -len(".__init__")]
        for role, spellings in ENTRY_POINTS.items():
            for rank, name in enumerate(spellings):
                if name in names and (role not in found or rank < found[role][2]):
                    found[role] = (dotted, name, rank)
    return {role: (module, name) for role, (module, name, _) in found.items()}


def import_entry_points(tree: Path, modules: dict[str, tuple[str, str]]) -> dict[str, Any]:
    sys.path.insert(0, str(tree))
    return {role: getattr(importlib.import_module(module), name) for role, (module, name) in modules.items()}


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

    binding, checks, models, events = sibling("binding"), sibling("checks"), sibling("models"), sibling("events")

    tree = Path(cfg["tree"]).resolve()
    env = {"transformers": transformers.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    result: dict[str, Any] = {"tree": str(tree), "environment": env, "checks": [], "models": []}
    modules = find_entry_points(tree, cfg.get("exclude") or ())
    missing = [" or ".join(ENTRY_POINTS[n]) for n in ("dflash_generate", "DFlashDraftModel") if n not in modules]
    if missing:
        result["fatal"] = f"no DDTree/DFlash decoder found in {tree} (looked for {', '.join(missing)})"
        return result
    try:
        fns = import_entry_points(tree, modules)
        result["checks"].append({"check": "loads", "passed": True, "evidence": ", ".join(f"{n} from {m}" for m, n in modules.values())})
    except Exception as exc:
        err = events.error_summary(exc)
        result["checks"].append({"check": "loads", "passed": False, "evidence": err["error"], **err})
        return result
    for role in ("dflash_generate", "ddtree_generate"):
        if role in fns:
            try:
                binding.bind_roles(fns[role])
            except binding.BindError as exc:
                result["checks"].append({"check": "binds the decoders' parameters", "passed": False, "evidence": str(exc)})
                return result
    draft_cls = fns["DFlashDraftModel"]
    if not cfg.get("target"):
        single_thread_for_tiny_models()
    if cfg.get("target"):
        target, draft, mask = models.load_real(cfg, draft_cls)
        if sum(p.numel() for p in target.parameters()) < TINY_PARAMS:
            single_thread_for_tiny_models()
        models.check_fit(target, draft)
        vocab = target.config.get_text_config(decoder=True).vocab_size
        prompts, stops = models.tokenized_prompts(cfg, cfg["prompts"], min(vocab, mask if mask is not None else vocab))
        floor, missing = sibling("acceptance").find(cfg)  # a pair with a stored acceptance floor runs on its prompts
        if floor is not None:
            prompts = [torch.tensor([ids]) for ids in sibling("acceptance").prompts_of(floor, cfg["prompts"])]
        cfg = {**cfg, "stop_token_ids": stops, "acceptance_floor": floor, "acceptance_floor_missing": missing}
        events.emit("progress", done=0, total=1, label="loaded " + Path(cfg["target"]).name)
        result["models"].append(checks.verify_model(Path(cfg["target"]).name, cfg, fns, target, draft, mask, False, prompts,
                                             scripted=bool(cfg.get("scripted_draft")),
                                             choose_mask=bool(cfg.get("scripted_draft")) and not cfg.get("draft")))
        result["loaded"] = models.loaded_with(target, cfg)
    else:
        for preset in cfg["presets"]:
            target, draft, mask = models.load_preset(preset, cfg["seeds"][0], draft_cls, cfg["block_size"], bool(cfg.get("default_init")),
                                         sampling=checks.sampling_of(cfg) is not None)
            models.check_fit(target, draft)
            prompts = models.random_prompts(cfg["prompts"] * len(cfg["seeds"]), cfg["prompt_len"], cfg["seeds"][0], mask)
            result["models"].append(checks.verify_model(preset, cfg, fns, target, draft, mask, True, prompts))
    return result


def answer(cfg: dict, blocker: NoDdpatch) -> None:
    """Judge one tree and print the final ``result`` event."""
    events = sibling("events")
    try:
        result = run(cfg)
        leaked = ddpatch_modules()
        if blocker.attempts or leaked:
            result.setdefault("checks", []).append({
                "check": "runs without ddpatch", "passed": False,
                "evidence": f"the tree imported {', '.join(sorted(set(blocker.attempts + leaked)))}",
            })
        elif result.get("checks"):
            result["checks"].append({"check": "runs without ddpatch", "passed": True, "evidence": "no module of the patcher package was imported"})
    except (FileNotFoundError, ValueError) as exc:
        result = {"fatal": str(exc).splitlines()[0]}
    except Exception as exc:
        result = {"crash": "verifier crashed: " + events.error_summary(exc)["error"], "trace": traceback.format_exc()[-4000:]}
    events.emit("result", result=result)


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:  # a warm verifier (see warm.py): imports once, forks a child per tree
        blocker = hide_ddpatch()
        warm = sibling("warm")
        return warm.serve(sys.argv[2], answer, blocker, sibling, warm.worker_path())
    cfg = json.loads(sys.stdin.read())
    answer(cfg, hide_ddpatch())
    return 0


if __name__ == "__main__":
    sys.exit(main())
