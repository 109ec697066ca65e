"""verify_forward: a target forward that leaves a record a lossless commit needs."""

from __future__ import annotations


import torch

from .caches import _cache_length, _is_linear_layer, _layers, _linear_layer_ids, _linear_count, _set_linear_count, _snapshot
from .discovery import _cache_of, _call_kwargs, _keyword_adapted, _model_type, hybrid_linear_modules
from .errors import UnsupportedModelError, _uncertain
from .routing import _one_verify, _own_forward, _swapped_forwards
from .windows import _record_window_past, _shrink_recorded, _windowed_mask_forwards
from .probes import _check_mask_honoured, _checked_hidden_states
from .tree import _tree_plan, tree_parents_from_mask
from .record import _Record, _check_settled, _pending_record, _set_record
from .strategies import _node_recurrent_forward, _path_batched_forward, _use_path_batched
from .fastpath import _fast_kernels_for
from .fastforwards import _fast_chain_replacements, _tree_fast_or
from .commit import _commit_for_drop
from .ownership import _own_crop
from .adopt import adopt_cache


def verify_forward(model, *args, **kwargs):
    """``model(*args, **kwargs)``, recording what a lossless commit of a hybrid target needs.

    The record is attached to the cache passed (``past_key_values=`` or ``cache=``);
    ``crop_cache``, ``compact_cache`` or a ``@tree_commit`` function commits it. A 4D
    ``attention_mask`` means a tree verify. Another thread's verify of the same model raises.
    ``past_key_values=`` reaches a model whose forward takes ``cache=`` (transformers 5.24+) as ``cache=``.
    """
    kwargs = _call_kwargs(model, kwargs)
    _, cache = _cache_of(kwargs)
    windowed_call = kwargs.pop("_ddpatch_windowed", False)
    with _one_verify(_shared_with(model)):
        adopt_cache(model, cache)  # a cache built without a config gets this model's layout before any state is written
        given_mask = kwargs.get("attention_mask")
        if cache is not None and _layers(cache) is not None and not windowed_call:
            _record_window_past(cache)
            if isinstance(given_mask, torch.Tensor) and given_mask.dim() == 4:
                windowed = _windowed_mask_forwards(model, cache, given_mask, kwargs)
                _check_mask_honoured(model, given_mask)
                if windowed:  # sliding layers: each gets its windowed tree mask, the rest as given
                    with _swapped_forwards(windowed):
                        return verify_forward(model, *args, _ddpatch_windowed=True, **kwargs)
        modules = hybrid_linear_modules(model) if cache is not None else ()
        if not modules:
            if cache is not None and _linear_layer_ids(cache):
                _uncertain(
                    f"ddpatch: the cache holds linear-attention layers {_linear_layer_ids(cache)}, but ddpatch finds no "
                    f"stateful layer in {_model_type(model)}'s config (no layer_types?), so this verify cannot be "
                    "rolled back exactly"
                )
            return _checked_hidden_states(model, model(*args, **kwargs))
        layers = _layers(cache)
        if layers is None or any(i >= len(layers) or not _is_linear_layer(layers[i]) for i, _ in modules):
            _uncertain(
                "ddpatch: the target cache has no transformers 5.x linear-attention layers (build it with "
                "DynamicCache(config=target.config)); the Gated DeltaNet state cannot be rolled back"
            )
            return model(*args, **kwargs)
        return _recorded_verify(model, cache, modules, args, kwargs)


def _shared_with(model):
    """What a verify of ``model`` holds while it runs: its first stateful mixer, which a full model shares with its
    backbone (``target.model``, ``get_decoder()``), so that a verify of one in another thread is refused too; the
    model itself where it has none."""
    try:
        modules = hybrid_linear_modules(model)
    except UnsupportedModelError:
        return model  # refused below, in this thread
    return modules[0][1] if modules else model


