"""What the decoder has committed so far, read from the target's forwards (hooks only read).

The scripted draft proposes the target's own next tokens. After a near-tie the decoder's path
parts from the greedy reference, and a script that kept following the reference would be
rejected every round: the rollback would no longer be exercised. ``DecodeContext`` follows the
decoder instead, at the token level: a chain forward feeds committed tokens at their positions
(later forwards overwrite rejected ones); of a tree forward (a 4D mask), the root is committed, and
under greedy decoding the accepted path is the chain of children that equal their parent's argmax.
The next block's first token (the round's bonus token, which no target forward has seen yet) is
read off the drafter's own input by the scripted draft (``script.py``); the context offers it the
candidates: the best tokens of the last logits row the target computed for that position.

It also counts how deep inside a target forward the process is (``depth``): a call of the target's
output head outside any target forward is the drafter's, and that is where the script writes.
"""

from __future__ import annotations

import inspect
import weakref

# class -> whether its forward takes the cache as ``cache=`` (transformers 5.24+)
_TAKES_CACHE: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()

#: How many of the best tokens of a logits row the context keeps as candidates for the next block's first token.
CANDIDATES = 32


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its cache under: ``cache`` on transformers 5.24+ (where
    ``past_key_values`` is deprecated, and gone in 5.40), ``past_key_values`` before, and for a forward
    that has no ``cache`` parameter (a drafter of its own). Decided once per class."""
    cls = type(model)
    try:
        return "cache" if _TAKES_CACHE[cls] else "past_key_values"
    except (KeyError, TypeError):
        pass
    try:
        found = "cache" in inspect.signature(getattr(cls, "forward", None)).parameters
    except (TypeError, ValueError):
        found = False
    try:
        _TAKES_CACHE[cls] = found
    except TypeError:
        pass
    return "cache" if found else "past_key_values"


def with_cache(model, cache) -> dict:
    """``{keyword: cache}`` for a call of ``model`` (``target(ids, **with_cache(target, cache), use_cache=True)``)."""
    return {cache_keyword(model): cache}


def passed_cache(kwargs: dict):
    """The cache a forward was given, under either keyword (``past_key_values=`` or 5.24+'s ``cache=``)."""
    cache = kwargs.get("past_key_values")
    return kwargs.get("cache") if cache is None else cache


def target_modules(target) -> list:
    """The target and its inner decoder (``get_decoder()``): a tree may run either, then the head itself."""
    found = [target]
    try:
        inner = target.get_decoder()
    except Exception:  # a model without the accessor
        inner = None
    if inner is not None and inner is not target:
        found.append(inner)
    return found


class DecodeContext:
    def __init__(self, target):
        self.target = target
        self.tokens: dict[int, int] = {}  # position -> committed token
        self.candidates: dict[int, list[int]] = {}  # position -> the best tokens the target's last row for it held
        self.depth = 0  # > 0 while a target forward runs
        self._handles = []

    def attach(self) -> "DecodeContext":
        for module in target_modules(self.target):
            self._handles += [module.register_forward_pre_hook(self._enter),
                              module.register_forward_hook(self._leave, always_call=True)]
        self._handles.append(self.target.register_forward_hook(self._after, with_kwargs=True))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _enter(self, module, args):
        self.depth += 1

    def _leave(self, module, args, output):
        self.depth -= 1

    def _after(self, module, args, kwargs, output):
        if passed_cache(kwargs) is None:  # not a decoding step
            return
        ids = args[0] if args else kwargs.get("input_ids")
        positions = kwargs.get("position_ids")
        if ids is None or positions is None or ids.dim() != 2:
            return
        ids = ids[0].tolist()
        positions = positions.reshape(-1, positions.shape[-1])[0, -len(ids):].tolist()
        logits = getattr(output, "logits", None)
        if logits is not None and logits.dim() == 3:
            kept = logits.shape[1]  # logits_to_keep: the rows align to the end
            best = logits[0].topk(min(CANDIDATES, logits.shape[-1]), dim=-1).indices.tolist()
            for i, row in zip(range(len(ids) - kept, len(ids)), best):
                if i >= 0:
                    self.candidates[positions[i] + 1] = row
        mask = kwargs.get("attention_mask")
        if mask is None or mask.dim() != 4:
            self.tokens.update(zip(positions, ids))
            return
        self.tokens[positions[0]] = ids[0]
        if logits is None or logits.shape[1] != len(ids):
            return
        q = len(ids)
        block = mask[0, 0, -q:, -q:]
        visible = (block == 0) if block.dtype.is_floating_point else block.bool()
        parent = {}
        for j in range(1, q):
            ancestors = [i for i in range(q) if i != j and bool(visible[j, i])]
            if ancestors:
                parent[j] = max(ancestors, key=lambda i: positions[i])
        node = 0
        while True:
            best = int(logits[0, node].argmax())
            child = next((j for j, p in parent.items() if p == node and ids[j] == best), None)
            if child is None:
                self.candidates[positions[node] + 1] = [best] + [t for t in self.candidates.get(positions[node] + 1, []) if t != best]
                return
            self.tokens[positions[child]] = ids[child]
            node = child

    def prefix(self, start: int, fallback: list[int]) -> list[int]:
        """The committed tokens at positions <= ``start`` (``start``: the draft block's first, committed token),
        the fallback where a position was not seen."""
        return [self.tokens.get(p, fallback[p] if p < len(fallback) else 0) for p in range(start + 1)]
