"""Gated DeltaNet fast path: the kernel wrappers and what they capture.

For a GDN module whose forward calls its modeling file's kernel functions by global name
(transformers' Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Olmo-Hybrid, Qwen4-Exp layouts), a verify
wraps those functions -- ``*chunk_gated_delta_rule``, ``*recurrent_gated_delta_rule``,
``causal_conv1d_fn`` and ``causal_conv1d_update`` -- for the duration of the verify (they act
only inside this thread's GDN module calls), and keeps what the recurrence consumed.
Projections, norms and out-projections run once, in the module's own code; nothing of the
module is re-run at commit time.

* chain: the module runs as is (its own kernels, fla's when installed). The wrappers keep
  references to the kernel's inputs (q, k, v, g, beta) and to the conv's pre-conv inputs.
  The commit puts the snapshot back, appends the kept pre-conv inputs to the conv window
  through the cache's own ``update_conv_state`` (so past recording keeps its meaning), and
  replays only the delta rule over the kept prefix: on CPU with a closed form computed from
  k, v, g, beta (``_delta_rule`` below, no output, no padding), elsewhere with the module's
  own kernel on the prefix (one fused fla call on a GPU).
* tree: the module runs ONCE over the flat tree with a read-only view of the real state.
  The conv wrapper gives each node the window of its nearest ancestors, then the committed
  window (the windows laid end to end through the module's own conv function), and the kernel
  wrapper runs the delta rule over the whole tree in one chunk with an ancestor mask and
  path-cumulative decay: exact for every node, no node run twice. The commit of the
  accepted path is the closed form from the tree's own delta-corrected values.
* commit: all fast layers at once, stacked along the batch axis (see "commit" below).

The closed form: with G the cumulative log decay along a path, u the delta-corrected values
(solved from ``(I + A) u = beta * (v - e^G k S0)``, A[i, j] = beta_i (k_i . k_j) e^(G_i - G_j)
for ancestors j of i), the state after node a is ``e^G_a S0 + sum_j e^(G_a - G_j) k_j u_j^T``
over j on the path to a, and a node's output is ``e^G_i q_i S0 + sum_j e^(G_i - G_j) (q_i . k_j) u_j``.

Anything unexpected (a class whose forward calls other names, a kernel or conv called a
different number of times) falls back to the generic module replay / tree strategies above.
Only what a class's forward calls is decided once per class (``_FAST_KERNELS``, from its code);
a capture that comes out incomplete falls back for that call alone, so no call of one verify
changes how a later verify runs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from typing import Any, Callable

import torch

from . import options
from .discovery import _cache_keyword, _names_a_cache, _raw_function
from .tree import _TreePlan, _tree_ancestors, _tree_taps
from .deltarule import _delta_rule


_fast_local = threading.local()


_fast_lock = threading.Lock()


_fast_installed: dict = {}  # (id of the modeling namespace, name) -> [users, original, wrapper]


#: class -> (namespace, {name: kind}) of the kernels its forward calls, or None: decided from the code alone
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
        names = {}
        for n in code.co_names:
            target = namespace.get(n)
            if not (_fast_kind(n) and callable(target)):
                continue
            helper = _cache_helper_code(target, namespace)
            if helper is None:
                names[n] = _fast_kind(n)
            else:  # 5.25's causal_conv1d_forward(conv1d, x, cache, ...): wrap the kernels it calls
                names.update({h: "conv" for h in helper.co_names if _fast_kind(h) == "conv" and callable(namespace.get(h))})
        kinds = set(names.values())
        if kinds == {"kernel", "conv"} and _cache_keyword(module) is not None:
            info = (namespace, names)
    _FAST_KERNELS[cls] = info
    return info


def _cache_helper_code(function, namespace):
    """The code of a modeling-file helper that takes the cache itself (5.25's
    ``causal_conv1d_forward``), when it reads the kernels from the same namespace; else None."""
    raw = _raw_function(function, namespace)
    code = getattr(raw, "__code__", None)
    if code is None:
        return None
    try:
        parameters = inspect.signature(raw).parameters.values()
    except (TypeError, ValueError):
        return None
    return code if any(_names_a_cache(p.annotation) or p.name in ("cache", "cache_params") for p in parameters) else None


def _fast_enabled(module) -> bool:
    return options.GDN_FAST_PATH and _fast_gdn_kernels(module) is not None


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
    if options.GDN_FAST_PATH:
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


def _chain_conv(capture: _FastCapture, original, args, kwargs):
    x = args[0] if args else kwargs["hidden_states"]
    capture.conv_inputs = x[..., -capture.seq_len :]  # after the cached window, if any
    return original(*args, **kwargs)


def _chain_kernel(capture: _FastCapture, original, args, kwargs):
    capture.kernel = (original, args, dict(kwargs))
    capture.arguments = _kernel_arguments(original, args, kwargs)
    return original(*args, **kwargs)


def _tree_conv(capture: _FastCapture, original, args, kwargs):
    args = list(args)
    full = args[0] if args else kwargs["hidden_states"]  # [B, C, kernel + N], from _TreeStateView
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    kernel, n = int(weight.shape[-1]), capture.seq_len
    capture.conv_inputs = full[..., -n:]
    taps = _tree_taps(capture.plan, kernel, full.device)
    # Every node's window laid out one after the other: the module's own (causal) conv function,
    # activation included, gives at the last column of each window exactly that node's output.
    windows = full[:, :, taps.reshape(-1)]  # [B, C, N * kernel]
    if args:
        args[0] = windows
    else:
        kwargs["hidden_states"] = windows
    return original(*args, **kwargs)[..., kernel - 1 :: kernel]


def _tree_kernel(capture: _FastCapture, original, args, kwargs):
    a = _kernel_arguments(original, args, kwargs)
    value = a["value"]
    out, k, u, G = _delta_rule(
        a["key"], value, a["g"], a["beta"], a.get("initial_state"), _tree_ancestors(capture.plan, a["key"].device),
        query=a["query"], l2norm=bool(a.get("use_qk_l2norm_in_kernel", False)), scale=a.get("scale"),
    )
    s0 = a.get("initial_state")
    capture.tree = (k, u, G, None if s0 is None else s0.float())
    return out.transpose(1, 2).to(value.dtype).contiguous(), None

