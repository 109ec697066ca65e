"""The runtime's guards: a keep that the recorded verify cannot mean raises, it is never committed.

A commit of a verify window keeps a *prefix* of a chain verify, or a *root-to-node path* of a
tree verify. Anything else (``[0, 2]`` of a chain, ``[0, 1, 4]`` where 4 is not 1's child)
has no exact state to commit: the runtime must raise, not pick some branch silently. The
positive side (a sibling branch, not the first child, is committed exactly) is checked too,
so that a guard that refuses every tree keep cannot pass here either.

``benchmarks/mutants.py --group guards`` deletes each guard and runs this file.
Only public runtime names are used (``rt.verify_forward``, ``rt.compact_cache``, ``rt.crop_cache``).
"""

from __future__ import annotations

import pytest
import torch

from runtime_support import ATOL, RTOL, depths, model, one_thread, path_to, prefill, tree_mask  # noqa: F401 (fixture)

from patcher import runtime as rt

NAME = "tiny-qwen3_5"
PARENTS = [-1, 0, 0, 1, 2]  # 1 and 2 are siblings; 3 under 1, 4 under 2
PAST = 5


def _tree_verified(parents=PARENTS):
    m = model(NAME)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 60, (1, PAST), generator=gen)
    block = torch.randint(0, 60, (1, len(parents)), generator=gen)
    cache = prefill(m, prompt)
    rt.verify_forward(m, block, position_ids=(PAST + torch.tensor(depths(parents)))[None],
                      attention_mask=tree_mask(parents, PAST), past_key_values=cache, use_cache=True)
    return m, prompt, block, cache


def _chain_verified(n=4):
    m = model(NAME)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 60, (1, PAST), generator=gen)
    block = torch.randint(0, 60, (1, n), generator=gen)
    cache = prefill(m, prompt)
    rt.verify_forward(m, block, position_ids=torch.arange(PAST, PAST + n)[None], past_key_values=cache, use_cache=True)
    return m, prompt, block, cache


def _next_logits(m, cache, length, token):
    return m(token, past_key_values=cache, use_cache=True, position_ids=torch.tensor([[length]])).logits


@pytest.mark.parametrize("keep", [[0, 1, 4], [0, 2, 3], [1, 3], [0, 3], [0, 1, 2]])
def test_a_tree_keep_that_is_not_a_root_to_node_path_raises(keep):
    """M1: ``compact_cache(cache, 5, [0, 1, 4])`` on a tree verify (4 is 2's child, not 1's)
    would commit a branch that no draft proposed. It must raise before anything is committed."""
    with torch.inference_mode():
        _, _, _, cache = _tree_verified()
        with pytest.raises(ValueError, match="not a root-to-node path"):
            rt.compact_cache(cache, PAST, keep)


@pytest.mark.parametrize("keep", [[0, 2], [1], [1, 2, 3], [0, 1, 3]])
def test_a_chain_keep_that_is_not_a_prefix_raises(keep):
    """M2: a chain verify's state can only be rolled back to a prefix of the block."""
    with torch.inference_mode():
        _, _, _, cache = _chain_verified()
        with pytest.raises(ValueError, match="can only keep a prefix"):
            rt.compact_cache(cache, PAST, keep)


@pytest.mark.parametrize("node", [4, 2, 3])
def test_a_sibling_branch_is_committed_exactly(node):
    """The guard's other side: a path through the *second* child (``[0, 2, 4]``) is a legal keep and
    ends exactly where a from-scratch run of prompt + that path ends (next-step logits compared)."""
    keep = path_to(PARENTS, node)
    with torch.inference_mode():
        m, prompt, block, cache = _tree_verified()
        rt.compact_cache(cache, PAST, keep)
        assert cache.get_seq_length() == PAST + len(keep)
        ref = prefill(m, torch.cat([prompt, block[:, keep]], 1))
        token = torch.tensor([[7]])
        got = _next_logits(m, cache, PAST + len(keep), token)
        want = _next_logits(m, ref, PAST + len(keep), token)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        # and it is not the first child's branch: committing [0, 1, 3] gives other logits
        first = prefill(m, torch.cat([prompt, block[:, path_to(PARENTS, 3 if node != 3 else 4)]], 1))
        other = _next_logits(m, first, PAST + 3, token)
        assert not torch.allclose(got, other, atol=1e-3), "the two branches are indistinguishable: the test cannot fail"


def test_a_tree_cut_back_below_the_verify_start_raises():
    with torch.inference_mode():
        _, _, _, cache = _chain_verified()
        with pytest.raises(RuntimeError, match="below the start of the recorded verify"):
            rt.crop_cache(cache, PAST - 1)
