"""ddpatch runtime: lossless speculative-decoding verify/commit for hybrid Gated DeltaNet targets.

This package is copied verbatim into patched upstream trees (as the folder ``_ddpatch_runtime/``,
with a version stamp in ``MANIFEST.json``), so it imports nothing but the standard library,
``torch`` and (lazily, inside functions) ``transformers``. Its modules import one another
relatively and one way: options, errors, caches, discovery, windows, probes, tree, record,
deltarule, strategies, fastpath, fastforwards, fastcommit, commit, ownership, adopt, verify, draft (and timing, which
imports none of them).
Settings live in ``options``; setting them on this package (``TREE_STRATEGY = ...``) is
forwarded there, so they reach every module.

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

import sys
import types

from . import options
from .adopt import adopt_cache, adopt_forward
from .caches import _layers, record_past
from .commit import _commit, _cut, compact_cache, crop_cache, tree_commit
from .deltarule import _causal, _closed_form_state, _delta_rule
from .discovery import _cache_keyword, _cache_kwargs, _cache_of, _layer_kinds, hybrid_linear_modules
from .draft import draft_forward
from .errors import UnsupportedModelError
from .legacy import from_legacy_cache, legacy_layer, to_legacy_cache
from .fastcommit import _chain_replay_mode, _fast_commit
from .fastpath import (
    _FAST_KERNELS,
    _FastCapture,
    _fast_capturing,
    _fast_enabled,
    _fast_gdn_kernels,
    _fast_installed,
    _fast_kernels_for,
)
from .ownership import _own_crop
from .probes import _MASK_PROBED, _check_mask_honoured
from .record import _get_record, _pending_record, _Record, _set_record
from .strategies import _use_path_batched
from .timing import cuda_event
from .tree import _tree_ancestors, _tree_plan, _tree_taps, tree_parents_from_mask
from .verify import verify_forward

__all__ = [
    "MIN_TRANSFORMERS",
    "TREE_STRATEGY",
    "UnsupportedModelError",
    "adopt_cache",
    "adopt_forward",
    "compact_cache",
    "crop_cache",
    "cuda_event",
    "draft_forward",
    "from_legacy_cache",
    "hybrid_linear_modules",
    "legacy_layer",
    "options",
    "record_past",
    "tree_commit",
    "to_legacy_cache",
    "tree_parents_from_mask",
    "verify_forward",
]


def __getattr__(name):
    if name in options.SETTINGS:
        return getattr(options, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Settings(types.ModuleType):
    """Setting ``TREE_STRATEGY`` (or any name in ``options.SETTINGS``) on the package sets it in ``options``."""

    def __setattr__(self, name, value):
        if name in options.SETTINGS:
            setattr(options, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name):
        if name not in options.SETTINGS:
            super().__delattr__(name)


sys.modules[__name__].__class__ = _Settings
