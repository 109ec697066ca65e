"""ddpatch runtime: lossless speculative-decoding verify/commit for hybrid Gated DeltaNet targets.

This file is copied verbatim into patched upstream trees (as ``_ddpatch_runtime.py``), so it
imports nothing but the standard library, ``torch`` and (lazily) ``transformers``.

The problem
-----------
Speculative decoding verifies several draft tokens in one target forward, then throws the
rejected ones away. For attention layers "throwing away" is a crop of the KV cache. A Gated
DeltaNet (GDN) layer instead keeps a fixed-size (conv, recurrent) state that has already
absorbed *every* verified token; nothing can be cropped out of it. On transformers 5.23:

* ``Cache.crop(n)`` with ``n > 0`` raises (it now takes a negative count of tokens to drop);
* ``LinearAttentionLayer.crop`` raises unless past recording is on, and even then only the
  conv state is rolled back, never the recurrent state;
* a 4D tree mask is never given to GDN layers, so a DDTree tree pushed through them as one
  flat sequence mixes sibling branches.

The fix (the upstream loops are rewritten to call these functions)
------------------------------------------------------------------
``verify_forward(model, ...)``
    Plain ``model(...)`` for a model without GDN layers (discovered once per model). For a
    hybrid model it leaves a *record* on the cache that a later commit uses:

    * chain (no 4D mask): snapshot each GDN layer's (conv, recurrent) state (cheap: fixed
      size), capture each GDN module's input with a forward pre-hook, run the forward as is.
    * tree (4D mask): attention layers see the flat tree with its mask, unchanged. Each GDN
      module's ``forward`` is swapped (instance attribute, restored in ``finally``) for one
      that runs every node after its ancestors only, on a scratch state, so the real GDN
      state is not touched during a tree verify. Two strategies are implemented:

      - ``"node"`` (node-recurrent): depth by depth, the nodes of one depth are a batch of
        single-token steps, each starting from its parent's (conv, recurrent) state. It costs
        (tree depth) module calls per layer and never pads.
      - ``"path"`` (path-batched): root-to-leaf paths become batch rows that all start from
        the shared pre-verify state; each node's output is taken from one path that holds
        it. One module call per layer on (#leaves x depth) tokens; the torch fallback pads
        every row to a 64-token chunk, so its cost grows with the number of leaves.

      Both use the module's own forward on a scratch state, so they work for Qwen3.5's split
      and Qwen3-Next's fused projections alike, and both are exact (tested). Measured on CPU
      with the torch fallback (``benchmarks/bench_rollback.py``): path-batched is faster for
      trees with few leaves per depth, node-recurrent for bushy ones, and neither is always
      faster. ``TREE_STRATEGY = "auto"`` (the default) picks path-batched when
      leaves <= 1.5 x depth, and always on CUDA, where the fla chunk kernel handles the
      extra rows in one launch while node-recurrent pays (depth) launch-bound calls per
      layer (that GPU choice is reasoned, not measured yet).

``crop_cache(cache, length)`` / ``compact_cache(...)`` / ``@tree_commit(...)``
    Commit the recorded verify. For a chain the commit restores the snapshot and re-runs
    only the GDN modules on the kept prefix of their captured inputs: exact, because kept
    tokens never depend on dropped ones, and free when every token was kept. For a tree the
    commit re-runs the GDN modules on the accepted root-to-node path's captured inputs from
    the (untouched) real state. Attention KV is cropped/compacted as usual.

Gated DeltaNet fast path (its own section below): where the GDN module calls its modeling
file's kernel functions by name (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Olmo-Hybrid, Qwen4-Exp),
those functions are wrapped for the duration of a verify instead. A chain commit then replays
only the delta rule over the kept prefix from captured kernel inputs (no projection is re-run),
and a tree runs each GDN module ONCE over the flat tree: conv windows gathered from ancestors,
the delta rule in one chunk with an ancestor mask (``TREE_STRATEGY`` "auto" / "onepass"). The
strategies above stay the fallback for every other layout.

The commit belongs to the cache: ``verify_forward`` also makes the recorded cache's own
``crop`` (and its linear layers' ``crop``) commit the record, so a native 5.x
``cache.crop(-n)`` in a helper of any shape is exact too. A cache cut back without a commit,
or a tree verify cut back without its accepted path, raises ``RuntimeError``: the state can
no longer be made exact, and decoding on would be silently lossy.

Without any record (the target never went through ``verify_forward``), a crop that drops
tokens from a cache with GDN layers cannot be exact: it leaves the GDN layers as they are and
warns once per cache.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = [
    "TREE_STRATEGY",
    "UnsupportedModelError",
    "compact_cache",
    "crop_cache",
    "draft_forward",
    "hybrid_linear_modules",
    "tree_commit",
    "tree_parents_from_mask",
    "verify_forward",
]

#: How a tree verify runs the GDN layers: "auto" (default: "onepass" where the module's layout
#: allows it, see "Gated DeltaNet fast path"), "onepass", "node" (node-recurrent) or "path" (path-batched).
TREE_STRATEGY = "auto"

# Attribute names this module sets on cache objects. A record travels with the cache it
# describes, so several concurrent generations never see each other's records.
_RECORD_ATTR = "_ddpatch_record"
_WARNED_ATTR = "_ddpatch_warned"

_NO_STATE_WARNING = (
    "ddpatch: tokens were cropped from a cache with Gated DeltaNet (linear attention) layers, "
    "but no verify was recorded for it (call the target through verify_forward), so the Gated "
    "DeltaNet state was not rolled back and the output may diverge from the target's own decoding."
)


# --------------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------------

# model -> tuple of (layer_idx, stateful mixer); an empty tuple for a model without such layers.
_MODEL_INFO: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()
# mixer -> the keyword its forward takes the cache under ("cache_params" or "past_key_values")
_CACHE_KEYWORD: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_CACHE_KEYWORDS = ("cache_params", "past_key_values")


class UnsupportedModelError(RuntimeError):
    """A target whose state ddpatch cannot roll back or verify exactly; the message says why, in one line."""


def _text_config(model):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return config


def _model_type(model) -> str:
    config = _text_config(model)
    return str(getattr(config, "model_type", None) or type(model).__name__)


def _layer_kinds(config) -> list:
    """Per layer: "state" (a recurrent/conv state a crop cannot undo), "keys" (per-token keys and
    values only: crop and compaction handle it), or the class name of a cache layer this runtime
    does not know. Read from what the cache would be built from: the config's ``layer_types``
    and transformers' own layer-type -> cache-layer mapping."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    if not layer_types:
        return []
    try:
        from transformers import cache_utils
    except ImportError:  # no transformers: judge by the names 5.x uses
        stateful = {"linear_attention", "conv", "hybrid", "hybrid_sliding"}
        return ["state" if t in stateful else "keys" for t in layer_types]
    mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", {})
    linear = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
    keyed = tuple(
        getattr(cache_utils, name)
        for name in ("DynamicLayer", "DynamicSlidingWindowLayer", "DynamicIndexedLayer", "DummyLayer")
        if hasattr(cache_utils, name)
    )
    kinds = []
    for kind in layer_types:
        if kind in ("moe", "mlp"):  # transformers turns these into DummyLayer
            kinds.append("keys")
            continue
        cls = mapping.get(kind)
        if cls is None:
            kinds.append(f"layer type {kind!r}")
        elif linear and issubclass(cls, linear):
            kinds.append("state")
        elif cls in keyed:
            kinds.append("keys")
        else:
            kinds.append(f"{cls.__name__} ({kind!r})")
    return kinds


def _cache_keyword(module) -> str | None:
    forward = getattr(type(module), "forward", None)
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in _CACHE_KEYWORDS if k in parameters), None)


_STATE_WRITERS: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()
_STATE_UPDATES = ("update_conv_state", "update_recurrent_state")


def _writes_state(module) -> bool:
    """Whether the module's class has code that updates a conv/recurrent cache state (read
    from the bytecode of its own methods, so attention modules, which only ``update`` keys and
    values, are told apart from Mamba, short-conv and linear-attention mixers)."""
    cls = type(module)
    try:
        return _STATE_WRITERS[cls]
    except KeyError:
        pass
    found = False
    for klass in cls.__mro__:
        if klass is torch.nn.Module or klass is object:
            continue
        for value in vars(klass).values():
            code = getattr(inspect.unwrap(value), "__code__", None) if callable(value) else None
            if code is not None and any(name in code.co_names for name in _STATE_UPDATES):
                found = True
                break
        if found:
            break
    _STATE_WRITERS[cls] = found
    return found


def _state_mixer(model, layer_idx: int, candidates: list):
    """The one module of layer ``layer_idx`` that reads and writes its recurrent/conv state.

    ``candidates`` are the innermost modules of that layer that take a cache; the owner is the
    one whose code updates a conv/recurrent state (in a hybrid layer, Mamba next to attention).
    """
    writers = [m for m in candidates if _writes_state(m)]
    if len(writers) == 1:
        return writers[0]
    names = ", ".join(sorted(type(m).__name__ for m in candidates)) or "none"
    raise UnsupportedModelError(
        f"ddpatch: {_model_type(model)} layer {layer_idx} keeps a recurrent/conv state, but ddpatch finds "
        f"{'no' if not writers else 'more than one'} module there that updates it (modules that take the "
        f"cache: {names}); its rollback is not supported"
    )


