"""The stored floor: what a correct tree reaches on a shipped pair, measured once and kept beside it.

A pair of model folders may carry ``acceptance_floor.json`` beside them (the trained pair does:
``patcher/data/trained_pair``). ``measure`` makes it with ``reference_decode``: ddpatch's own
from-scratch chain and tree decoders, run on the pair's prompts, and at every start of each
prompt's greedy continuation the acceptances a drafter within ``epsilon`` of this one could
reach (``epsilon`` is the drafter oracle's float32 tolerance on the drafter's output, carried
through the LM head: a drafter the oracle passes stays within it). It stores the weights' hashes,
the settings and the command; nothing in it is set by hand.

At verify time, with that pair (same weights, float32, greedy, its block size, a stored budget, at
most its number of new tokens) the stored floor is the fast path; any other run computes the same
data in the run (``pair_reference``). ``acceptance_verdict`` judges every round against either.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..calibration import MULTIPLE
from .reference_decode import Positions, ScratchPair, decode, max_row_l1, walk

FLOOR_FILE = "acceptance_floor.json"
FORMAT = 1


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def weights_of(folder) -> Path:
    return Path(folder) / "model.safetensors"


# ----------------------------------------------------------------------------- making the floor
def epsilon(target, draft, prompt, greedy: list[int], mask_id: int, block_size: int) -> dict:
    """How far (in logits) a correct tree's drafter may sit from the from-scratch one: the drafter oracle's
    output tolerance on this pair (measured, at least its float32 minimum) times the LM head's largest row
    L1 norm (|Δlogit| <= |Δhidden|_max * |row|_1)."""
    import torch

    from ..drafter.recorder import calibrate

    cal = calibrate(target, draft, torch.tensor([prompt]), greedy, mask_id, block_size)
    row = max_row_l1(target.get_output_embeddings())
    tol = cal.tolerances["output"]
    return {"logits": tol * row, "output_tolerance": tol, "output_floor": cal.floors["output"], "lm_head_max_row_l1": row,
            "rule": f"drafter oracle output tolerance (max({MULTIPLE:g} x measured floor, float32 minimum)) x largest "
                    "|LM head row|_1"}


def measure(target, draft, target_dir, draft_dir, prompts: list[list[int]], texts: list[str], *, block_size: int,
            budgets: list[int], max_new_tokens: int, stop_ids: list[int], command: str, progress=print) -> dict:
    """The floor file's content: per prompt its greedy continuation, and per method the from-scratch
    reference decode's acceptances and, at every start, the reachable set."""
    import torch
    import transformers

    from ...models.load import greedy

    methods = ["dflash"] + [f"ddtree_tb{b}" for b in budgets]
    pair = ScratchPair(target, draft, draft.mask_token_id, block_size)
    q = block_size - 1
    conts = [greedy(target, torch.tensor([p]), max_new_tokens + q) for p in prompts]  # no stop: the positions need it all
    eps = epsilon(target, draft, prompts[0], conts[0], draft.mask_token_id, block_size)
    out_prompts = []
    for i, (prompt, cont) in enumerate(zip(prompts, conts)):
        pos = Positions(pair, prompt, cont, methods, max_new_tokens, eps["logits"])
        stop_at = next((j for j, t in enumerate(cont[:max_new_tokens]) if t in stop_ids), None)
        entry = {"ids": prompt, "greedy": cont, "stop_at": stop_at, "methods": {}}
        for m in methods:
            new, rounds = decode(pair, prompt, m, max_new_tokens, stop_ids)
            if any(a not in r for a, r in zip(pos.reference[m], pos.reachable[m])):
                raise RuntimeError(f"prompt {i} {m}: a from-scratch acceptance outside its own reachable set")
            if rounds != walk(pos.reference[m], max_new_tokens, stop_at) or new != cont[: len(new)]:
                raise RuntimeError(f"prompt {i} {m}: the from-scratch decode disagrees with the per-start reference "
                                   f"({rounds} against {walk(pos.reference[m], max_new_tokens, stop_at)})")
            entry["methods"][m] = {"reference_decode": rounds, "at": pos.reference[m], "reachable": pos.reachable[m]}
        out_prompts.append(entry)
        progress(f"floor: prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{m} {sum(e['reference_decode']) / len(e['reference_decode']):.2f}" for m, e in entry["methods"].items()))
    return {
        "format": FORMAT,
        "command": command,
        "made_by": "patcher/verify/judge/acceptance/reference_decode.py: from-scratch chain and tree decoders, no cache",
        "weights": {"target": sha256(weights_of(target_dir)), "draft": sha256(weights_of(draft_dir))},
        "settings": {"dtype": "float32", "greedy": True, "block_size": block_size, "budgets": budgets,
                     "max_new_tokens": max_new_tokens, "stop_token_ids": stop_ids, "prompts": texts,
                     "torch": torch.__version__, "transformers": transformers.__version__},
        "epsilon": eps,
        "prompts": out_prompts,
    }


