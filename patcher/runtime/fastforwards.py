"""Gated DeltaNet fast path: the module forwards a verify installs (chain capture, one-pass tree)."""

from __future__ import annotations

from typing import Callable

import torch

from . import options
from .caches import _kernel_size, _real_state
from .record import _Record
from .routing import _own_forward
from .strategies import _node_recurrent_forward
from .fastpath import _FastCapture, _fast_capturing, _fast_enabled


def _fast_chain_forward(original: Callable, module, layer_idx: int, record: _Record) -> Callable:
    def forward(hidden_states, *args, **kwargs):
        capture = _FastCapture("chain", int(hidden_states.shape[1]), int(module.conv_kernel_size))
        with _fast_capturing(capture):
            output = original(hidden_states, *args, **kwargs)
        if capture.complete:
            record.fast[layer_idx] = capture  # else: the generic replay of the captured input
        return output

    return forward


def _fast_chain_replacements(modules, record: _Record) -> list:
    return [
        (module, _fast_chain_forward(_own_forward(module), module, layer_idx, record))
        for layer_idx, module in modules
        if _fast_enabled(module)
    ]


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

    def increase_count(self, layer_idx=None, state_idx=0):
        pass

    def get_recurrent_states_to_keep(self, layer_idx=None):
        return 0


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
        # The module did not call its kernels the way this path expects, this time: the generic strategy for this
        # call. The class keeps its fast path: one incomplete capture (a forward that took another branch, a kernel
        # wrapped by someone else for a while) says nothing about the next call, and a class-wide switch would make
        # every later tree verify of the process depend on it.
        generic = _node_recurrent_forward(original, module, layer_idx, cache, record)
        return generic(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)

    return forward


def _tree_fast_or(make: Callable, module) -> Callable:
    """The tree forward builder for ``module``: one pass where possible and chosen, else ``make``."""
    return _fast_tree_forward if options.TREE_STRATEGY in ("auto", "onepass") and _fast_enabled(module) else make

