"""The trained tiny pair shipped with ddpatch (``patcher/data/trained_pair``, made by
``tools/train_tiny_pair.py``): a ``Qwen3_5ForCausalLM`` hybrid trained on the Python standard library
and a ``DFlashDraftModel`` (block 8) trained on its features.

Unlike the random presets, ``--preset trained-qwen3_5`` does not script the draft: it is the same
verify as ``--target DIR --draft DIR`` on the two folders (``folder_preset_options`` turns the preset
into those options before the child starts), so the path a user takes with a real checkpoint is the
path tested, and acceptance comes from the real drafter. Beside the two folders, ``acceptance_floor.json``
(``train_tiny_pair.py --floor``) makes that acceptance part of the verdict (``acceptance.py``): the verifier
finds it next to the ``--draft`` folder, whichever way the folders were named. This module imports nothing of ``patcher``
(the verifier's child imports it through ``presets``) and torch only inside a function.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data" / "trained_pair"  # patcher/data: this file is in verify/models/

#: preset name -> (target folder, draft folder)
FOLDER_PRESETS = {"trained-qwen3_5": (DATA / "target", DATA / "draft")}

#: What a folder preset runs with unless the caller says otherwise: float32 (the oracle is conclusive
#: there) and the block size the drafter was trained at.
FOLDER_DEFAULTS = {"dtype": "float32", "block_size": 8}


def load_folder_target(name: str):
    """The preset's target as ``--target`` loads it: ``from_pretrained`` on its folder, offline, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    target, _ = FOLDER_PRESETS[name]
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, local_files_only=True).eval()


#: A folder preset's settings when it runs beside other presets (the default verify): the prompts and length its
#: stored floor covers, and the budgets at which a tree-construction bug shows (at budgets 8 and 16 the planted ones did).
PAIR_DEFAULTS = {"dtype": "float32", "block_size": 8, "tree_budgets": [8, 16], "prompts": 8, "max_new_tokens": 64}


def pair_options(name: str, options: dict) -> dict:
    """What the verifier's child runs a folder preset with beside other presets: its folders, its defaults, and the
    user's own prompts, length and budgets where given."""
    target, draft = FOLDER_PRESETS[name]
    for folder in (target, draft):
        if not (folder / "model.safetensors").is_file():
            raise ValueError(f"--preset {name}: {folder} holds no model.safetensors (run tools/train_tiny_pair.py)")
    given = {k: options[k] for k in ("tree_budgets", "prompts", "max_new_tokens") if options.get(k) is not None}
    return {"label": name, "target": str(target), "draft": str(draft), "scripted_draft": None, "seeds": [0], **PAIR_DEFAULTS, **given}


def folder_preset_options(options: dict) -> dict:
    """Verify options with a folder preset replaced by its ``target``/``draft`` folders (and its defaults).

    A folder preset runs alone: with another preset or with ``--target``/``--draft`` it is a usage error
    (``ValueError``)."""
    names = list(options.get("presets") or ())
    chosen = [n for n in names if n in FOLDER_PRESETS]
    if not chosen:
        return options
    if options.get("target") or options.get("draft"):
        raise ValueError(f"--preset {chosen[0]} brings its own --target and --draft folders: pass either, not both")
    if len(names) > 1:  # beside other presets it runs as a pair (``pair_options``)
        return options
    if options.get("target") or options.get("draft"):
        raise ValueError(f"--preset {chosen[0]} brings its own --target and --draft folders: pass either, not both")
    target, draft = FOLDER_PRESETS[chosen[0]]
    for folder in (target, draft):
        if not (folder / "model.safetensors").is_file():
            raise ValueError(f"--preset {chosen[0]}: {folder} holds no model.safetensors (run tools/train_tiny_pair.py)")
    # unscripted unless asked: --scripted-draft then scripts the trained drafter's proposals, as with --target/--draft
    out = {**options, "presets": None, "target": str(target), "draft": str(draft), "scripted_draft": options.get("scripted_draft"),
           "label": chosen[0]}  # the report names the preset, not its folder ("target")
    for key, value in FOLDER_DEFAULTS.items():
        if out.get(key) is None:
            out[key] = value
    return out
