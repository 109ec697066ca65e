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

Without a record, a crop that drops tokens from a cache with GDN layers cannot be exact: it
leaves the GDN layers as they are and warns once per cache (today's silent bug, made loud).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = [
    "TREE_STRATEGY",
    "compact_cache",
    "crop_cache",
    "draft_forward",
    "hybrid_linear_modules",
    "tree_commit",
    "tree_parents_from_mask",
    "verify_forward",
]

#: How a tree verify runs the GDN layers: "auto" (default), "node" (node-recurrent) or "path" (path-batched).
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

# model -> tuple of (layer_idx, GDN module); an empty tuple for a model without GDN layers.
_MODEL_INFO: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def hybrid_linear_modules(model) -> tuple:
    """``((layer_idx, gdn_module), ...)`` of ``model`` in layer order; empty for pure attention.

    GDN modules are found as the ``linear_attn`` child of a decoder layer (so the nesting of
    ``ForCausalLM`` vs ``ForConditionalGeneration`` does not matter) and cross-checked against
    the text config's ``layer_types``. A mismatch raises: guessing would make the output lossy.
    """
    try:
        return _MODEL_INFO[model]
    except (KeyError, TypeError):
        pass
    found: dict[int, Any] = {}
    for module in model.modules():
        gdn = getattr(module, "linear_attn", None)
        if isinstance(gdn, torch.nn.Module) and isinstance(getattr(gdn, "layer_idx", None), int):
            found[gdn.layer_idx] = gdn
    config = getattr(model, "config", None)
    layer_types = None
    if config is not None:
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        expected = {i for i, kind in enumerate(layer_types) if kind == "linear_attention"}
        if expected != set(found):
            raise RuntimeError(
                f"ddpatch: the config declares linear-attention layers {sorted(expected)} but the model has "
                f"`linear_attn` modules at {sorted(found)}; this layout is not supported."
            )
    info = tuple(sorted(found.items()))
    try:
        _MODEL_INFO[model] = info
    except TypeError:  # not weak-referenceable: just don't cache
        pass
    return info


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


def _get_record(cache) -> _Record | None:
    return getattr(cache, _RECORD_ATTR, None)


def _set_record(cache, record: _Record | None) -> None:
    setattr(cache, _RECORD_ATTR, record)


def _pending_record(cache) -> _Record | None:
    """The cache's record if it still awaits a commit and still describes the cache."""
    record = _get_record(cache)
    if record is None or record.settled is not None:
        return None
    if int(cache.get_seq_length()) != record.past_len + record.length:
        # Something else ran on (or cropped) this cache after the verify: the record is stale.
        _set_record(cache, None)
        return None
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
    if TREE_STRATEGY not in ("auto", "node", "path"):
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
    modules = hybrid_linear_modules(model) if cache is not None else ()
    if not modules:
        return model(*args, **kwargs)
    layers = _layers(cache)
    if layers is None or any(i >= len(layers) or not _is_linear_layer(layers[i]) for i, _ in modules):
        _warn_once(
            cache,
            "ddpatch: the target cache has no transformers 5.x linear-attention layers (build it with "
            "DynamicCache(config=target.config)); the Gated DeltaNet state cannot be rolled back.",
        )
        return model(*args, **kwargs)

    previous = _get_record(cache)
    if previous is not None and previous.mode == "tree" and previous.settled is None:
        _warn_once(cache, "ddpatch: a tree verify was never committed; the Gated DeltaNet state is stale.")
    _set_record(cache, None)  # a chain record left uncommitted means "all kept": nothing to do

    mask = kwargs.get("attention_mask")
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
        replacements = [(module, make(module.forward, module, layer_idx, cache, record)) for layer_idx, module in modules]
        with _swapped_forwards(replacements):
            output = model(*args, **kwargs)
        _set_record(cache, record)  # only after a forward that completed
        return output

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
        output = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    _set_record(cache, record)
    return output


# --------------------------------------------------------------------------------------------
# Commit
# --------------------------------------------------------------------------------------------


def _replay(cache, record: _Record, index: torch.Tensor | int) -> None:
    """Run each GDN module on the kept captured inputs, with the real cache."""
    for layer_idx, module in record.modules:
        hidden, mask = record.inputs[layer_idx]
        if isinstance(index, int):
            hidden = hidden[:, :index]
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                mask = mask[:, :index]
        else:
            hidden = hidden.index_select(1, index.to(hidden.device))
            mask = None
        module(hidden_states=hidden, cache_params=cache, attention_mask=mask)


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


def _crop_attention(cache, drop: int) -> None:
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
        layer.crop(-drop)  # negative = tokens to drop, legal on every version


def crop_cache(cache, length: int) -> None:
    """Legacy crop: ``length >= 0`` keeps the first ``length`` tokens, ``length < 0`` drops ``-length``.

    Attention layers are cropped. GDN layers are committed exactly when a verify was
    recorded; otherwise they are left as they are, with one RuntimeWarning per cache when
    tokens were dropped.
    """
    length = int(length)
    if _layers(cache) is None:
        # transformers 4.x: crop accepts the legacy positive length (and negatives).
        cache.crop(length)
        return
    linear = _linear_layer_ids(cache)
    record = None
    if linear:
        record = _pending_record(cache) or _get_record(cache)  # pending, or settled by a commit
    current = int(cache.get_seq_length())
    new_len = length if length >= 0 else current + length
    new_len = max(0, min(new_len, current))
    drop = current - new_len

    if not linear:
        if drop > 0:
            cache.crop(-drop)
        return

    _crop_attention(cache, drop)
    if record is None:
        if drop > 0:
            _warn_once(cache)
        return
    _set_record(cache, None)
    if record.settled is not None:
        if new_len != record.settled:
            _warn_once(
                cache,
                f"ddpatch: cropped to {new_len} tokens but the Gated DeltaNet state was committed for "
                f"{record.settled}; the output may diverge.",
            )
        return
    keep = new_len - record.past_len
    if keep < 0:
        # Cropped below the verify window: the snapshot is the closest exact state we have.
        _commit(cache, record, [])
        _warn_once(
            cache, "ddpatch: cropped below the recorded verify; the Gated DeltaNet state was not rolled back further."
        )
        return
    if record.mode == "tree":
        parents = record.plan.parents
        if any(parents[i] != i - 1 for i in range(1, keep)):
            # The first `keep` nodes are no path: only a compaction knows which nodes to keep.
            _warn_once(
                cache,
                "ddpatch: a tree verify was cropped without its accepted path "
                "(use compact_cache or @tree_commit); the output may diverge.",
            )
            return
    _commit(cache, record, list(range(keep)))


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
