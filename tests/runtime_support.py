"""What the runtime tests share: seeded tiny targets, a prefill, and DDTree-style tree masks.

Each runtime test compares a cache after a verify/commit with a from-scratch run; these are
the pieces every such comparison builds on (``tests/test_runtime.py``,
``tests/test_cache_commit.py``, ``tests/test_fastpath.py``).
"""

from __future__ import annotations

import functools

import pytest
import torch

from patcher.verify.models.presets import build_target

ATOL, RTOL = 1e-5, 1e-4
VOCAB_DRAW = 60  # token ids drawn below the presets' mask token


@functools.lru_cache(maxsize=None)
def model(name):
    return build_target(name, seed=0)


def prefill(m, prompt, record_past: bool = False):
    """A config-built cache that ran ``prompt`` (optionally recording its past, as DFlash's newer code does)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=m.config)
    if record_past:
        cache.activate_past_recording()
        for layer in cache.layers:  # 5.25 leaves None, which its own GDN forward cannot compare
            if getattr(layer, "recurrent_states_to_keep", 0) is None:
                layer.recurrent_states_to_keep = 0
    with torch.no_grad():  # a shared model may hold inference-mode tensors from earlier tests; nothing here needs grad
        m(prompt, past_key_values=cache, use_cache=True)
    return cache


def tree_mask(parents, past, dtype=torch.float32):
    """DDTree-style additive mask: each node sees the prefix, its ancestors and itself."""
    L = len(parents)
    mask = torch.full((1, 1, L, past + L), torch.finfo(dtype).min, dtype=dtype)
    mask[..., :past] = 0
    for i in range(L):
        j = i
        while j >= 0:
            mask[0, 0, i, past + j] = 0
            j = parents[j]
    return mask


def path_to(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def depths(parents):
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP spinning makes
    them several times slower; the setting is restored for other test modules. Import it into a
    test module to use it there."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
