"""What a correct DFlash (and DDTree at each budget) reaches with the pair, on the prompts the engine decoded.

ddpatch's from-scratch reference decoders (``patcher.verify.judge.acceptance.pair_reference``): per prompt, the target's
greedy continuation, then at every round start the acceptance of the from-scratch decoder and the set a drafter
within epsilon of it could reach. An engine decodes in another library and precision than torch does, so its
drafter may sit further from ours than the verifier's epsilon: the referee widens epsilon by ``ENGINE_EPSILON``.

Each round is counted the way serving engines count it, so that the two figures are one definition (mean tokens
a verification round commits, the bonus included): a round never decides past the tokens asked for, and its
draft is shortened to the tokens left minus one (llama.cpp's ``n_draft`` clamp); a step with no draft left is a
plain decode, not a round. Torch and transformers are imported here, inside functions only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The engine's drafter sits further from ddpatch's torch drafter than two torch runs do (another library, other
#: kernels, a GGUF's precision): epsilon (the verifier's, from the drafter oracle's tolerance) times this.
ENGINE_EPSILON = 8.0


@dataclass
class PromptReference:
    ids: list[int]
    greedy: list[int]  # the target's greedy continuation (stops at a stop token)
    stop_at: int | None
    methods: dict = field(default_factory=dict)  # method -> {"at": [...], "reachable": [[...], ...]}
    kind: str = "dflash"  # the drafter's kind: its chain is ``methods[kind]`` (DFlash2, DSpark: no ``ddtree_tbB``)

    @property
    def chain(self) -> dict:
        return self.methods[self.kind]


def engine_accepted_range(reachable: list[list[int]], n: int, stop_at: int | None = None) -> tuple[int, int] | None:
    """(fewest, most) draft tokens a decode whose round at ``s`` commits one of ``reachable[s]`` accepts in all, counted as
    the one reference walk counts with ``engine=True`` (``verify/judge/acceptance/reference_decode.walk``) (a round commits its accepted drafts and one token of the target's, so it accepts one less
    than it commits). What an engine whose rounds are derived but whose accepted tokens are counted is judged by: with
    the tokens fixed, more accepted means fewer rounds, so this range says what the floor and ceiling say, exactly.
    None: no round at all."""
    low: dict[int, int] = {}
    high: dict[int, int] = {}
    for s in range(n - 1, -1, -1):
        left = n - 1 - s
        if left < 2:
            low[s] = high[s] = 0
            continue
        lo = hi = None
        for c in {min(x, left) for x in reachable[s]}:
            ends = stop_at is not None and s < stop_at <= s + c
            a, b = (c - 1, c - 1) if ends else (c - 1 + low[s + c], c - 1 + high[s + c])
            lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
        low[s], high[s] = lo, hi
    if n - 1 < 2:
        return None
    return low[0], high[0]


def load_pair(target_dir: str, draft_dir: str, dtype: str = "float32", drafter_class=None):
    """The pair as ddpatch's reference drives it: the target through transformers' auto class, the drafter through
    ``drafter_class`` (the shipped upstream-shaped DFlash by default: ``shipped_drafter_class``), offline, eval."""
    import torch

    from ..verify.models.load import bad_folder, load_target

    torch_dtype = getattr(torch, dtype)
    common = dict(dtype=torch_dtype, local_files_only=True)
    with bad_folder("--target", target_dir):
        target = load_target(target_dir, None, common).eval()
    cls = drafter_class or drafter_class_for(draft_dir)
    with bad_folder("--draft", draft_dir):
        draft = cls.from_pretrained(draft_dir, attn_implementation="sdpa", **common).eval()
    return target, draft


def drafter_class_for(draft_dir: str):
    """The class that loads ``draft_dir``'s drafter: ddpatch's own ``DFlash2DraftModel`` or ``DSparkDraftModel`` for a
    config of that kind (``drafter_kinds.kind_of``), else the shipped DFlash."""
    from ..verify.plumbing.drafter_kinds import kind_of_folder

    found = kind_of_folder(draft_dir)
    own = {"dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}
    if found is not None and found.kind in own:
        from ..verify.models.drafters import CLASSES

        return CLASSES[own[found.kind]]
    return shipped_drafter_class()


def _entry(pair, prompt, tokens, budgets, eps: float, hidden_eps: float, stop_ids) -> tuple[dict, str]:
    """(one prompt's entry, the drafter's kind): DFlash's chain and trees (``pair_reference``), or a DFlash2 or DSpark
    drafter's chain (``kind_reference``: a selector or a Markov head picks each token, so DFlash's argmax chain is not
    their reference)."""
    from ..verify.judge.kind_reference import kind_of_model, prompt_entry as kind_entry
    from ..verify.judge.acceptance.pair_reference import methods_for, prompt_entry

    kind = kind_of_model(pair.draft)
    if kind == "dflash":
        return prompt_entry(pair, prompt, tokens, methods_for(budgets), len(tokens), eps, stop_ids), kind
    return kind_entry(pair, kind, prompt, tokens, len(tokens), eps, stop_ids, hidden_eps=hidden_eps), kind


def shipped_drafter_class():
    """``DFlashDraftModel`` of the DFlash-shaped code ddpatch ships (``vendored/dflash``), imported under a private
    name so that it meets no ``dflash`` module of the caller's."""
    import importlib.util
    import sys

    from .. import shipped

    name = "_ddpatch_referee_dflash"
    if name not in sys.modules:
        folder = shipped("vendored") / "dflash" / "dflash"
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{name}.model").DFlashDraftModel


