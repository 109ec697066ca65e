"""Gated DeltaNet fast path, commit.

All fast layers are committed together: layers with the same dimensions are stacked along
the batch axis, so the commit costs the same few operations (GPU: the same few launches)
whatever the number of layers. Each layer's results are then written through the cache's
own ``update_conv_state`` / ``update_recurrent_state``."""

from __future__ import annotations

import inspect

import torch

from . import options
from .record import _Record
from .deltarule import _causal, _closed_form_state, _delta_rule
from .fastpath import _FastCapture, _KERNEL_ARGS


def _chain_replay_mode(device) -> str:
    if options.GDN_CHAIN_REPLAY not in ("auto", "closed", "kernel"):
        raise ValueError(f"ddpatch: unknown options.GDN_CHAIN_REPLAY {options.GDN_CHAIN_REPLAY!r}")
    if options.GDN_CHAIN_REPLAY != "auto":
        return options.GDN_CHAIN_REPLAY
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

