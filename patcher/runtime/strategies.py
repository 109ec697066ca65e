"""Generic tree strategies (node-recurrent, path-batched) on a scratch state, and swapped forwards."""

from __future__ import annotations

from typing import Callable

import torch

from . import options
from .caches import _kernel_size, _real_state
from .tree import _TreePlan
from .record import _Record
from .routing import _swapped_forwards  # noqa: F401 (re-exported: where the forwards are swapped)


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

    def increase_count(self, layer_idx=None, state_idx=0):  # 5.25: a scratch state counts nothing
        pass

    def get_recurrent_states_to_keep(self, layer_idx=None):  # 5.25: no intermediate states
        return 0


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


def _use_path_batched(plan: _TreePlan, device) -> bool:
    if options.TREE_STRATEGY not in ("auto", "node", "path", "onepass"):
        raise ValueError(f"ddpatch: unknown options.TREE_STRATEGY {options.TREE_STRATEGY!r}")
    if options.TREE_STRATEGY != "auto":
        return options.TREE_STRATEGY == "path"
    if torch.device(device).type == "cuda":
        return True
    # CPU fallback costs, measured: a path row ~0.65x of a single-token module call.
    return plan.n_paths <= 1.5 * plan.path_len