def references(target, draft, prompts: list[list[int]], max_new_tokens: int, budgets, stop_ids=(), progress=None) -> tuple[list, dict]:
    """(per prompt a ``PromptReference``, the epsilon used): the target's greedy continuations and, at every start, each
    method's from-scratch acceptance and reachable set (``dflash``, ``ddtree_tbB``; DFlash2, DSpark: their chain alone)."""
    import torch

    from ..verify.judge.acceptance.reference_decode import ScratchPair
    from ..verify.judge.drafter.recorder import calibrate
    from ..verify.judge.acceptance.pair_reference import epsilon_of
    from ..verify.models.load import greedy

    block = int(getattr(draft, "block_size", None) or draft.config.block_size)
    mask = int(draft.mask_token_id)
    conts = [greedy(target, torch.tensor([p]), max_new_tokens, tuple(stop_ids)) for p in prompts]
    cal = calibrate(target, draft, torch.tensor([prompts[0]]), conts[0], mask, block)
    eps = epsilon_of(target, cal.tolerances["output"] * ENGINE_EPSILON)
    eps["engine_factor"] = ENGINE_EPSILON
    pair = ScratchPair(target, draft, mask, block)
    out = []
    for i, (prompt, cont) in enumerate(zip(prompts, conts)):
        entry, kind = _entry(pair, prompt, cont, budgets, eps["logits"], eps["output_tolerance"], stop_ids)
        out.append(PromptReference(list(prompt), list(cont), entry["stop_at"], entry["methods"], kind))
        if progress is not None:
            progress(f"reference: prompt {i + 1}/{len(prompts)}")
    return out, {**eps, "block_size": block, "mask_token_id": mask}


def along(target, draft, prompt: list[int], tokens: list[int], budgets, epsilon: float, stop_ids=()) -> PromptReference:
    """The reference along the engine's own ``tokens`` (where they part from the target's greedy at a near-tie): at every
    start, what a correct DFlash (and DDTree) accepts when the committed sequence is the engine's. A proposal is
    accepted iff it equals the sequence's next token, so this is the acceptance of a correct decoder whose target took
    the engine's side of each tie."""
    from ..verify.judge.acceptance.reference_decode import ScratchPair, max_row_l1

    block = int(getattr(draft, "block_size", None) or draft.config.block_size)
    pair = ScratchPair(target, draft, int(draft.mask_token_id), block)
    hidden_eps = epsilon / max(max_row_l1(target.get_output_embeddings()), 1e-30)  # epsilon_of's rule, undone
    entry, kind = _entry(pair, prompt, tokens, budgets, epsilon, hidden_eps, stop_ids)
    return PromptReference(list(prompt), list(tokens), entry["stop_at"], entry["methods"], kind)
