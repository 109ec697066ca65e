"""Hand edits of a hybrid cache's linear-attention (Gated DeltaNet) state, for ``cache_surgery``: named, never rewritten.

Forks snapshot and restore the recurrent layers by hand around a verify: ``saved = layer.conv_states.clone()``, later
``layer.conv_states.copy_(saved)``, ``cache.recurrent_states[i] = state``. On transformers 5.x each linear-attention
layer keeps its states in a dict keyed by state index (``layer.conv_states[0]``), beside ``has_previous_state`` and
past recording; 5.25's ``LinearAttentionCacheLayerMixin`` says so. So a tensor method on the store itself
(``.clone()``, ``.copy_()``, ``.zero_()``) raises ``'dict' object has no attribute ...``, and a cache object
(``DynamicCache``) has no ``conv_states`` at all (4.x's hybrid caches held one list per model). The runtime has
no operation that takes such a snapshot's place one for one: what makes the rollback exact is ``verify_forward``
(it records the state a verify passes through) and ``crop_cache`` / ``compact_cache`` (they commit exactly the
accepted tokens), which replace the whole save-and-restore, not a line of it. So each edit is a ``no-match`` site
with its line, why it breaks (where it does) and that way forward. Reads (``layer.conv_states[0]``, a dict
comprehension over ``.items()``) are not edits and are not named.
"""

from __future__ import annotations

import libcst as cst

from .base import NO_MATCH, code, dotted

STATE = ("conv_states", "recurrent_states")
#: a dict's own methods: calling one on the store is no tensor method (``saved = dict(layer.conv_states.items())``)
DICT_METHODS = frozenset({"items", "keys", "values", "get", "setdefault", "update", "pop", "clear", "copy", "fromkeys",
                          "popitem", "__getitem__", "__setitem__"})
WAY = ("drop the hand save and restore: route the verify through `_ddpatch_runtime.verify_forward` and cut the cache with "
       "`_ddpatch_runtime.crop_cache(cache, n)` (keep n tokens) or `compact_cache` (keep tree nodes), which commit exactly "
       "the accepted tokens' conv and recurrent state; then prove the tree with `ddpatch verify`")


def _store(expr: cst.BaseExpression) -> cst.Attribute | None:
    """``X.conv_states`` / ``X.recurrent_states`` that ``expr`` is or is read from by subscripts (``X.conv_states[i][j]``),
    never one the object owns (``self.conv_states``, ``self.rg_lru.recurrent_states``: a cache layer's or a model's own
    code, transformers' or a copy of it, as RecurrentGemma's ``_setup_cache`` sets up its own block's state)."""
    while isinstance(expr, cst.Subscript):
        expr = expr.value
    if isinstance(expr, cst.Attribute) and expr.attr.value in STATE:
        root = (dotted(expr.value) or "").split(".")[0]
        if root not in ("self", "cls"):
            return expr
    return None


def _owner(store: cst.Attribute, cache_like) -> str:
    if cache_like(store.value):
        return (f" on `{code(store.value)}`, a cache: transformers 5.x caches keep the state per layer "
                f"(`{code(store.value)}.layers[i].{store.attr.value}`, a dict keyed by state index), so "
                f"`{code(store.value)}.{store.attr.value}` is an AttributeError there")
    return ""


def state_call(node: cst.Call, cache_like) -> str | None:
    """Why the call ``node`` is a hand edit of linear-attention state (its message), or None."""
    func = node.func
    if not isinstance(func, cst.Attribute):
        return None
    method = func.attr.value
    store = _store(func.value)
    if store is None or method in DICT_METHODS:
        return None
    what = f"`{_short(code(node))}`"
    if store is func.value:  # a tensor method on the dict itself
        return (f"{what} calls a tensor method on a linear-attention layer's `{store.attr.value}`{_owner(store, cache_like)}; "
                f"on transformers 5.25 it is a dict keyed by state index ('dict' object has no attribute '{method}'); {WAY}")
    if not (method.endswith("_") and not method.startswith("_")):
        return None  # `layer.conv_states[0].clone()`: a read of one state
    return (f"{what} writes the Gated DeltaNet state by hand{_owner(store, cache_like)}: ddpatch cannot prove a hand "
            f"restore exact (the layer's `has_previous_state` and past recording stay as the verify left them); {WAY}")


def state_target(target: cst.BaseExpression, cache_like) -> str | None:
    """Why assigning to ``target`` (``X.conv_states[i] = ...``, ``X.recurrent_states = ...``) is a hand edit of
    linear-attention state (its message), or None."""
    store = _store(target)
    if store is None:
        return None
    return (f"`{_short(code(target))} = ...` writes the Gated DeltaNet state by hand{_owner(store, cache_like)}: ddpatch "
            f"cannot prove a hand restore exact (on transformers 5.x the store is a dict keyed by state index, with "
            f"`has_previous_state` and past recording beside it); {WAY}")


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 90 else text[:87] + "..."


class StateEdits:
    """``CacheSurgery``'s hooks for these edits (it has ``function``, ``_cache_like``, ``_flag``, ``_said``, ``record``)."""

    def state_call(self, node: cst.Call) -> bool:
        return self._state(node, state_call(node, self._cache_like) if self.function != "forward" else None)

    def state_target(self, target: cst.BaseExpression, stmt: cst.CSTNode) -> bool:
        return self._state(stmt, state_target(target, self._cache_like) if self.function != "forward" else None)

    def _state(self, node: cst.CSTNode, message: str | None) -> bool:
        """A no-match at the edit's own line (with the flag it runs under); whether ``node`` is such an edit."""
        if message is None:
            return False
        if id(node) not in self._said:
            self._said.add(id(node))
            self.record(node, NO_MATCH, message + self._flag(node))
        return True
