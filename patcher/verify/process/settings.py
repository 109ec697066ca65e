"""What a verify runs with, decided in the parent before any child starts: the narrowing the apply that wrote the
tree recorded (``narrowed``), and a real drafter's own block size and the defaults that let its acceptance be judged
(``real_drafter_defaults``). Stdlib only."""

from __future__ import annotations

import json
from pathlib import Path

#: where ``ddpatch apply`` records the ``--exclude`` it was given (engine.files.runtime_sources)
RECORD = "_ddpatch_runtime/MANIFEST.json"


def recorded_exclude(tree: Path) -> list[str]:
    """The ``--exclude`` patterns the apply that wrote ``tree`` was given (every runtime copy's manifest records
    them), so that ``ddpatch verify TREE`` judges what apply patched, as the user narrowed it."""
    patterns: list[str] = []
    for manifest in sorted(tree.glob("**/" + RECORD)):
        if any(part.startswith(".") for part in manifest.relative_to(tree).parts):
            continue
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for pattern in (data.get("apply") or {}).get("exclude") or ():
            if isinstance(pattern, str) and pattern not in patterns:
                patterns.append(pattern)
    return patterns


#: A real drafter's verify (``--target`` and ``--draft``, unscripted) where the user gives none of these: upstream DDTree's
#: benchmark budgets, and prompts and new tokens enough that a tree built wrong shows on a pair no floor was stored for
#: (docs/verifier.md "Acceptance for any pair": the power and the cost). Its block size is its config's.
REAL_DRAFTER = {"tree_budgets": [16, 32, 64, 128, 256, 512, 1024], "prompts": 4, "max_new_tokens": 128}


def drafter_block_size(folder: str) -> int | None:
    """The block size a drafter's ``config.json`` says it was trained at (``block_size``, or DFlash's
    ``dflash_config.block_size``), or None."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("block_size", (config.get("dflash_config") or {}).get("block_size"))
    return value if isinstance(value, int) and value >= 2 else None


def real_drafter_defaults(options: dict) -> dict:
    """A real drafter runs at the block size it was trained at (its config's) and, unless the user said otherwise,
    at upstream's budgets and the prompts and length that let its acceptance be judged; ``settings`` says where each
    came from."""
    if not (options.get("target") and options.get("draft")) or options.get("scripted_draft") or options.get("label"):
        return options
    out, said = dict(options), {}
    block = drafter_block_size(options["draft"])
    if out.get("block_size") is None and block is not None:
        out["block_size"], said["block_size"] = block, "the drafter's config.json"
    for key, value in REAL_DRAFTER.items():
        if out.get(key) is None:
            out[key], said[key] = value, "the real-drafter default"
    out["settings_from"] = said
    return out


def narrowed(tree: Path, options: dict) -> dict:
    """``options`` with the ``--exclude`` the apply that wrote ``tree`` recorded, where the user gave neither
    ``--exclude`` nor ``--entry`` (nor the config file's): verify judges what apply patched."""
    if options.get("exclude") or options.get("entries"):
        return options
    recorded = recorded_exclude(tree)
    if not recorded:
        return options
    return {**options, "exclude": recorded, "exclude_source": f"recorded by the apply that wrote this tree ({RECORD})"}