def _recorded_verify(model, cache, modules, args, kwargs):
    _own_crop(cache)
    mask = kwargs.get("attention_mask")
    tokens = args[0] if args else kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    length = int(tokens.shape[1])
    is_tree = isinstance(mask, torch.Tensor) and mask.dim() == 4
    previous = _pending_record(cache)  # raises when the cache was cut back without a commit
    if previous is not None:
        if not is_tree and _spans(cache, previous, modules, length):
            return _extended_verify(model, cache, previous, modules, length, args, kwargs)
        # Never cut back: every verified token was kept. Exact for a chain, and for a tree only
        # when the tree is a single path.
        _commit_for_drop(cache, previous, 0)
    _shrink_recorded(cache)  # the verify before this one is committed: what past recording kept for it can go
    _check_settled(cache)  # a committed record must still match the cache's length
    _set_record(cache, None)
    past_len = _cache_length(cache)

    if is_tree:
        parents = tree_parents_from_mask(mask)
        if len(parents) != length:
            raise ValueError(f"ddpatch: mask has {len(parents)} query rows for {length} verify tokens")
        record = _Record("tree", past_len, length, modules, plan=_tree_plan(parents, tokens.device), inflight=True,
                         owner=getattr(cache, _OWNER_ATTR, "target"))
        record.counts = {i: _linear_count(cache.layers[i]) for i, _ in modules}
        make = _path_batched_forward if _use_path_batched(record.plan, tokens.device) else _node_recurrent_forward
        replacements = [
            (module, _keyword_adapted(_tree_fast_or(make, module))(_own_forward(module), module, layer_idx, cache, record))
            for layer_idx, module in modules
        ]
        _set_record(cache, record)  # in flight: a forward that raises leaves a record no commit accepts
        with _swapped_forwards(replacements), _fast_kernels_for(modules):
            output = model(*args, **kwargs)
        for i, count in record.counts.items():  # as a plain forward leaves it: the tree's tokens counted
            _set_linear_count(cache.layers[i], None if count is None else count + length)
        record.inflight = False
        return _checked_hidden_states(model, output)

    record = _Record("chain", past_len, length, modules, inflight=True, owner=getattr(cache, _OWNER_ATTR, "target"))
    record.counts = {i: _linear_count(cache.layers[i]) for i, _ in modules}
    record.snapshot = {i: _snapshot(cache, i) for i, _ in modules}
    fast = dict(_fast_chain_replacements(modules, record))
    replacements = [(module, _capturing(fast.get(module) or _own_forward(module), record, i)) for i, module in modules]
    _set_record(cache, record)  # in flight: a forward that raises leaves a record no commit accepts
    with _swapped_forwards(replacements), _fast_kernels_for(modules):
        output = model(*args, **kwargs)
    record.inflight = False
    return _checked_hidden_states(model, output)


def _capturing(forward, record: _Record, layer_idx: int):
    """``forward``, keeping its input for a generic replay at commit time."""

    def capture(*args, **kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        record.inputs[layer_idx] = (hidden, kwargs.get("attention_mask"))
        return forward(*args, **kwargs)

    return capture


#: Set on a cache by its caller (``patcher.lossless`` for an assistant model): how many tokens one record may
#: span across forwards, and whose cache it is (for the messages). transformers' assisted loop cuts an
#: assistant's cache back across several of its own drafting forwards, not only within the last one.
_SPAN_ATTR, _OWNER_ATTR = "_ddpatch_span", "_ddpatch_owner"


def _spans(cache, record: _Record, modules, length: int) -> bool:
    """Whether this forward extends ``record`` instead of committing it: a chain on a cache that asks for it."""
    span = getattr(cache, _SPAN_ATTR, 0)
    return bool(span) and record.mode == "chain" and record.length + length <= span and record.modules == tuple(modules)


def _extended_verify(model, cache, record: _Record, modules, length: int, args, kwargs):
    """Run the forward with ``record`` still pending: its inputs are appended to the record's, so that a
    later cut anywhere in the span restores the snapshot from the span's start and replays the kept tokens."""
    scratch = _Record("chain", record.past_len, length, modules)
    record.inflight = True  # a forward that raises leaves a record no commit accepts
    record.fast.clear()  # the fast path's captures cover the first forward only: the generic replay
    with _swapped_forwards([(module, _capturing(_own_forward(module), scratch, i)) for i, module in modules]):
        output = model(*args, **kwargs)
    for i, _ in modules:
        if i in record.inputs and i in scratch.inputs:
            record.inputs[i] = _joined(record.inputs[i], scratch.inputs[i])
        else:
            record.inputs.pop(i, None)  # the commit then raises: it never reached this layer
    record.length += length
    record.inflight = False
    return _checked_hidden_states(model, output)


def _joined(first, second):
    """Two captured (hidden, mask) inputs laid end to end; a 2D padding mask of None means no padding."""
    (h0, m0), (h1, m1) = first, second
    masks = [m if isinstance(m, torch.Tensor) else None for m in (m0, m1)]
    if any(m is not None and m.dim() != 2 for m in masks):
        masks = [None, None]
    if all(m is None for m in masks):
        return torch.cat([h0, h1], dim=1), None
    ones = [m if m is not None else torch.ones(h.shape[:2], dtype=torch.long, device=h.device) for m, h in zip(masks, (h0, h1))]
    return torch.cat([h0, h1], dim=1), torch.cat([ones[0].to(ones[1].dtype), ones[1]], dim=1)
