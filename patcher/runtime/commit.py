"""Commit a recorded verify: crop_cache, compact_cache, @tree_commit, and the one cut every crop goes through."""

from __future__ import annotations

import functools
import inspect

import torch

from .caches import _cache_length, _crop_keys, _is_linear_layer, _kv_tensors, _layers, _linear_count, _linear_layer_ids, _restore, _set_linear_count, _shift_linear_count, _state_context
from .discovery import _cache_kwargs
from .windows import _compact_keyed_layers, _hide_layers
from .errors import _uncertain
from .record import _Record, _get_record, _pending_record, _set_record, _warn_once
from .fastcommit import _fast_commit


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
        extra = {"attention_mask": mask} if _takes_a_mask(module) else {}  # Zaya's conv mixer takes none
        module(hidden_states=hidden, **extra, **_cache_kwargs(module, cache))


def _takes_a_mask(module) -> bool:
    """Whether the mixer's forward takes ``attention_mask`` (by name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return True
    return "attention_mask" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


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
    # 5.25+ linear layers count tokens, and a commit leaves the count as it was: it stays the
    # verify's length until the cut that follows (upstream reads it through get_seq_length()).
    counts = {i: _linear_count(cache.layers[i]) for i, _ in record.modules}
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
            if n:
                # The real state was not touched by the tree verify: replay the path from it.
                # built once, on the device the plan lives on: each layer's index_select finds it there
                _replay(cache, record, torch.tensor(keep, device=record.plan.path_index.device))
    for layer_idx, count in counts.items():
        _set_linear_count(cache.layers[layer_idx], count)
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
            _shift_linear_count(layer, -drop)
            _crop_keys(layer, drop)  # combined linear + attention layer: crop only its attention part
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
                layer.conv_states[k] = conv[..., -kernel:].contiguous()


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
            f"ddpatch: the {record.owner} cache was cut back {drop} tokens, below the start of the recorded verify "
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
    current = _cache_length(cache)
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
    current = _cache_length(cache)
    new_len = length if length >= 0 else current + length
    new_len = max(0, min(new_len, current))
    _cut(cache, current - new_len)


def _compact_attention(cache, past_length: int, keep: list[int]) -> None:
    """Move the kept verify-window entries of every K/V tensor to the front of the window."""
    if not keep:
        return
    indices: dict = {}  # one index per device and round, not one host-to-device copy per tensor
    for tensor in _kv_tensors(cache):
        if tensor.dim() < 2 or tensor.shape[-2] <= past_length:
            continue
        index = indices.get(tensor.device)
        if index is None:
            index = indices[tensor.device] = torch.tensor(keep, device=tensor.device)
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
                    _set_record(cache, None)
                    _uncertain(
                        f"ddpatch: compaction at past length {int(past_length)} but the verify started at "
                        f"{record.past_len}, so the kept indices cannot be matched to the verified tokens"
                    )
                    return fn(*args, **kwargs)
                _commit(cache, record, _as_index_list(bound.arguments[keep_arg]))
            done = {}
            if _layers(cache) is not None and bound.arguments[past_length_arg] is not None:
                keep = _as_index_list(bound.arguments[keep_arg])
                done = _compact_keyed_layers(cache, int(bound.arguments[past_length_arg]), keep)
            with _hide_layers(cache, done):
                return fn(*args, **kwargs)

        return wrapper

    return decorate

