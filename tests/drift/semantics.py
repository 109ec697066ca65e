"""Run an *unpatched* variant in process, to show that a transform kept what the code does.

On a pure-attention target (``tiny-qwen3``) the unpatched code is lossless once the things
that have nothing to do with drift are shimmed: ``DynamicCache.crop`` accepts a 4.x length,
``torch.cuda.synchronize`` and ``reset_peak_memory_stats`` are no-ops, ``torch.cuda.Event`` times on the host
clock (the runtime's own stand-in), ``datasets`` is a stub, and 4.x's legacy cache API
(``to_legacy_cache`` / ``from_legacy_cache``, gone in 5.0) is back, as 4.57 had it. A variant whose unpatched
code does not reproduce the target's greedy decoding there was broken by its transform, and a
failing ``verify`` of its patched copy would say nothing about ddpatch.

The decoders are called positionally (every variant keeps the parameter order of its
vendored layout), so renamed parameters need no special case here.
"""

from __future__ import annotations

import importlib
import sys
import types
from contextlib import contextmanager
from pathlib import Path

from patcher.runtime.timing import WallClockEvent

GENERIC_MODULES = ("model", "dflash", "ddtree", "benchmark")
PROMPT_LEN = 8
NEW_TOKENS = 16
BLOCK = 4
BUDGET = 6


def _crop_accepting_lengths(original):
    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # a 4.x length: keep that many tokens
            tokens_to_remove = min(0, tokens_to_remove - self.get_seq_length())
        original(self, tokens_to_remove)

    return crop


def _from_legacy(cls, past_key_values):
    cache = cls()
    for layer_idx, (keys, values) in enumerate(past_key_values or ()):
        cache.update(keys, values, layer_idx)
    return cache


def _no_dataset(*args, **kwargs):
    raise RuntimeError("the drift suite never loads a dataset")


@contextmanager
def shims_and_tree(root: Path):
    """Import from ``root`` as if it were the working directory, with the three shims; undo all on exit."""
    import torch
    from transformers import DynamicCache

    saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] in GENERIC_MODULES}
    for name in saved:
        del sys.modules[name]
    fake = types.ModuleType("datasets")
    fake.load_dataset = _no_dataset
    old_datasets = sys.modules.get("datasets")
    old_sync, old_crop = torch.cuda.synchronize, DynamicCache.crop
    old_event, old_reset = torch.cuda.Event, torch.cuda.reset_peak_memory_stats
    sys.modules["datasets"] = fake
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Event, torch.cuda.reset_peak_memory_stats = WallClockEvent, lambda device=None: None
    DynamicCache.crop = _crop_accepting_lengths(old_crop)
    legacy = {name: DynamicCache.__dict__.get(name) for name in ("to_legacy_cache", "from_legacy_cache")}
    DynamicCache.to_legacy_cache = lambda self: tuple((layer.keys, layer.values) for layer in self.layers)
    DynamicCache.from_legacy_cache = classmethod(_from_legacy)
    sys.path.insert(0, str(root))
    bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # the copy is also apply's source: leave nothing in it
    try:
        yield
    finally:
        sys.dont_write_bytecode = bytecode
        sys.path.remove(str(root))
        DynamicCache.crop, torch.cuda.synchronize = old_crop, old_sync
        torch.cuda.Event, torch.cuda.reset_peak_memory_stats = old_event, old_reset
        for name, value in legacy.items():
            if value is None:
                delattr(DynamicCache, name)
            else:
                setattr(DynamicCache, name, value)
        if old_datasets is None:
            sys.modules.pop("datasets", None)
        else:
            sys.modules["datasets"] = old_datasets
        for name in [n for n in sys.modules if n.split(".")[0] in GENERIC_MODULES]:
            del sys.modules[name]
        sys.modules.update(saved)


def _greedy(target, prompt, steps: int) -> list[int]:
    import torch

    ids = prompt
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0].tolist()


def _new_ids(result, prompt_len: int) -> list[int]:
    ids = result.output_ids if hasattr(result, "output_ids") else result
    return [int(x) for x in ids[0, prompt_len:].tolist()]


def decode_unpatched(root: Path, base: str, seed: int = 0) -> dict[str, tuple[list[int], list[int]]]:
    """``{method: (expected, got)}`` for the unpatched tree at ``root`` on tiny-qwen3 with a scripted draft."""
    import torch

    from patcher.verify.models.script import ScriptedDraft
    from patcher.verify.models.presets import MASK_TOKEN_ID, build_target, draft_config

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with shims_and_tree(root):
            if base == "ddtree":
                dflash_mod, ddtree_mod = importlib.import_module("dflash"), importlib.import_module("ddtree")
                draft_cls = importlib.import_module("model").DFlashDraftModel
            else:
                dflash_mod, ddtree_mod = importlib.import_module("dflash.model"), None
                draft_cls = dflash_mod.DFlashDraftModel
            target = build_target("tiny-qwen3", seed=seed)
            torch.manual_seed(seed + 1)
            cfg = draft_config(target, draft_cls.config_class, num_layers=2, block_size=BLOCK, sliding_window=16)
            draft = draft_cls(cfg).eval()
            gen = torch.Generator().manual_seed(1000 + seed)
            prompt = torch.randint(0, MASK_TOKEN_ID, (1, PROMPT_LEN), generator=gen)
            reference = _greedy(target, prompt, NEW_TOKENS + BUDGET + BLOCK)
            expected = reference[PROMPT_LEN : PROMPT_LEN + NEW_TOKENS]
            runs = {}

            def scripted(name, call):
                hook = ScriptedDraft(target, reference, seed=seed, forbidden=[MASK_TOKEN_ID]).attach(draft)
                try:
                    runs[name] = (expected, _new_ids(call(), PROMPT_LEN))
                finally:
                    hook.remove()

            if base == "ddtree":
                args = (draft, target, prompt, MASK_TOKEN_ID, NEW_TOKENS, BLOCK, None, 0.0)
                scripted("dflash", lambda: dflash_mod.dflash_generate(*args))
                scripted("ddtree", lambda: ddtree_mod.ddtree_generate(*args, BUDGET))
            else:
                args = (draft, target, prompt, NEW_TOKENS, None, 0.0, BLOCK, MASK_TOKEN_ID)
                scripted("dflash", lambda: dflash_mod.dflash_generate(*args))
                # a drafter subclass the tree defines (DFlash2) has a decode path of its own: run it too
                for sub in _subclasses(dflash_mod, draft_cls):
                    torch.manual_seed(seed + 1)
                    draft = sub(draft_config(target, sub.config_class, num_layers=2, block_size=BLOCK, sliding_window=16)).eval()
                    args = (draft, target, prompt, NEW_TOKENS, None, 0.0, BLOCK, MASK_TOKEN_ID)
                    scripted(f"dflash:{sub.__name__}", lambda args=args: dflash_mod.dflash_generate(*args))
            return runs
    finally:
        torch.set_num_threads(before)


def _subclasses(module, base: type) -> list[type]:
    """The classes ``module`` defines that derive from ``base`` (DFlash2's drafter derives from DFlash's)."""
    return [c for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, base) and c is not base and c.__module__ == module.__name__]


def load_draft_class(root: Path, base: str):
    """The tree's own ``DFlashDraftModel`` class, imported from ``root`` and then forgotten by sys.modules."""
    with shims_and_tree(root):
        module = importlib.import_module("model" if base == "ddtree" else "dflash.model")
        return module.DFlashDraftModel