# ----------------------------------------------------------------------------- finding it
def find(cfg: dict) -> tuple[dict | None, str]:
    """(the stored floor of the ``--target``/``--draft`` pair, '') or (None, why there is none)."""
    if not cfg.get("draft") or not cfg.get("target"):
        return None, "no drafter folder"
    path = Path(cfg["draft"]).resolve().parent / FLOOR_FILE
    if not path.is_file():
        return None, "no stored floor for this drafter"
    try:
        data = json.loads(path.read_text())
        stored = data["weights"]
    except (ValueError, KeyError, OSError) as exc:
        return None, f"{path} is unreadable ({exc})"
    for role in ("target", "draft"):
        w = weights_of(cfg[role])
        if not w.is_file() or sha256(w) != stored[role]:
            return None, f"{path.name} beside the drafter was measured on other {role} weights"
    return data, ""


def not_applicable(floor_data: dict, cfg: dict, dtype: str, budget: int | None) -> str | None:
    """Why the stored floor cannot judge this run (None: it can)."""
    st = floor_data["settings"]
    if dtype != st["dtype"]:
        return f"the floor was measured in {st['dtype']}, this run is {dtype}"
    if cfg.get("temperature"):
        return "the floor is for greedy decoding"
    if cfg["block_size"] != st["block_size"]:
        return f"the floor was measured at block size {st['block_size']}, this run uses {cfg['block_size']}"
    if budget is not None and budget not in st["budgets"]:
        return f"no floor for tree budget {budget} (stored: {', '.join(map(str, st['budgets']))})"
    if cfg["max_new_tokens"] > st["max_new_tokens"]:
        return f"the floor covers {st['max_new_tokens']} new tokens, this run decodes {cfg['max_new_tokens']}"
    if list(cfg.get("stop_token_ids") or []) != list(st["stop_token_ids"]):
        return "the floor was measured with other stop tokens"
    return None


def prompts_of(floor_data: dict, n: int) -> list[list[int]]:
    """The prompts the floor was measured on (the first ``n``): verify runs on them."""
    return [p["ids"] for p in floor_data["prompts"][:n]]


# ----------------------------------------------------------------------------- what the check judges (acceptance_verdict)
def judged_rounds(acceptance: list[int], horizon: int) -> list[int]:
    """The rounds of a decode that start before ``horizon`` new tokens (a round's start: the new tokens committed
    before it, the prefill's one not counted): the rounds every tree runs on a whole block."""
    s, out = 0, []
    for a in acceptance:
        if s >= horizon:
            break
        out.append(a)
        s += a
    return out


def horizon_of(n: int, block_size: int) -> int:
    """Rounds that start at least one block before the end of ``n`` new tokens are judged: a tree may shorten the
    rounds after (upstream DFlash: ``verify_size = min(block_size, max_length - start)``; DDTree's output buffer
    holds ``max_length + 1 + budget`` tokens, so a budget + 1 below the block size cuts its last rounds)."""
    return max(0, n - block_size)