def hybrid_linear_modules(model) -> tuple:
    """``((layer_idx, stateful_mixer), ...)`` of ``model`` in layer order; empty without such layers.

    Which layers are stateful is read from what the cache says: the text config's
    ``layer_types`` mapped through transformers' own cache-layer classes (every layer type
    whose cache layer is a ``LinearAttentionCacheLayerMixin``: linear attention, short conv,
    Mamba, hybrid). The mixer of such a layer is the innermost module with that ``layer_idx``
    whose forward takes the cache (``cache_params=`` or ``past_key_values=``), whatever its
    attribute is called (``linear_attn``, ``self_attn``, ``mixer``, ``mamba``, ``conv``). A
    layer type without a known cache layer, or a stateful layer without exactly one owner,
    raises ``UnsupportedModelError``: guessing would make the output lossy.
    """
    try:
        return _MODEL_INFO[model]
    except (KeyError, TypeError):
        pass
    config = _text_config(model)
    kinds = _layer_kinds(config) if config is not None else []
    unknown = [(i, kind) for i, kind in enumerate(kinds) if kind not in ("state", "keys")]
    if unknown:
        i, kind = unknown[0]
        raise UnsupportedModelError(
            f"ddpatch: {_model_type(model)} layer {i} uses {kind}, a cache layer ddpatch cannot roll back "
            "or compact; this model is not supported"
        )
    stateful = {i for i, kind in enumerate(kinds) if kind == "state"}
    info: tuple = ()
    if stateful:
        by_layer: dict[int, list] = {i: [] for i in stateful}
        for module in model.modules():
            idx = getattr(module, "layer_idx", None)
            if isinstance(idx, int) and idx in by_layer and _cache_keyword(module):
                _CACHE_KEYWORD[module] = _cache_keyword(module)
                by_layer[idx].append(module)
        for idx, found in by_layer.items():
            # innermost only: a decoder layer that passes the cache on to its mixer is not the owner
            by_layer[idx] = [m for m in found if not any(o is not m and any(o is d for d in m.modules()) for o in found)]
        info = tuple(sorted((i, _state_mixer(model, i, by_layer[i])) for i in stateful))
    try:
        _MODEL_INFO[model] = info
    except TypeError:  # not weak-referenceable: just don't cache
        pass
    return info


def _cache_kwargs(module, cache) -> dict:
    """``{keyword: cache}`` the way ``module`` takes its cache (LFM2's short conv: ``past_key_values``)."""
    return {_CACHE_KEYWORD.get(module) or _cache_keyword(module) or "cache_params": cache}


def _keyword_adapted(make: Callable) -> Callable:
    """A tree-forward builder for mixers that take the cache under another keyword.

    The builders call ``original(hidden, cache_params=scratch, ...)`` and are called with
    ``cache_params=``; for a ``past_key_values=`` mixer both ends are renamed here."""

    @functools.wraps(make)
    def build(original: Callable, module, *rest):
        keyword = _CACHE_KEYWORD.get(module) or _cache_keyword(module)
        if keyword in (None, "cache_params"):
            return make(original, module, *rest)

        def inner(hidden_states, *args, cache_params=None, **kwargs):
            return original(hidden_states, *args, **{keyword: cache_params}, **kwargs)

        forward = make(inner, module, *rest)

        def outer(hidden_states, *args, **kwargs):
            if keyword in kwargs:
                kwargs["cache_params"] = kwargs.pop(keyword)
            return forward(hidden_states, *args, **kwargs)

        return outer

    return build


# --------------------------------------------------------------------------------------------
# Window-limited (sliding) and indexed attention layers
# --------------------------------------------------------------------------------------------
#
# A sliding-window cache layer (gpt-oss) keeps only its last ``window - 1`` keys, so after the
# window is crossed (1) transformers refuses to crop it unless past recording is on, (2) a
# custom 4D tree mask, which transformers hands to every layer as is, is wider than the keys
# the layer returns and is never windowed, and (3) its verify rows do not sit at
# ``past_length + i``, where upstream compaction looks for them. An indexed-attention layer
# (GLM-5's DSA, Qwen4-Exp) also keeps indexer keys per token, which upstream compaction does not
# move. The functions below handle each layer by what its cache layer is, whatever the model.


def _is_window_layer(layer) -> bool:
    return bool(getattr(layer, "is_sliding", False)) and isinstance(getattr(layer, "sliding_window", None), int)


def _is_indexed_layer(layer) -> bool:
    return isinstance(getattr(layer, "indexer_keys", None), torch.Tensor)


def _record_window_past(cache) -> None:
    """Sliding layers keep a verify's keys until the crop that commits it (5.x's past recording)."""
    for layer in _layers(cache) or ():
        if _is_window_layer(layer) and not getattr(layer, "record_past", True):
            layer.activate_past_recording()


def _windowed_tree_mask(mask: torch.Tensor, window: int, kwargs: dict) -> torch.Tensor:
    """The 4D tree ``mask`` as a sliding layer must see it: cut to the keys the layer returns
    (its last ``window - 1`` prefix keys, then the verify's) and windowed (a query at position
    q sees a key at k when ``q - k < window``)."""
    L = mask.shape[-2]
    past = mask.shape[-1] - L
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor):
        q_pos = positions.reshape(-1, positions.shape[-1])[0, -L:].to(mask.device)
    else:
        q_pos = torch.arange(past, past + L, device=mask.device)
    held = min(past, window - 1)
    k_pos = torch.cat([torch.arange(past - held, past, device=mask.device), q_pos])
    too_far = (q_pos[:, None] - k_pos[None, :]) >= window
    part = mask[..., past - held :]
    if part.dtype == torch.bool:
        return part & ~too_far
    return part.masked_fill(too_far, torch.finfo(part.dtype).min)


def _windowed_mask_forwards(model, cache, mask: torch.Tensor, kwargs: dict) -> list:
    """Forward replacements that give each attention module of a sliding cache layer its
    windowed tree mask. transformers hands a custom 4D mask to every layer as is, full width
    and unwindowed, while a sliding layer returns window-limited keys."""
    layers = _layers(cache)
    if layers is None:
        return []
    windows = {i: layer.sliding_window for i, layer in enumerate(layers) if _is_window_layer(layer)}
    if not windows:
        return []
    layer_types = list(getattr(_text_config(model), "layer_types", None) or [])
    chunked = [i for i in windows if i < len(layer_types) and layer_types[i] == "chunked_attention"]
    if chunked:  # same cache layer as a sliding one, but the mask follows chunk boundaries, not a window
        raise UnsupportedModelError(
            f"ddpatch: {_model_type(model)} layer {chunked[0]} uses chunked attention; ddpatch cannot build its "
            "tree mask, so a tree verify cannot be exact on it; use a chain (DFlash) verify"
        )
    found: dict[int, list] = {i: [] for i in windows}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and idx in found and _cache_keyword(module) == "past_key_values":
            try:
                if "attention_mask" in inspect.signature(type(module).forward).parameters:
                    found[idx].append(module)
            except (TypeError, ValueError):
                continue
    masks: dict[int, torch.Tensor] = {}
    replacements = []
    for idx, modules in found.items():
        inner = [m for m in modules if not any(o is not m and any(o is d for d in m.modules()) for o in modules)]
        if not inner:
            raise UnsupportedModelError(
                f"ddpatch: {_model_type(model)} layer {idx} has a sliding-window cache but no attention module "
                "ddpatch can give a windowed tree mask"
            )
        window = windows[idx]
        if window not in masks:
            masks[window] = _windowed_tree_mask(mask, window, kwargs)
        for module in inner:
            replacements.append((module, _with_mask(module.forward, masks[window])))
    return replacements


def _with_mask(original: Callable, windowed: torch.Tensor) -> Callable:
    signature = inspect.signature(original)

    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["attention_mask"] = windowed
        return original(*bound.args, **bound.kwargs)

    return forward


# --------------------------------------------------------------------------------------------
# Models that cannot be served exactly: found by probing, refused in one line
# --------------------------------------------------------------------------------------------

_MASK_PROBED: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _check_mask_honoured(model, mask: torch.Tensor) -> None:
    """Refuse a model that ignores a custom 4D attention mask: no tree verify can be exact on it.

    Probed once per model, on three tokens without a cache: hiding the first two tokens from
    the third must change the third's logits. A model with no attention layer is not probed.
    """
    try:
        if _MASK_PROBED[model]:
            return
    except (KeyError, TypeError):
        pass
    config = _text_config(model)
    kinds = _layer_kinds(config) if config is not None else []
    if kinds and all(kind == "state" for kind in kinds):
        return
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else mask.device
    dtype = mask.dtype if mask.dtype != torch.bool else (param.dtype if param is not None else torch.float32)
    vocab = int(getattr(config, "vocab_size", 3) or 3)
    ids = torch.tensor([[1 % vocab, 2 % vocab, 3 % vocab]], device=device)
    low = torch.finfo(dtype).min if dtype.is_floating_point else 0
    causal = torch.full((3, 3), low, dtype=dtype, device=device).triu(1)
    alone = torch.full((3, 3), low, dtype=dtype, device=device)
    alone.fill_diagonal_(0)
    alone[1, 0] = 0
    with torch.no_grad():
        seen = model(ids, attention_mask=causal[None, None], use_cache=False).logits[0, -1]
        hidden = model(ids, attention_mask=alone[None, None], use_cache=False).logits[0, -1]
    # Logits pinned at the dtype's minimum (suppressed vocabulary entries) carry no signal and
    # would swamp a tolerance scaled by the largest magnitude: compare only the others.
    floor = torch.finfo(seen.dtype).min / 2 if seen.dtype.is_floating_point else float("-inf")
    seen, hidden = seen.float(), hidden.float()
    live_seen = torch.isfinite(seen) & (seen > floor)
    live_hidden = torch.isfinite(hidden) & (hidden > floor)
    live = live_seen & live_hidden
    scale = float(seen[live].abs().max()) if bool(live.any()) else 1.0
    diff = float((seen - hidden)[live].abs().max()) if bool(live.any()) else 0.0
    if torch.equal(live_seen, live_hidden) and diff <= 1e-6 * max(1.0, scale):
        raise UnsupportedModelError(
            f"ddpatch: {_model_type(model)} ignores a custom 4D attention mask (hiding earlier tokens did not "
            "change the logits), so a tree verify cannot be exact on it; use a chain (DFlash) verify"
        )
    try:
        _MASK_PROBED[model] = True
    except TypeError:
        pass


