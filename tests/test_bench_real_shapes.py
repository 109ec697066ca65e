"""The real-shapes benchmark's own parts (issue 43, item 6).

- ``--profile`` times the verifier's steps by name: a step renamed or moved in ``patcher.verify`` would silently drop
  out of the profile (it did once, when verify became floors). Every name it times must be found, and its judged
  profile checks its options as ``ddpatch verify --draft`` does.
- ``--judged`` judges a pair whose drafter predicts, set by hand (``real_shapes_copy_pair.py``): checked here at small
  sizes, where it builds in seconds.

The figures live in the benchmark (docs/performance.md).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from patcher.verify.child import worker
from patcher.verify.process.runner import VerifyError, child_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_real_shapes", ROOT / "benchmarks" / "bench_real_shapes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_real_shapes", module)
    spec.loader.exec_module(module)
    return module


def test_every_profiled_step_is_found(bench):
    missing = []
    for module_name, path in bench.PROFILED:
        try:
            holder = worker.sibling(module_name)
        except ImportError:
            missing.append(f"{module_name} (no such module)")
            continue
        for part in path.split("."):
            holder = getattr(holder, part, None)
            if holder is None:
                missing.append(f"{module_name}.{path}")
                break
    assert not missing, f"steps the profile would list as absent: {missing}"
    names = {m for m, _ in bench.PROFILED}
    assert {"judge.acceptance.pair_reference", "judge.acceptance.verdict", "models.load"} <= names  # the judged path's own steps


def test_the_judged_profile_checks_its_options_as_verify_does(bench, tmp_path):
    """``child_config`` is ``run_verify``'s own checking: a drafter folder that is not there is the user's error."""
    with pytest.raises(VerifyError, match="does not exist"):
        child_config(ROOT / "vendored" / "ddtree", target=str(tmp_path / "none"), draft=str(tmp_path / "none"),
                     **bench.JUDGED_OPTIONS)


@pytest.fixture(scope="module")
def copy_pair(tmp_path_factory):
    """``real_shapes_copy_pair`` at small sizes (hidden 512, vocab 4,096): seconds, not the real 8 GB."""

    spec = importlib.util.spec_from_file_location("real_shapes_copy_pair", ROOT / "benchmarks" / "real_shapes_copy_pair.py")
    pair = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pair)
    root = tmp_path_factory.mktemp("copy-pair")
    tree = root / "tree"
    import subprocess

    subprocess.run([sys.executable, "-m", "patcher", "apply", str(ROOT / "vendored" / "ddtree"), "--out", str(tree)],
                   check=True, cwd=ROOT, capture_output=True)
    info = pair.build_copy_target(root / "target", pair.SMALL_VOCAB, 4, 0, 10.0, pair.SMALL, penalty=4.0, spread=1.0, recency=0.0)
    pair.build_copy_drafter(root / "draft", tree, info, 0)
    target, draft = pair.load_pair(root / "target", root / "draft", tree)
    return pair, info, target.float(), draft.float()


def test_the_copy_pairs_drafter_proposes_the_anchor_at_every_block_position(copy_pair):
    """The hand-set drafter predicts: at every start of a prompt it proposes the round's anchor token at each of the
    block's 15 positions (through the target's LM head, which holds the embedding's values), so a round accepts the
    rest of the target's run of that token. A random drafter would propose it at about 1 position in 4,096."""
    from patcher.verify.judge.acceptance.reference_decode import ScratchPair

    pair, info, target, draft = copy_pair
    scratch = ScratchPair(target, draft, info["mask_token_id"], draft.block_size)
    seq = pair.prompts(info["vocab"], 1, 12, 3)[0]
    for s in (4, 8, 11):
        proposals = scratch.draft_logits(seq, s).argmax(-1).tolist()
        assert proposals == [seq[s]] * (draft.block_size - 1), (s, seq[s], proposals)
    w = target.get_input_embeddings().weight.detach()
    assert torch.equal(w, target.get_output_embeddings().weight.detach())  # two tensors, the same values
    assert bool((w[:-1, -1] > 0).all()) and float(w[-1, -1]) < 0  # d0: +c for every token, -c for the mask
