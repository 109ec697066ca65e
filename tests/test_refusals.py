"""Refuse only what cannot be made exact (issue 42, item 7): fork-shaped trees written here, each once as the
fork writes it and, where it matters, once in the form that must still be refused.

Each tree is a small DFlash-layout checkout (its decoder is ``dflash_generate``); the shapes are our own,
read from public forks: a benchmark helper that is gone, a cache built by a helper in another file, an
embedding helper that falls back to attributes, a tree decoder that moves ``start`` by ``+=``, a legacy-cache
round trip that clones the cache.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from patcher.cli import main

RECIPE = ["--recipe", "qwen3_6-gdn", "-j", "1"]

DECODER = '''
import torch
from transformers import DynamicCache


def dflash_generate(model, target, input_ids, max_new_tokens, block_size):
    target_cache = DynamicCache()
    draft_cache = DynamicCache()
    out = target(input_ids, past_key_values=target_cache, output_hidden_states=True)
    start = input_ids.shape[1]
    while start < max_new_tokens:
        block = input_ids[:, -block_size:]
        hidden = model(target_hidden=out.hidden_states[-1], noise_embedding=target.get_input_embeddings()(block),
                       past_key_values=draft_cache)
        draft_cache.crop(start)
        out = target(block, past_key_values=target_cache, output_hidden_states=True)
        start += 1
        target_cache.crop(start)
    return hidden
'''


@pytest.fixture(autouse=True)
def _journal_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def check(root: Path, *extra) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["check", str(root), *RECIPE, "--format", "json", *extra], catch_exceptions=False)
    return result.exit_code, json.loads(result.stdout)


def step(payload: dict, sid: str) -> dict:
    return next(s for s in payload["steps"] if s["id"] == sid)


# ----------------------------------------------------------------------------- a benchmark's helper gone from the tree
def test_a_benchmark_helper_gone_from_the_tree_leaves_its_step_nothing_to_do(tmp_path):
    """The layout's decoder is there; `_cuda_time`, `_get_transformers_attn_impl`, `_prepare_dataset` are not, and no
    file has what their steps change: fixed-upstream, never no-match."""
    _code, payload = check(tree(tmp_path / "fork", {"dflash.py": DECODER}))
    for sid in ("cpu-safe-timing", "attn-fallback", "lazy-datasets"):
        found = step(payload, sid)
        assert found["status"] == "fixed-upstream", found
        assert all(a["status"] == "fixed-upstream" and "nothing to do" in a["message"] for a in found["anchors"]), found


def test_a_benchmark_helper_renamed_answers_through_the_sites_found_elsewhere(tmp_path):
    """`_cuda_time` renamed `_timer` still calls synchronize; the datasets import already sits in the loader
    (renamed too): the step speaks for the sites it found, the gone anchor says nothing."""
    root = tree(tmp_path / "fork", {
        "dflash.py": DECODER,
        "timing.py": "import time\nimport torch\n\n\ndef _timer():\n    torch.cuda.synchronize()\n    return time.perf_counter()\n",
        "data.py": "def _load(name):\n    from datasets import load_dataset\n    return load_dataset(name)\n",
    })
    _code, payload = check(root)
    timing, lazy = step(payload, "cpu-safe-timing"), step(payload, "lazy-datasets")
    assert timing["status"] == "pending" and timing["anchors"] == [] and [s["path"] for s in timing["sites"]] == ["timing.py"]
    assert lazy["status"] == "fixed-upstream" and lazy["anchors"] == [] and [s["path"] for s in lazy["sites"]] == ["data.py"]


def test_a_gone_helper_whose_form_is_still_in_the_tree_unmatched_stays_no_match(tmp_path):
    """A module-level `datasets` import that module-level code uses is not something the step can move: the gone
    anchor stays no-match and names the file, with the way forward."""
    root = tree(tmp_path / "fork", {
        "dflash.py": DECODER,
        "data.py": "from datasets import load_dataset\n\nTRAIN = load_dataset('x')\n",
    })
    code, payload = check(root)
    lazy = step(payload, "lazy-datasets")
    assert code == 1 and lazy["status"] == "no-match"
    [anchor] = lazy["anchors"]
    assert "data.py has an import of datasets at module level" in anchor["message"] and "--exclude" in anchor["message"]