def _checked_hidden_states(model, output):
    """Refuse hidden states a DFlash draft cannot read: not ``[batch, tokens, hidden_size]``
    (e.g. 4D hyper-connection streams, or several streams concatenated)."""
    states = getattr(output, "hidden_states", None)
    if not states:
        return output
    size = getattr(_text_config(model), "hidden_size", None)
    for h in states:
        if isinstance(h, torch.Tensor) and (h.dim() != 3 or (size is not None and h.shape[-1] != size)):
            raise UnsupportedModelError(
                f"ddpatch: {_model_type(model)} returns hidden states of shape {tuple(h.shape)} for hidden size "
                f"{size} (hyper-connection streams?); a DFlash draft cannot read them as they are"
            )
    return output


def _check_draft_reads(model, kwargs: dict) -> None:
    """Refuse target features whose width the draft's input projection does not take."""
    features = kwargs.get("target_hidden")
    fc = getattr(model, "fc", None)
    if isinstance(features, torch.Tensor) and features.dim() != 3:
        raise UnsupportedModelError(
            f"ddpatch: the target's hidden states reach the draft as shape {tuple(features.shape)}, not "
            "[batch, tokens, features] (hyper-connection streams?); a DFlash draft cannot read them as they are"
        )
    if isinstance(features, torch.Tensor) and isinstance(fc, torch.nn.Linear) and features.shape[-1] != fc.in_features:
        raise UnsupportedModelError(
            f"ddpatch: the target's hidden states give {features.shape[-1]} features per token where the draft "
            f"reads {fc.in_features} (target hidden states of another width, e.g. hyper-connection streams); "
            "a DFlash draft cannot read them as they are"
        )


class _CompactedHere:
    """Stands in for a sliding layer during upstream's compaction: no keys (so any compaction
    skips it), a crop that does nothing, everything else read from the real layer."""

    keys = values = None

    def __init__(self, layer):
        self._layer = layer

    def crop(self, tokens_to_remove: int) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._layer, name)


def _compact_keyed_layers(cache, past_length: int, keep: list[int]) -> dict:
    """Compact what upstream's row arithmetic gets wrong: the indexer keys of indexed layers, and
    sliding layers, whose verify rows start at ``len(keys) - verify length``. Sliding layers are
    also cropped here; returns ``{layer index: layer}`` of those, for ``_hide_layers``."""
    done = {}
    for i, layer in enumerate(_layers(cache) or ()):
        if _is_indexed_layer(layer) and layer.indexer_keys.shape[1] > past_length:
            rows = torch.tensor(keep, dtype=torch.long, device=layer.indexer_keys.device) + past_length
            layer.indexer_keys[:, past_length : past_length + len(keep)] = layer.indexer_keys.index_select(1, rows)
        if not _is_window_layer(layer) or not isinstance(layer.keys, torch.Tensor) or layer.keys.dim() < 2:
            continue
        verify_len = int(layer.get_seq_length()) - int(past_length)
        if verify_len <= 0:
            continue
        start = layer.keys.shape[-2] - verify_len
        if keep:
            rows = torch.tensor(keep, dtype=torch.long, device=layer.keys.device) + start
            for store in (layer.keys, layer.values):
                store[..., start : start + len(keep), :] = store.index_select(-2, rows)
        if not getattr(layer, "record_past", False) and layer.get_seq_length() >= layer.sliding_window:
            raise RuntimeError(
                f"ddpatch: sliding-window layer {i} crossed its window without past recording; call the target "
                "through verify_forward so that the verify can be committed"
            )
        type(layer).crop(layer, -(verify_len - len(keep)))
        done[i] = layer
    return done


@contextlib.contextmanager
def _hide_layers(cache, layers: dict):
    """Put ``_CompactedHere`` stand-ins in place of ``layers`` for the duration."""
    try:
        for i, layer in layers.items():
            cache.layers[i] = _CompactedHere(layer)
        yield
    finally:
        for i, layer in layers.items():
            cache.layers[i] = layer


def _layers(cache):
    return getattr(cache, "layers", None)


def _is_linear_layer(layer) -> bool:
    # LinearAttentionCacheLayerMixin, duck-typed so this works across minor versions.
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


def _linear_layer_ids(cache) -> list[int]:
    layers = _layers(cache)
    if layers is None:
        return []
    return [i for i, layer in enumerate(layers) if _is_linear_layer(layer)]


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass
class _Snapshot:
    conv: dict
    recurrent: dict
    has_previous: dict


@dataclass
class _TreePlan:
    parents: list[int]
    depth: list[int]
    # path-batched layout
    path_index: torch.Tensor  # [P * D] node index per (path, step), padded with the path's last node
    node_slot: torch.Tensor  # [L] flat (path, step) slot holding each node
    n_paths: int
    path_len: int
    # node-recurrent layout, one entry per depth: (nodes, parent slot in the previous depth)
    levels: list[tuple[torch.Tensor, torch.Tensor]]
    inverse_order: torch.Tensor  # [L] position of each node in the depth-major concatenation


@dataclass
class _Record:
    mode: str  # "chain" or "tree"
    past_len: int  # attention length before the verify
    length: int  # tokens in the verify window
    modules: tuple  # ((layer_idx, gdn_module), ...)
    inputs: dict = field(default_factory=dict)  # layer_idx -> (hidden_states [B, L, H], 2D mask or None)
    snapshot: dict = field(default_factory=dict)  # layer_idx -> _Snapshot (chain only)
    plan: _TreePlan | None = None  # tree only
    settled: int | None = None  # after a commit: the length the GDN state now corresponds to
    fast: dict = field(default_factory=dict)  # layer_idx -> _FastCapture (the Gated DeltaNet fast path)


def _get_record(cache) -> _Record | None:
    return getattr(cache, _RECORD_ATTR, None)


def _set_record(cache, record: _Record | None) -> None:
    setattr(cache, _RECORD_ATTR, record)


def _pending_record(cache) -> _Record | None:
    """The cache's record if it still awaits a commit.

    A record whose cache no longer has the verify's length was cut back by something that
    did not commit it (a helper that sliced the key/value tensors itself, say): the recurrent
    state still holds the rejected tokens and nothing can make it exact any more, so this
    raises instead of letting the decoder continue on a wrong state.
    """
    record = _get_record(cache)
    if record is None or record.settled is not None:
        return None
    current = int(cache.get_seq_length())
    if current != record.past_len + record.length:
        _set_record(cache, None)
        raise RuntimeError(
            f"ddpatch: the target cache was cut back from {record.past_len + record.length} to {current} tokens "
            "without committing the recorded verify, so its recurrent (linear-attention) state still holds the "
            "rejected tokens; cut it back with cache.crop(-n), crop_cache, compact_cache or a @tree_commit function"
        )
    return record


def _warn_once(cache, message: str = _NO_STATE_WARNING) -> None:
    if getattr(cache, _WARNED_ATTR, False):
        return
    try:
        setattr(cache, _WARNED_ATTR, True)
    except AttributeError:
        pass
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _state_context(tensors):
    """no_grad, or inference_mode when the cache holds inference tensors (in-place writes to
    those are only legal inside inference mode)."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode()
    if any(t is not None and t.is_inference() for t in tensors):
        return torch.inference_mode()
    return torch.no_grad()


# --------------------------------------------------------------------------------------------
# Tree structure
# --------------------------------------------------------------------------------------------


def tree_parents_from_mask(attention_mask: torch.Tensor) -> list[int]:
    """Parents of the verify nodes from a 4D tree mask ``[1, 1, L, past + L]``.

    Visible is ``True`` for a bool mask, and "not a large negative" for an additive float mask.
    The parent of node ``i`` is the largest ``j < i`` it can see (the root, node 0, has -1).
    The mask must be exactly "prefix + ancestors + itself" for every node, else ValueError.
    """
    if attention_mask.dim() != 4 or attention_mask.shape[0] != 1:
        raise ValueError(f"ddpatch: a tree verify needs a [1, 1, L, past+L] mask, got {tuple(attention_mask.shape)}")
    L = attention_mask.shape[-2]
    window = attention_mask[0, 0, :, -L:]
    if window.dtype == torch.bool:
        visible = window
    else:
        visible = window > torch.finfo(window.dtype).min / 2
    visible = visible.to("cpu")
    idx = torch.arange(L)
    lower = idx[None, :] < idx[:, None]
    parents = torch.where(visible & lower, idx[None, :].expand(L, L), torch.full((L, L), -1)).amax(dim=1)
    parent_list = parents.tolist()
    eye = torch.eye(L, dtype=torch.bool)
    expected = eye.clone()
    for i in range(1, L):
        p = parent_list[i]
        if p < 0:
            raise ValueError(f"ddpatch: tree node {i} sees no earlier node; node 0 must be the root of every node")
        expected[i] |= expected[p]
    if not torch.equal(visible, expected):
        bad = int((visible != expected).any(dim=1).nonzero()[0])
        raise ValueError(
            f"ddpatch: the 4D mask is not a tree mask (node {bad} must see exactly its ancestors and itself)"
        )
    return parent_list


def _tree_plan(parents: list[int], device) -> _TreePlan:
    L = len(parents)
    depth = [0] * L
    children: list[list[int]] = [[] for _ in range(L)]
    for i in range(1, L):
        depth[i] = depth[parents[i]] + 1
        children[parents[i]].append(i)
    # Path-batched: one row per leaf, root first.
    leaves = [i for i in range(L) if not children[i]]
    paths = []
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    D = max(len(p) for p in paths)
    flat, slot = [], [0] * L
    for row, path in enumerate(paths):
        for step, node in enumerate(path):
            slot[node] = row * D + step  # any path holding the node gives the same output
        flat.extend(path + [path[-1]] * (D - len(path)))  # tail padding never reaches earlier steps
    # Node-recurrent: nodes grouped by depth; each refers to its parent's slot in the previous depth.
    by_depth: list[list[int]] = [[] for _ in range(max(depth) + 1)]
    for i in range(L):
        by_depth[depth[i]].append(i)
    position = {}
    levels = []
    order = []
    for d, nodes in enumerate(by_depth):
        parent_slots = [0] if d == 0 else [position[parents[i]] for i in nodes]
        position = {node: k for k, node in enumerate(nodes)}
        levels.append(
            (torch.tensor(nodes, device=device), torch.tensor(parent_slots, device=device))
        )
        order.extend(nodes)
    inverse = [0] * L
    for k, node in enumerate(order):
        inverse[node] = k
    return _TreePlan(
        parents=parents,
        depth=depth,
        path_index=torch.tensor(flat, device=device),
        node_slot=torch.tensor(slot, device=device),
        n_paths=len(paths),
        path_len=D,
        levels=levels,
        inverse_order=torch.tensor(inverse, device=device),
    )


# --------------------------------------------------------------------------------------------
# Scratch state for tree verify
# --------------------------------------------------------------------------------------------


class _ScratchState:
    """The slice of the Cache API a GDN module's forward uses, for one layer and a batch of rows.

    It holds batched (conv, recurrent) states that start from the real state (or from parent
    states) and never writes to the real cache. Semantics follow ``LinearAttentionLayer``
    without past recording: the conv state keeps the last ``kernel`` inputs.
    """

    def __init__(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None, kernel: int):
        self.conv = conv
        self.recurrent = recurrent
        self.kernel = kernel

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.conv

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.recurrent

    def is_recording_past(self, layer_idx=None):
        return False

    def has_previous_state(self, layer_idx=None, state_idx=None):
        return self.conv is not None

    def update_conv_state(self, conv_states, layer_idx=None, state_idx=0, conv_kernel_size=None, **kwargs):
        kernel = conv_kernel_size or self.kernel
        if self.conv is None:
            # Like a prefill: left zero padding is what the causal conv would see anyway.
            full = torch.nn.functional.pad(conv_states, (max(0, kernel - conv_states.shape[-1]), 0))
        else:
            full = torch.cat([self.conv, conv_states.to(self.conv.dtype)], dim=-1)
        self.conv = full[..., -kernel:].contiguous()
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx=None, state_idx=0, **kwargs):
        self.recurrent = recurrent_states
        return recurrent_states


def _real_state(cache, layer_idx: int, kernel: int):
    layer = cache.layers[layer_idx]
    if not layer.has_previous_state.get(0, False):
        return None, None
    conv = layer.conv_states[0]
    if conv is not None:
        conv = conv[..., -kernel:]  # with past recording the conv state holds more than the kernel
    return conv, layer.recurrent_states[0]


def _kernel_size(module, cache, layer_idx) -> int:
    kernel = getattr(module, "conv_kernel_size", None)
    if kernel is None:
        kernel = cache.layers[layer_idx].conv_kernel_size[0]
    return int(kernel)


def _path_batched_forward(original: Callable, module, layer_idx: int, cache, record: _Record):
    plan = record.plan

    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        record.inputs[layer_idx] = (hidden_states, None)
        kernel = _kernel_size(module, cache, layer_idx)
        conv, recurrent = _real_state(cache, layer_idx, kernel)
        P, D = plan.n_paths, plan.path_len
        # Copies, never views (not even for a single path): the kernels update the scratch
        # state in place, and the real state must stay as it was before the verify.
        if conv is not None:
            conv = conv.expand(P, *conv.shape[1:]).clone(memory_format=torch.contiguous_format)
        if recurrent is not None:
            recurrent = recurrent.expand(P, *recurrent.shape[1:]).clone(memory_format=torch.contiguous_format)
        device = hidden_states.device
        rows = hidden_states[0].index_select(0, plan.path_index.to(device)).view(P, D, -1)
        out = original(rows, cache_params=_ScratchState(conv, recurrent, kernel), attention_mask=None, **kwargs)
        return out.reshape(P * D, -1).index_select(0, plan.node_slot.to(device)).unsqueeze(0)

    return forward


def _node_recurrent_forward(original: Callable, module, layer_idx: int, cache, record: _Record):
    plan = record.plan

    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        record.inputs[layer_idx] = (hidden_states, None)
        kernel = _kernel_size(module, cache, layer_idx)
        conv, recurrent = _real_state(cache, layer_idx, kernel)
        tokens = hidden_states[0]
        outputs = []
        device = tokens.device
        for nodes, parent_slots in plan.levels:
            nodes, parent_slots = nodes.to(device), parent_slots.to(device)  # no-ops on one device
            scratch = _ScratchState(
                None if conv is None else conv.index_select(0, parent_slots),
                None if recurrent is None else recurrent.index_select(0, parent_slots),
                kernel,
            )
            step = tokens.index_select(0, nodes).unsqueeze(1)  # [nodes at this depth, 1, H]
            outputs.append(original(step, cache_params=scratch, attention_mask=None, **kwargs)[:, 0])
            conv, recurrent = scratch.conv, scratch.recurrent
        return torch.cat(outputs, dim=0).index_select(0, plan.inverse_order.to(device)).unsqueeze(0)

    return forward


# --------------------------------------------------------------------------------------------
# Gated DeltaNet fast path
# --------------------------------------------------------------------------------------------
#
# For a GDN module whose forward calls its modeling file's kernel functions by global name
# (transformers' Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Olmo-Hybrid, Qwen4-Exp layouts), a verify
# wraps those functions -- ``*chunk_gated_delta_rule``, ``*recurrent_gated_delta_rule``,
# ``causal_conv1d_fn`` and ``causal_conv1d_update`` -- for the duration of the verify (they act
# only inside this thread's GDN module calls), and keeps what the recurrence consumed.
# Projections, norms and out-projections run once, in the module's own code; nothing of the
# module is re-run at commit time.
#
# * chain: the module runs as is (its own kernels, fla's when installed). The wrappers keep
#   references to the kernel's inputs (q, k, v, g, beta) and to the conv's pre-conv inputs.
#   The commit puts the snapshot back, appends the kept pre-conv inputs to the conv window
#   through the cache's own ``update_conv_state`` (so past recording keeps its meaning), and
#   replays only the delta rule over the kept prefix: on CPU with a closed form computed from
#   k, v, g, beta (``_delta_rule`` below, no output, no padding), elsewhere with the module's
#   own kernel on the prefix (one fused fla call on a GPU).
# * tree: the module runs ONCE over the flat tree with a read-only view of the real state.
#   The conv wrapper gives each node the window of its nearest ancestors, then the committed
#   window (the windows laid end to end through the module's own conv function), and the kernel
#   wrapper runs the delta rule over the whole tree in one chunk with an ancestor mask and
#   path-cumulative decay: exact for every node, no node run twice. The commit of the
#   accepted path is the closed form from the tree's own delta-corrected values.
# * commit: all fast layers at once, stacked along the batch axis (see "commit" below).
#
# The closed form: with G the cumulative log decay along a path, u the delta-corrected values
# (solved from ``(I + A) u = beta * (v - e^G k S0)``, A[i, j] = beta_i (k_i . k_j) e^(G_i - G_j)
# for ancestors j of i), the state after node a is ``e^G_a S0 + sum_j e^(G_a - G_j) k_j u_j^T``
# over j on the path to a, and a node's output is ``e^G_i q_i S0 + sum_j e^(G_i - G_j) (q_i . k_j) u_j``.
#
# Anything unexpected (a class whose forward calls other names, a kernel or conv called a
# different number of times) falls back to the generic module replay / tree strategies above.

#: Use the fast path where the module's layout allows it (False: generic module replay only).
GDN_FAST_PATH = True
#: How a chain commit replays the delta rule: "closed" (own closed form), "kernel" (the
#: module's kernel on the kept prefix) or "auto" (closed on CPU, kernel elsewhere).
GDN_CHAIN_REPLAY = "auto"

_fast_local = threading.local()
_fast_lock = threading.Lock()
_fast_installed: dict = {}  # (id of the modeling namespace, name) -> [users, original, wrapper]
_FAST_KERNELS: "weakref.WeakKeyDictionary[type, Any]" = weakref.WeakKeyDictionary()
_KERNEL_ARGS = ("query", "key", "value", "g", "beta")


def _fast_kind(name: str) -> str | None:
    lowered = name.lower()
    if "gated_delta_rule" in lowered:
        return "kernel" if ("chunk" in lowered or "recurrent" in lowered) else None
    if "causal_conv1d" in lowered:
        return "conv"
    return None


def _fast_gdn_kernels(module):
    """``(namespace, {global name: kind})`` of the kernels ``module.forward`` calls, or None."""
    cls = type(module)
    if cls in _FAST_KERNELS:
        return _FAST_KERNELS[cls]
    info = None
    forward = inspect.unwrap(getattr(cls, "forward", None))
    code, namespace = getattr(forward, "__code__", None), getattr(forward, "__globals__", None)
    if code is not None and namespace is not None and hasattr(module, "conv_kernel_size"):
        names = {n: _fast_kind(n) for n in code.co_names if _fast_kind(n) and callable(namespace.get(n))}
        kinds = set(names.values())
        if kinds == {"kernel", "conv"} and "cache_params" in inspect.signature(forward).parameters:
            info = (namespace, names)
    _FAST_KERNELS[cls] = info
    return info


def _fast_enabled(module) -> bool:
    return GDN_FAST_PATH and _fast_gdn_kernels(module) is not None


class _FastCapture:
    """What one GDN layer's kernels consumed during one verify."""

    def __init__(self, mode: str, seq_len: int, kernel_size: int, plan: _TreePlan | None = None):
        self.mode = mode  # "chain" or "tree"
        self.seq_len = seq_len
        self.kernel_size = kernel_size
        self.plan = plan
        self.conv_calls = 0
        self.kernel_calls = 0
        self.conv_inputs: torch.Tensor | None = None  # [B, C, T] pre-conv inputs of the verify tokens
        self.kernel: tuple | None = None  # chain: (kernel function, args, kwargs) as called
        self.arguments: dict = {}  # chain: the same arguments by name
        self.tree: tuple | None = None  # tree: (k, u, G, initial state) for the closed-form commit

    @property
    def complete(self) -> bool:
        return self.conv_calls == 1 and self.kernel_calls == 1


def _fast_wrapper(kind: str, original: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        capture = getattr(_fast_local, "capture", None)
        if capture is None:  # another thread, or no verify: the original, untouched
            return original(*args, **kwargs)
        if kind == "conv":
            capture.conv_calls += 1
            return (_tree_conv if capture.mode == "tree" else _chain_conv)(capture, original, args, kwargs)
        capture.kernel_calls += 1
        return (_tree_kernel if capture.mode == "tree" else _chain_kernel)(capture, original, args, kwargs)

    functools.update_wrapper(wrapper, original)
    return wrapper


@contextlib.contextmanager
def _fast_kernels_for(modules):
    """Wrap the kernel globals of the modeling files of ``modules`` for the duration of a verify.

    Installed once per verify (changing a module's globals makes Python re-specialise the code
    that reads them, so not once per layer call). The wrappers are shared and counted across
    threads: installed by the first user, put back by the last; they act only for the thread
    whose GDN module call set a capture, and call the original function unchanged otherwise.
    """
    infos = {}
    if GDN_FAST_PATH:
        for _, module in modules:
            info = _fast_gdn_kernels(module)
            if info is not None:
                infos[id(info[0])] = info
    keys = []
    with _fast_lock:
        for namespace, names in infos.values():
            for name, kind in names.items():
                key = (id(namespace), name)
                entry = _fast_installed.get(key)
                if entry is None:
                    entry = [0, namespace[name], _fast_wrapper(kind, namespace[name]), namespace]
                    _fast_installed[key] = entry
                    namespace[name] = entry[2]
                entry[0] += 1
                keys.append(key)
    try:
        yield
    finally:
        with _fast_lock:
            for key in keys:
                entry = _fast_installed[key]
                entry[0] -= 1
                if entry[0] == 0:
                    namespace, name = entry[3], key[1]
                    if namespace.get(name) is entry[2]:
                        namespace[name] = entry[1]
                    del _fast_installed[key]


class _fast_capturing:
    """Make ``capture`` this thread's capture for one GDN module call."""

    __slots__ = ("capture", "previous")

    def __init__(self, capture: _FastCapture):
        self.capture = capture

    def __enter__(self):
        self.previous = getattr(_fast_local, "capture", None)
        _fast_local.capture = self.capture
        return self.capture

    def __exit__(self, *exc):
        _fast_local.capture = self.previous
        return False


def _kernel_arguments(original: Callable, args, kwargs) -> dict:
    """The kernel call's arguments by name (q, k, v, g, beta may come positionally)."""
    bound = dict(zip(_KERNEL_ARGS, args))
    bound.update(kwargs)
    return bound


# ---- chain ---------------------------------------------------------------------------------


def _fast_chain_forward(original: Callable, module, layer_idx: int, record: _Record) -> Callable:
    def forward(hidden_states, *args, **kwargs):
        capture = _FastCapture("chain", int(hidden_states.shape[1]), int(module.conv_kernel_size))
        with _fast_capturing(capture):
            output = original(hidden_states, *args, **kwargs)
        if capture.complete:
            record.fast[layer_idx] = capture  # else: the generic replay of the captured input
        return output

    return forward


def _chain_conv(capture: _FastCapture, original, args, kwargs):
    x = args[0] if args else kwargs["hidden_states"]
    capture.conv_inputs = x[..., -capture.seq_len :]  # after the cached window, if any
    return original(*args, **kwargs)


def _chain_kernel(capture: _FastCapture, original, args, kwargs):
    capture.kernel = (original, args, dict(kwargs))
    capture.arguments = _kernel_arguments(original, args, kwargs)
    return original(*args, **kwargs)


def _fast_chain_replacements(modules, record: _Record) -> list:
    return [
        (module, _fast_chain_forward(module.forward, module, layer_idx, record))
        for layer_idx, module in modules
        if _fast_enabled(module)
    ]


# ---- tree ----------------------------------------------------------------------------------


class _TreeStateView:
    """The real (conv, recurrent) state of one GDN layer, read-only, for a one-pass tree verify.

    ``update_conv_state`` returns the committed window followed by the tree's inputs, and the
    recurrent update is dropped. ``is_recording_past`` is True so that a one-node tree also
    takes the conv-function path the wrapper handles.
    """

    def __init__(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None, kernel: int):
        self.conv, self.recurrent, self.kernel = conv, recurrent, kernel

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.conv

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.recurrent

    def is_recording_past(self, layer_idx=None):
        return True

    def has_previous_state(self, layer_idx=None, state_idx=None):
        return self.conv is not None

    def update_conv_state(self, conv_states, layer_idx=None, state_idx=0, conv_kernel_size=None, **kwargs):
        window = self.conv
        if window is None:  # no prefix yet: the zeros a causal conv pads with
            window = conv_states.new_zeros(*conv_states.shape[:-1], self.kernel)
        return torch.cat([window[..., -self.kernel :].to(conv_states.dtype), conv_states], dim=-1)

    def update_recurrent_state(self, recurrent_states, layer_idx=None, state_idx=0, **kwargs):
        return recurrent_states


def _fast_tree_forward(original: Callable, module, layer_idx: int, cache, record: _Record) -> Callable:
    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        kernel = _kernel_size(module, cache, layer_idx)
        conv, recurrent = _real_state(cache, layer_idx, kernel)
        capture = _FastCapture("tree", int(hidden_states.shape[1]), kernel, record.plan)
        view = _TreeStateView(conv, recurrent, kernel)
        with _fast_capturing(capture):
            output = original(hidden_states, cache_params=view, attention_mask=None, **kwargs)
        if capture.complete:
            record.inputs[layer_idx] = (hidden_states, None)
            record.fast[layer_idx] = capture
            return output
        # The module did not call its kernels the way this path expects: the generic strategy.
        _FAST_KERNELS[type(module)] = None
        generic = _node_recurrent_forward(original, module, layer_idx, cache, record)
        return generic(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)

    return forward


def _tree_fast_or(make: Callable, module) -> Callable:
    """The tree forward builder for ``module``: one pass where possible and chosen, else ``make``."""
    return _fast_tree_forward if TREE_STRATEGY in ("auto", "onepass") and _fast_enabled(module) else make


def _tree_taps(plan: _TreePlan, kernel: int) -> torch.Tensor:
    """``[N, kernel]`` columns of ``cat(window[kernel], tree[N])`` each node's conv reads: its
    nearest ancestors and itself (last), then the committed window's last columns."""
    taps = getattr(plan, "_conv_taps", None)
    if taps is not None and taps.shape[1] == kernel:
        return taps
    rows = []
    for node in range(len(plan.parents)):
        row, j = [], node
        while len(row) < kernel and j >= 0:
            row.append(kernel + j)
            j = plan.parents[j]
        row += range(kernel - 1, kernel - 1 - (kernel - len(row)), -1)
        rows.append(row[::-1])
    plan._conv_taps = taps = torch.tensor(rows)
    return taps


def _tree_ancestors(plan: _TreePlan) -> torch.Tensor:
    """``[N, N]`` bool: ``[i, j]`` when j is i or one of its ancestors."""
    anc = getattr(plan, "_ancestors", None)
    if anc is None:
        n = len(plan.parents)
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            anc[i] |= anc[plan.parents[i]]
        plan._ancestors = anc
    return anc


def _tree_conv(capture: _FastCapture, original, args, kwargs):
    args = list(args)
    full = args[0] if args else kwargs["hidden_states"]  # [B, C, kernel + N], from _TreeStateView
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    kernel, n = int(weight.shape[-1]), capture.seq_len
    capture.conv_inputs = full[..., -n:]
    taps = _tree_taps(capture.plan, kernel).to(full.device)
    # Every node's window laid out one after the other: the module's own (causal) conv function,
    # activation included, gives at the last column of each window exactly that node's output.
    windows = full[:, :, taps.reshape(-1)]  # [B, C, N * kernel]
    if args:
        args[0] = windows
    else:
        kwargs["hidden_states"] = windows
    return original(*args, **kwargs)[..., kernel - 1 :: kernel]


def _delta_rule(key, value, g, beta, initial_state, ancestors, query=None, l2norm=False, scale=None):
    """The gated delta rule over a tree (a chain is the tree whose ancestors are all earlier
    tokens) in one chunk, float32. Returns (output or None, k, u, G) with k normalised and
    expanded to the value heads, u the delta-corrected values, G the path-cumulative log decay,
    all ``[B, H, N, ...]``."""
    n_k, n_v = key.shape[2], value.shape[2]
    if n_v != n_k:  # grouped value heads: each key head serves n_v // n_k consecutive value heads
        key = key.repeat_interleave(n_v // n_k, dim=2)
        if query is not None:
            query = query.repeat_interleave(n_v // n_k, dim=2)
    k, v, b, gl = (x.transpose(1, 2).float() for x in (key, value, beta, g))
    if l2norm:
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    anc = ancestors.to(k.device)
    G = gl @ anc.T.to(gl.dtype)  # [B, H, N]
    rel = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~anc, float("-inf")).exp()
    system = (b.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * rel).tril(-1)  # solve ignores the diagonal
    rhs = v * b.unsqueeze(-1)
    s0 = None if initial_state is None else initial_state.float()
    if s0 is not None:
        rhs = rhs - (b * G.exp()).unsqueeze(-1) * (k @ s0)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = None
    if query is not None:
        q = query.transpose(1, 2).float()
        if l2norm:
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
        out = ((q @ k.transpose(-1, -2)) * rel) @ u
        if s0 is not None:
            out = out + G.exp().unsqueeze(-1) * (q @ s0)
    return out, k, u, G


def _closed_form_state(k, u, G, s0, path: torch.Tensor) -> torch.Tensor:
    """The recurrent state after the last node of ``path`` (root first), from ``_delta_rule``'s terms."""
    last = path[-1:]
    G_last = G.index_select(-1, last)  # [B, H, 1]
    weights = (G_last - G.index_select(-1, path)).exp().unsqueeze(-1)
    state = (k.index_select(2, path) * weights).transpose(-1, -2) @ u.index_select(2, path)
    if s0 is not None:
        state = state + G_last.exp().unsqueeze(-1) * s0
    return state


def _tree_kernel(capture: _FastCapture, original, args, kwargs):
    a = _kernel_arguments(original, args, kwargs)
    value = a["value"]
    out, k, u, G = _delta_rule(
        a["key"], value, a["g"], a["beta"], a.get("initial_state"), _tree_ancestors(capture.plan),
        query=a["query"], l2norm=bool(a.get("use_qk_l2norm_in_kernel", False)), scale=a.get("scale"),
    )
    s0 = a.get("initial_state")
    capture.tree = (k, u, G, None if s0 is None else s0.float())
    return out.transpose(1, 2).to(value.dtype).contiguous(), None


# ---- commit --------------------------------------------------------------------------------
#
# All fast layers are committed together: layers with the same dimensions are stacked along
# the batch axis, so the commit costs the same few operations (GPU: the same few launches)
# whatever the number of layers. Each layer's results are then written through the cache's
# own ``update_conv_state`` / ``update_recurrent_state``.


def _chain_replay_mode(device) -> str:
    if GDN_CHAIN_REPLAY not in ("auto", "closed", "kernel"):
        raise ValueError(f"ddpatch: unknown GDN_CHAIN_REPLAY {GDN_CHAIN_REPLAY!r}")
    if GDN_CHAIN_REPLAY != "auto":
        return GDN_CHAIN_REPLAY
    return "closed" if torch.device(device).type == "cpu" else "kernel"


def _commit_group_key(capture: _FastCapture, previous: torch.Tensor | None):
    """Layers whose commits can be stacked share this key."""
    if capture.mode == "tree":
        k, u, _, s0 = capture.tree
        return ("tree", tuple(k.shape[1:]), tuple(u.shape[1:]), k.device, s0 is None)
    kernel, args, kwargs = capture.kernel
    a = capture.arguments
    value = a["value"]
    mode = _chain_replay_mode(value.device)
    others = tuple(sorted((name, repr(x)) for name, x in kwargs.items()
                          if name not in _KERNEL_ARGS and not isinstance(x, torch.Tensor)))
    return ("chain", mode, id(kernel) if mode == "kernel" else None, tuple(a["key"].shape[2:]),
            tuple(value.shape[2:]), value.dtype, value.device, previous is None, others)


_CAUSAL: dict = {}


def _causal(n: int, device) -> torch.Tensor:
    """The ancestor matrix of a chain of ``n`` tokens (cached: a commit needs one per round)."""
    key = (n, str(device))
    mask = _CAUSAL.get(key)
    if mask is None:
        mask = _CAUSAL[key] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return mask


def _group_states(members, n: int, path: torch.Tensor | None) -> list:
    """The recurrent state after the kept tokens for each ``(layer_idx, capture, previous)``."""
    sizes = [m[1].conv_inputs.shape[0] for m in members]
    first = members[0][1]
    if first.mode == "tree":
        parts = [m[1].tree for m in members]
        k, u, G = (torch.cat([p[i] for p in parts]) for i in range(3))
        s0 = None if parts[0][3] is None else torch.cat([p[3] for p in parts])
        state = _closed_form_state(k, u, G, s0, path.to(k.device))
        return list(state.split(sizes))
    previous = None if members[0][2] is None else torch.cat([m[2] for m in members])
    calls = [m[1].arguments for m in members]
    stacked = {name: torch.cat([c[name][:, :n] for c in calls]) for name in _KERNEL_ARGS}
    if _chain_replay_mode(stacked["value"].device) == "closed":
        causal = _causal(n, stacked["value"].device)
        _, k, u, G = _delta_rule(stacked["key"], stacked["value"], stacked["g"], stacked["beta"], previous, causal,
                                 l2norm=bool(calls[0].get("use_qk_l2norm_in_kernel")))
        s0 = None if previous is None else previous.float()
        state = _closed_form_state(k, u, G, s0, torch.arange(n, device=k.device))
    else:
        # The module's own kernel (fla's when installed) on the kept prefix, all layers in one call.
        kernel, _, kwargs = first.kernel
        kwargs = {name: x for name, x in kwargs.items() if name not in _KERNEL_ARGS}
        kwargs.update({name: stacked[name] for name in ("g", "beta")}, initial_state=previous, output_final_state=True)
        if "chunk_size" in inspect.signature(kernel).parameters and stacked["value"].device.type == "cpu":
            kwargs["chunk_size"] = n  # transformers' torch kernel pads to its chunk; one chunk of n is exact
        state = kernel(stacked["query"], stacked["key"], stacked["value"], **kwargs)[1]
    return list(state.split(sizes))


def _fast_commit(cache, record: _Record, keep: torch.Tensor | int) -> set:
    """Append the kept tokens to every fast layer's committed state (chain: the restored
    snapshot; tree: the state the verify left untouched). Returns the layers it committed."""
    if not record.fast:
        return set()
    if isinstance(keep, int):
        n, path = keep, None
    else:
        path = keep.reshape(-1)
        n = int(path.numel())
    if n == 0:
        return set(record.fast)
    groups: dict = {}
    for layer_idx, capture in record.fast.items():
        layer = cache.layers[layer_idx]
        previous = layer.recurrent_states.get(0) if layer.has_previous_state.get(0, False) else None
        groups.setdefault(_commit_group_key(capture, previous), []).append((layer_idx, capture, previous))
    for members in groups.values():
        for (layer_idx, capture, previous), state in zip(members, _group_states(members, n, path)):
            if path is None:
                x = capture.conv_inputs[..., :n]
            else:
                x = capture.conv_inputs.index_select(-1, path.to(capture.conv_inputs.device))
            cache.update_conv_state(x, layer_idx, conv_kernel_size=capture.kernel_size)
            cache.update_recurrent_state(state if previous is None else state.to(previous.dtype), layer_idx)
    return set(record.fast)



# --------------------------------------------------------------------------------------------
# verify_forward
# --------------------------------------------------------------------------------------------


def _snapshot(cache, layer_idx: int) -> _Snapshot:
    layer = cache.layers[layer_idx]
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return _Snapshot(
        conv={k: clone(v) for k, v in layer.conv_states.items()},
        recurrent={k: clone(v) for k, v in layer.recurrent_states.items()},
        has_previous=dict(layer.has_previous_state),
    )


def _restore(cache, layer_idx: int, snap: _Snapshot) -> None:
    layer = cache.layers[layer_idx]
    for store, saved in ((layer.conv_states, snap.conv), (layer.recurrent_states, snap.recurrent)):
        for k, value in saved.items():
            current = store.get(k)
            if value is None:
                continue  # was never initialised: has_previous_state below makes it ignored
            if current is not None and current.shape == value.shape:
                current.copy_(value)  # keep the tensor's address (cudagraph-friendly, like transformers)
            else:
                store[k] = value
    for k, flag in snap.has_previous.items():
        layer.has_previous_state[k] = flag


def _use_path_batched(plan: _TreePlan, device) -> bool:
    if TREE_STRATEGY not in ("auto", "node", "path", "onepass"):
        raise ValueError(f"ddpatch: unknown TREE_STRATEGY {TREE_STRATEGY!r}")
    if TREE_STRATEGY != "auto":
        return TREE_STRATEGY == "path"
    if torch.device(device).type == "cuda":
        return True
    # CPU fallback costs, measured: a path row ~0.65x of a single-token module call.
    return plan.n_paths <= 1.5 * plan.path_len


@contextlib.contextmanager
def _swapped_forwards(replacements):
    """Give each module an instance-level ``forward`` for the duration; always put back what was there."""
    saved = [(module, "forward" in module.__dict__, module.__dict__.get("forward")) for module, _ in replacements]
    try:
        for module, forward in replacements:
            module.forward = forward
        yield
    finally:
        for module, had_own, previous in saved:
            if had_own:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)


def verify_forward(model, *args, **kwargs):
    """``model(*args, **kwargs)``, recording what a lossless commit of a hybrid target needs.

    The record is attached to ``kwargs["past_key_values"]``; ``crop_cache``, ``compact_cache``
    or a ``@tree_commit`` function commits it. A 4D ``attention_mask`` means a tree verify.
    """
    cache = kwargs.get("past_key_values")
    given_mask = kwargs.get("attention_mask")
    if cache is not None and _layers(cache) is not None and not kwargs.pop("_ddpatch_windowed", False):
        _record_window_past(cache)
        if isinstance(given_mask, torch.Tensor) and given_mask.dim() == 4:
            windowed = _windowed_mask_forwards(model, cache, given_mask, kwargs)
            _check_mask_honoured(model, given_mask)
            if windowed:  # sliding layers: each gets its windowed tree mask, the rest as given
                with _swapped_forwards(windowed):
                    return verify_forward(model, *args, _ddpatch_windowed=True, **kwargs)
    modules = hybrid_linear_modules(model) if cache is not None else ()
    if not modules:
        return _checked_hidden_states(model, model(*args, **kwargs))
    layers = _layers(cache)
    if layers is None or any(i >= len(layers) or not _is_linear_layer(layers[i]) for i, _ in modules):
        _warn_once(
            cache,
            "ddpatch: the target cache has no transformers 5.x linear-attention layers (build it with "
            "DynamicCache(config=target.config)); the Gated DeltaNet state cannot be rolled back.",
        )
        return model(*args, **kwargs)

    _own_crop(cache)
    previous = _pending_record(cache)  # raises when the cache was cut back without a commit
    if previous is not None:
        # Never cut back: every verified token was kept. Exact for a chain, and for a tree only
        # when the tree is a single path.
        _commit_for_drop(cache, previous, 0)
    _set_record(cache, None)

    mask = given_mask
    tokens = args[0] if args else kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    length = int(tokens.shape[1])
    past_len = int(cache.get_seq_length())
    is_tree = isinstance(mask, torch.Tensor) and mask.dim() == 4

    if is_tree:
        parents = tree_parents_from_mask(mask)
        if len(parents) != length:
            raise ValueError(f"ddpatch: mask has {len(parents)} query rows for {length} verify tokens")
        record = _Record("tree", past_len, length, modules, plan=_tree_plan(parents, tokens.device))
        make = _path_batched_forward if _use_path_batched(record.plan, tokens.device) else _node_recurrent_forward
        replacements = [
            (module, _keyword_adapted(_tree_fast_or(make, module))(module.forward, module, layer_idx, cache, record))
            for layer_idx, module in modules
        ]
        with _swapped_forwards(replacements), _fast_kernels_for(modules):
            output = model(*args, **kwargs)
        _set_record(cache, record)  # only after a forward that completed
        return _checked_hidden_states(model, output)

    record = _Record("chain", past_len, length, modules)
    record.snapshot = {i: _snapshot(cache, i) for i, _ in modules}

    def capture(layer_idx):
        def hook(module, hook_args, hook_kwargs):
            hs = hook_kwargs["hidden_states"] if "hidden_states" in hook_kwargs else hook_args[0]
            record.inputs[layer_idx] = (hs, hook_kwargs.get("attention_mask"))

        return hook

    handles = []
    try:
        for layer_idx, module in modules:
            handles.append(module.register_forward_pre_hook(capture(layer_idx), with_kwargs=True))
        with _swapped_forwards(_fast_chain_replacements(modules, record)), _fast_kernels_for(modules):
            output = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    _set_record(cache, record)
    return _checked_hidden_states(model, output)


# --------------------------------------------------------------------------------------------
# Commit
# --------------------------------------------------------------------------------------------


def _replay(cache, record: _Record, index: torch.Tensor | int) -> None:
    """Run each GDN module on the kept captured inputs, with the real cache."""
    done = _fast_commit(cache, record, index)  # the Gated DeltaNet fast path: the recurrence alone
    for layer_idx, module in record.modules:
        if layer_idx in done:
            continue
        hidden, mask = record.inputs[layer_idx]
        if isinstance(index, int):
            hidden = hidden[:, :index]
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                mask = mask[:, :index]
        else:
            hidden = hidden.index_select(1, index.to(hidden.device))
            mask = None
        module(hidden_states=hidden, attention_mask=mask, **_cache_kwargs(module, cache))


def _as_index_list(keep) -> list[int]:
    if isinstance(keep, torch.Tensor):
        return [int(i) for i in keep.reshape(-1).tolist()]
    return [int(i) for i in keep]


def _commit(cache, record: _Record, keep: list[int]) -> None:
    """Bring every GDN layer to "prefix + the kept verify tokens", exactly."""
    n = len(keep)
    missing = [i for i, _ in record.modules if i not in record.inputs]
    if missing and n:
        raise RuntimeError(f"ddpatch: the recorded verify never reached Gated DeltaNet layers {missing}")
    with _state_context([cache.layers[i].recurrent_states.get(0) for i, _ in record.modules]):
        if record.mode == "chain":
            if keep != list(range(n)):
                raise ValueError(f"ddpatch: a chain verify can only keep a prefix, got {keep}")
            if n != record.length:  # all kept: the state already is right
                for layer_idx, _ in record.modules:
                    _restore(cache, layer_idx, record.snapshot[layer_idx])
                if n:
                    _replay(cache, record, n)
        else:
            parents = record.plan.parents
            if n:
                if keep[0] != 0 or any(parents[b] != a for a, b in zip(keep, keep[1:])):
                    raise ValueError(f"ddpatch: kept tree nodes {keep} are not a root-to-node path")
                # The real state was not touched by the tree verify: replay the path from it.
                _replay(cache, record, torch.tensor(keep))
    record.settled = record.past_len + n
    record.inputs.clear()  # free the captured activations
    record.snapshot.clear()
    record.fast.clear()


def _crop_attention(cache, drop: int) -> None:
    """Drop the last ``drop`` tokens of every key/value layer (linear-attention state is not touched)."""
    if drop <= 0:
        return
    for layer in cache.layers:
        if _is_linear_layer(layer):
            keys = getattr(layer, "keys", None)
            if isinstance(keys, torch.Tensor) and keys.dim() >= 2 and keys.shape[-2] > 0:
                # combined linear + attention layer: crop only its attention part
                layer.keys = keys[..., :-drop, :]
                layer.values = layer.values[..., :-drop, :]
            continue
        type(layer).crop(layer, -drop)  # the class's crop: negative = tokens to drop, legal on every 5.x


def _trim_conv(cache) -> None:
    """What a native crop does to a recording linear layer: keep only the conv window the next forward needs."""
    for i in _linear_layer_ids(cache):
        layer = cache.layers[i]
        if not getattr(layer, "record_past", False):
            continue
        for k, conv in layer.conv_states.items():
            kernel = layer.conv_kernel_size.get(k)
            if isinstance(conv, torch.Tensor) and kernel and conv.shape[-1] > kernel:
                layer.conv_states[k] = conv[..., -kernel:]


def _tree_prefix_is_path(record: _Record, keep: int) -> bool:
    """Whether keeping the first ``keep`` nodes can only mean one path: the tree is a single chain.

    (A prefix that happens to be a path is not enough: with nodes 1 and 2 siblings, a cut to
    two nodes may mean the path [0, 2] that was compacted into place.)
    """
    parents = record.plan.parents
    return all(parents[i] == i - 1 for i in range(1, len(parents)))


def _commit_for_drop(cache, record: _Record, drop: int) -> None:
    """Commit ``record`` for a cut that keeps all but the last ``drop`` tokens of the verify window."""
    keep = record.length - drop
    if keep < 0:
        _set_record(cache, None)
        raise RuntimeError(
            f"ddpatch: the target cache was cut back {drop} tokens, below the start of the recorded verify "
            f"({record.length} tokens); the recurrent state can only be rolled back to the verify's start"
        )
    if record.mode == "tree" and keep > 1 and not _tree_prefix_is_path(record, keep):
        # The first `keep` nodes are not a root-to-node path: only the compaction knows which
        # nodes were accepted. Guessing a path would commit the wrong branch silently.
        _set_record(cache, None)
        raise RuntimeError(
            "ddpatch: a tree verify was cut back without its accepted path; commit it with compact_cache(cache, "
            "past_length, keep) or decorate the compaction function with @tree_commit"
        )
    _commit(cache, record, list(range(keep)))


def _cut(cache, drop: int) -> None:
    """Drop the last ``drop`` tokens of a 5.x cache, exactly (the one place every crop goes through)."""
    linear = _linear_layer_ids(cache)
    current = int(cache.get_seq_length())
    drop = max(0, min(int(drop), current))
    if not linear:
        if drop > 0:
            _crop_attention(cache, drop)
        return
    record = _pending_record(cache)  # raises when the cache was cut back behind its back
    if record is not None:
        _commit_for_drop(cache, record, drop)
        _crop_attention(cache, drop)
        _trim_conv(cache)
        return
    settled = _get_record(cache)
    _crop_attention(cache, drop)
    if settled is not None:
        # Committed already (by @tree_commit or compact_cache): only attention was left to cut.
        if current - drop != settled.settled:
            raise RuntimeError(
                f"ddpatch: the target cache was cut back to {current - drop} tokens but its recurrent state was "
                f"committed for {settled.settled}"
            )
        _trim_conv(cache)
        return
    if drop > 0:
        _warn_once(cache)
    _trim_conv(cache)


def crop_cache(cache, length: int) -> None:
    """Legacy crop: ``length >= 0`` keeps the first ``length`` tokens, ``length < 0`` drops ``-length``.

    This is transformers 4.x's meaning of ``crop``, on every version. Lengths past the cache's
    end keep everything; ``crop_cache(cache, 0)`` keeps nothing. On a cache that went through
    ``verify_forward`` the recorded verify is committed exactly (see ``_own_crop``); on a
    hybrid cache that never did, the linear-attention state cannot be rolled back, and a crop
    that drops tokens warns once.
    """
    length = int(length)
    if _layers(cache) is None:
        # transformers 4.x: crop accepts the legacy positive length (and negatives).
        cache.crop(length)
        return
    current = int(cache.get_seq_length())
    new_len = length if length >= 0 else current + length
    new_len = max(0, min(new_len, current))
    _cut(cache, current - new_len)


# --------------------------------------------------------------------------------------------
# The commit belongs to the cache
# --------------------------------------------------------------------------------------------
#
# verify_forward makes the recorded cache's own ``crop`` (and its linear layers' ``crop``)
# commit the record, so every way of cutting the cache back is exact, whatever the calling
# code looks like: a native 5.x ``cache.crop(-n)``, a helper of any shape that ends in it,
# ``crop_cache``, ``compact_cache`` or ``@tree_commit``. Anything that shortens the cache
# without a crop (slicing key/value tensors by hand) is caught at the next crop or verify and
# raises, because the recurrent state can no longer be made exact.

_OWNED_ATTR = "_ddpatch_owned"


def _owned_cache_crop(cache_ref):
    def crop(tokens_to_remove: int) -> None:
        """transformers 5.x ``Cache.crop``: a negative count of tokens to drop, committed exactly by ddpatch."""
        cache = cache_ref()
        count = int(tokens_to_remove)
        if count > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{count}`) is not supported. Please use a negative "
                "integer to remove that number of tokens from the cache instead."
            )
        _cut(cache, -count)

    return crop


def _owned_layer_crop(cache_ref, layer):
    def crop(tokens_to_remove: int) -> None:
        """A linear layer's 5.x ``crop``, reached directly: commit the whole record once, then trim."""
        cache = cache_ref()
        drop = -int(tokens_to_remove)
        if drop < 0:
            raise RuntimeError(
                "Linear attention layers can only be cropped by passing a negative int, to specify how many "
                "tokens to remove"
            )
        record = _get_record(cache)
        if record is not None and record.settled is None:
            _commit_for_drop(cache, record, drop)
        keys = getattr(layer, "keys", None)
        if drop and isinstance(keys, torch.Tensor) and keys.dim() >= 2 and keys.shape[-2] > 0:
            layer.keys = keys[..., :-drop, :]
            layer.values = layer.values[..., :-drop, :]
        _trim_conv(cache)

    return crop


def _own_crop(cache) -> None:
    """Make ``cache.crop`` (and each linear layer's ``crop``) commit a recorded verify. Idempotent."""
    if cache.__dict__.get(_OWNED_ATTR):
        return
    ref = weakref.ref(cache)
    cache.crop = _owned_cache_crop(ref)
    for i in _linear_layer_ids(cache):
        layer = cache.layers[i]
        layer.crop = _owned_layer_crop(ref, layer)
    setattr(cache, _OWNED_ATTR, True)


def _kv_tensors(cache):
    if _layers(cache) is not None:
        for layer in cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor):
                    yield tensor
    else:  # transformers 4.x DynamicCache
        yield from getattr(cache, "key_cache", [])
        yield from getattr(cache, "value_cache", [])


def _compact_attention(cache, past_length: int, keep: list[int]) -> None:
    """Move the kept verify-window entries of every K/V tensor to the front of the window."""
    if not keep:
        return
    for tensor in _kv_tensors(cache):
        if tensor.dim() < 2 or tensor.shape[-2] <= past_length:
            continue
        index = torch.tensor(keep, device=tensor.device)
        tail = tensor.narrow(-2, past_length, tensor.shape[-2] - past_length).index_select(-2, index)
        tensor.narrow(-2, past_length, len(keep)).copy_(tail)


def compact_cache(cache, past_length: int, keep_indices) -> None:
    """Keep only ``keep_indices`` of the verify window that starts at ``past_length``.

    Attention KV of the kept nodes is moved into place and the rest cropped; GDN layers are
    committed from the recorded verify (a warning once per cache when there is none).
    """
    keep = _as_index_list(keep_indices)
    record = _pending_record(cache) if _layers(cache) is not None else None
    if record is not None:
        _commit(cache, record, keep)
    done = _compact_keyed_layers(cache, int(past_length), keep) if _layers(cache) is not None else {}
    with _hide_layers(cache, done):
        _compact_attention(cache, int(past_length), keep)
        crop_cache(cache, int(past_length) + len(keep))


def tree_commit(cache_arg: str, past_length_arg: str, keep_arg: str):
    """Decorator factory for upstream's ``compact_dynamic_cache(cache, past_length, keep)``.

    Before the wrapped function compacts attention KV and crops (through ``crop_cache``), the
    GDN layers are committed for the recorded verify with the kept indices.
    """

    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            cache = bound.arguments[cache_arg]
            record = _pending_record(cache) if _layers(cache) is not None else None
            if record is not None:
                past_length = bound.arguments[past_length_arg]
                if past_length is not None and int(past_length) != record.past_len:
                    warnings.warn(
                        f"ddpatch: compaction at past length {int(past_length)} but the verify started at "
                        f"{record.past_len}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                _commit(cache, record, _as_index_list(bound.arguments[keep_arg]))
            done = {}
            if _layers(cache) is not None and bound.arguments[past_length_arg] is not None:
                keep = _as_index_list(bound.arguments[keep_arg])
                done = _compact_keyed_layers(cache, int(bound.arguments[past_length_arg]), keep)
            with _hide_layers(cache, done):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


# --------------------------------------------------------------------------------------------
# Draft: sliding-window layers without flash-attn
# --------------------------------------------------------------------------------------------

# model -> tuple of attention modules that declare a sliding window
_WINDOWED: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _windowed_modules(model) -> tuple:
    try:
        return _WINDOWED[model]
    except (KeyError, TypeError):
        pass
    found = tuple(
        m
        for m in model.modules()
        if isinstance(getattr(m, "sliding_window", None), int) and isinstance(getattr(m, "layer_idx", None), int)
    )
    try:
        _WINDOWED[model] = found
    except TypeError:
        pass
    return found


def draft_forward(model, *args, **kwargs):
    """``model(*args, **kwargs)`` for a DFlash-style draft, with its sliding windows honoured.

    Qwen3.6 drafters have sliding-window layers (4 of 5, window 2048). Upstream's draft
    passes no mask and hands ``sliding_window=`` to the attention function: flash-attn
    applies it, but sdpa and eager ignore it, so once flash-attn is absent (the fallback
    that makes the code run) every layer silently attends to the whole context. Here each
    windowed attention module gets an explicit mask for the call: a query at position q
    sees a key at position k when ``q - k < window`` (the block itself stays
    bidirectional). With flash-attn, without windowed layers, or when the caller passes
    its own mask, this is exactly ``model(...)``.
    """
    _check_draft_reads(model, kwargs)
    modules = _windowed_modules(model)
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "")
    positions = kwargs.get("position_ids")
    if not modules or impl.startswith("flash") or kwargs.get("attention_mask") is not None or positions is None:
        return model(*args, **kwargs)
    cache = kwargs.get("past_key_values")
    cached = int(cache.get_seq_length()) if cache is not None else 0
    layers = _layers(cache) if cache is not None else None
    key_positions = torch.cat([torch.arange(cached, device=positions.device), positions[0]])

    def masked(original, module):
        signature = inspect.signature(original)

        def forward(*f_args, **f_kwargs):
            bound = signature.bind(*f_args, **f_kwargs)
            hidden = bound.arguments.get("hidden_states", f_args[0] if f_args else None)
            if "attention_mask" not in signature.parameters or hidden is None:
                return original(*f_args, **f_kwargs)
            layer = layers[module.layer_idx] if layers is not None and module.layer_idx < len(layers) else None
            if layer is not None and getattr(layer, "is_sliding", False):
                return original(*f_args, **f_kwargs)  # a sliding cache layer trims keys itself
            q_pos = positions[0, -hidden.shape[1] :]
            visible = (q_pos[:, None] - key_positions[None, :]) < module.sliding_window
            mask = torch.zeros(visible.shape, dtype=hidden.dtype, device=hidden.device)
            mask.masked_fill_(~visible, torch.finfo(hidden.dtype).min)
            bound.arguments["attention_mask"] = mask[None, None]
            return original(*bound.args, **bound.kwargs)

        return forward

    with _swapped_forwards([(module, masked(module.forward, module)) for module in modules]):
        return model(*args, **kwargs)
