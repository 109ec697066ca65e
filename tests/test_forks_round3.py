"""Code others wrote, round 3 (issue 49), the engine's side: refuse only a site, never a tree.

Each tree here is a few lines written in our own words with the shape a public fork has: a drafter whose only decoder
is its own ``spec_generate`` loop, a decoder with no benchmark around it (no layout detected), a drafter method that
projects the target's features (a linear map and a norm), a single-file copy of transformers' cache code, an archived
partial copy of the project under ``docs/``, a verify no data flow reads. Each test names what it guards against.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from drift.variants import VENDORED

from fixture_support import CHAIN_DECODER as CHAIN
from patcher.cli import main

RECIPE = ["--recipe", "qwen3_6-gdn", "-j", "1"]


@pytest.fixture(autouse=True)
def _journal_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("ddpatch: error: ")]


def steps(tree: Path, *extra) -> dict:
    payload = json.loads(run("check", tree, *RECIPE, "--format", "json", *extra).stdout)
    return {s["id"]: s for s in payload["steps"]} | {"": payload}


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# a decoder with no benchmark around it: no layout's marker, no timing, no dataset, no attention switch

# a drafter whose only decoder is its own method, driving `self(...)` round after round
SELF_DRIVEN = '''import torch
from torch import nn
from transformers import DynamicCache


class BlockDrafter(nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.proj = nn.Linear(2 * width, width, bias=False)

    def forward(self, noise, target_hidden=None, past_key_values=None):
        context = self.proj(target_hidden)
        for layer in self.layers:
            noise = layer(noise, target_hidden=context, past_key_values=past_key_values)
        return noise

    @torch.no_grad()
    def spec_generate(self, target, ids, new_tokens):
        target_cache, own_cache = DynamicCache(), DynamicCache()
        out = target(ids, past_key_values=target_cache, use_cache=True, output_hidden_states=True)
        done = ids.shape[1]
        while done < ids.shape[1] + new_tokens:
            hidden = self(ids[:, -1:], target_hidden=out.hidden_states[-1], past_key_values=own_cache)
            out = VERIFY
            done += 1
            target_cache.crop(done)
        return ids
'''
DIRECT = "target(hidden.argmax(-1), past_key_values=target_cache, use_cache=True, output_hidden_states=True)"


def test_a_drafters_own_spec_generate_loop_is_a_decoder(tmp_path):
    """xPress's shape: no free decoder function, only `BlockDrafter.spec_generate`. It was "no DDTree/DFlash decoder
    found", exit 2 (the survey skipped every method of a class whose forward takes target_hidden)."""
    tree = write(tmp_path / "fork", {"model/drafter.py": SELF_DRIVEN.replace("VERIFY", DIRECT)})
    found = steps(tree)
    assert found[""]["decoders"] == {"model/drafter.py": found[""]["decoders"]["model/drafter.py"]}
    assert found["verify-forward"]["status"] == "pending" and found["draft-sliding-window"]["status"] == "pending"
    out = tmp_path / "out"
    assert run("apply", tree, *RECIPE, "--out", out).exit_code == 0
    assert "_ddpatch_runtime.verify_forward(target, hidden.argmax(-1)" in (out / "model/drafter.py").read_text()


def test_steps_with_no_site_in_a_tree_without_a_layout_are_no_finding(tmp_path):
    """No layout detected: timing, the attention switch, datasets and the embedding accessor have no site in the tree.
    They were four no-match errors and apply wrote nothing; now they are fixed-upstream (nothing to do) and apply
    writes the patch. A step whose form is in a file it did not match still names that file and line."""
    tree = write(tmp_path / "fork", {"decode.py": CHAIN})
    found = steps(tree)
    assert found[""]["upstream"] is None
    for step in ("cpu-safe-timing", "attn-fallback", "lazy-datasets", "input-embeddings"):
        assert found[step]["status"] == "fixed-upstream" and found[step]["sites"] == [], step
    result = run("apply", tree, *RECIPE, "--out", tmp_path / "out")
    assert result.exit_code == 0 and not errors(result)
    write(tree, {"bench.py": "import torch\n\n\ndef stamp():\n    torch.cuda.synchronize()\n"})
    timing = steps(tree)["cpu-safe-timing"]  # where the step has a site, it still acts
    assert timing["status"] == "pending" and [(s["path"], s["line"]) for s in timing["sites"]] == [("bench.py", 5)]


def test_a_lossless_step_with_nothing_to_name_names_the_decoder(tmp_path):
    """verify-forward found no call to route (the verify goes through a method data flow does not read): its no-match
    names the decoder's file and line, where another step acts, not "nothing matched"."""
    text = SELF_DRIVEN.replace("VERIFY", "self.run_target(target, hidden.argmax(-1), target_cache)")
    text += "\n    def run_target(self, target, ids, cache):\n        return target(ids, past_key_values=cache, use_cache=True)\n"
    tree = write(tmp_path / "fork", {"model/drafter.py": text})
    result = run("check", tree, *RECIPE)
    [line] = [e for e in errors(result) if "verify-forward" in e]
    assert line.startswith("ddpatch: error: no-match verify-forward: model/drafter.py:21: ") and "spec_generate" in line


DRAFTER = '''from torch import nn


class Drafter(nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.fc = nn.Linear(2 * width, width, bias=False)
        self.hidden_norm = nn.RMSNorm(width)

    def project_target_hidden(self, target_hidden):
        return self.hidden_norm(self.fc(target_hidden))

    def run_layers(self, hidden, context):
        for layer in self.layers:
            hidden = layer(hidden, context)
        return hidden

    def forward(self, noise, target_hidden=None, past_key_values=None, projected=False):
        context = target_hidden if projected else self.project_target_hidden(target_hidden)
        return self.run_layers(noise, context)
'''
PROJECTING = '''from transformers import DynamicCache

from drafter import Drafter


def branch_generate(model: Drafter, target, ids, rounds):
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    out = target(ids, past_key_values=target_cache, use_cache=True, output_hidden_states=True)
    for _ in range(rounds):
        context = model.project_target_hidden(out.hidden_states[-1])
        block = model(target.get_input_embeddings()(ids[:, -1:]), target_hidden=context, projected=True,
                      past_key_values=draft_cache)
        out = target(block.argmax(-1), past_key_values=target_cache, use_cache=True, output_hidden_states=True)
        target_cache.crop(ids.shape[1])
    return ids
'''


def test_a_drafter_method_that_reaches_no_attention_is_no_window_site(tmp_path):
    """MDFlash's shape: `model.project_target_hidden(...)` (an fc and an RMSNorm) before the drafter call. It was refused
    (14 files), with advice (`--ignore draft-sliding-window --allow-lossy`) that would strip the real drafter call on
    the next line too. Now only the drafter call is a site; a method that runs the layers stays refused, and its
    advice no longer offers to drop the step."""
    tree = write(tmp_path / "fork", {"drafter.py": DRAFTER, "decode.py": PROJECTING})
    out = tmp_path / "out"
    assert run("apply", tree, *RECIPE, "--out", out).exit_code == 0
    patched = (out / "decode.py").read_text()
    assert "context = model.project_target_hidden(out.hidden_states[-1])" in patched
    assert "block = _ddpatch_runtime.draft_forward(model, " in patched
    layered = PROJECTING.split("\n\n\n", 1)[1].replace("branch_generate", "layered_generate").replace(
        "model(target.get_input_embeddings()(ids[:, -1:]), target_hidden=context, projected=True,\n"
        "                      past_key_values=draft_cache)", "model.run_layers(ids[:, -1:], context)")
    write(tree, {"decode.py": PROJECTING + "\n\n" + layered})
    [line] = [e for e in errors(run("check", tree, *RECIPE)) if "draft-sliding-window" in e]
    # the layers run through a method data flow does not call the drafter's: the projection is named in its place
    assert "decode.py:22: " in line and "only through `model.project_target_hidden(...)`" in line and "--allow-lossy" not in line


CACHE_COPY = '''"""The cache classes of the one transformers release this project pins, kept beside it."""
from typing import Optional

import torch


class Cache:
    def get_seq_length(self, layer_idx=0):
        raise NotImplementedError


class DynamicCache(Cache):
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def update(self, key_states, value_states, layer_idx):
        self.key_cache.append(key_states)
        self.value_cache.append(value_states)
        return key_states, value_states

    @classmethod
    def from_legacy_cache(cls, past_key_values: Optional[tuple[tuple[torch.FloatTensor]]] = None):
        cache = cls()
        for layer_idx in range(len(past_key_values or ())):
            key_states, value_states = past_key_values[layer_idx]
            cache.update(key_states, value_states, layer_idx)
        return cache
'''


def test_a_single_file_copy_of_transformers_cache_code_is_vendored(tmp_path):
    """`past_key_values[layer_idx]` in a file that copies transformers' cache classes is the legacy tuple its annotation
    says: it was refused (removed-cache-api) and apply planned an edit in the copy. It is left out, listed with its
    reason, unless --include-vendored; a file with a decoder signal is kept whatever it defines."""
    tree = write(tmp_path / "fork", {"decode.py": CHAIN, "common/cache_utils.py": CACHE_COPY})
    found = steps(tree)
    assert found[""]["excluded"] == [{"path": "common/cache_utils.py", "by": found[""]["excluded"][0]["by"]}]
    assert "transformers' cache code" in found[""]["excluded"][0]["by"] and "removed-cache-api" not in found
    out = tmp_path / "out"
    assert run("apply", tree, *RECIPE, "--out", out).exit_code == 0
    assert (out / "common/cache_utils.py").read_text() == CACHE_COPY
    checked = steps(tree, "--include-vendored")["removed-cache-api"]
    assert [(s["path"], s["status"]) for s in checked["sites"]] == [("common/cache_utils.py", "no-match")]
    write(tree, {"common/cache_utils.py": CACHE_COPY + "\n\n" + CHAIN.split("\n", 2)[2]})  # a decoder in it: checked
    assert "common/cache_utils.py" in steps(tree)[""]["decoders"]


def test_an_archived_partial_copy_under_docs_is_offered_its_exclude(tmp_path):
    """A copy of the decoder kept under docs/, whose sibling modules are gone: each "restore the module" error now offers
    `--exclude docs/` (no other decoder imports anything there); with it, apply writes the patch."""
    tree = tmp_path / "fork"
    shutil.copytree(VENDORED / "dflash", tree, ignore=shutil.ignore_patterns("__pycache__"))
    archived = (tree / "dflash/model.py").read_text().replace("import time\n", "import time\n\nfrom .kernels import fused_norm\n", 1)
    write(tree, {"docs/archive/model.py": archived})
    result = run("apply", tree, *RECIPE, "--out", tmp_path / "blocked")
    lines = errors(result)
    assert result.exit_code == 1 and lines and all("--exclude docs/" in line for line in lines if "restore the module" in line)
    assert any(line.startswith("ddpatch: error: docs/archive/model.py:") for line in lines)
    assert run("apply", tree, *RECIPE, "--exclude", "docs/", "--out", tmp_path / "out").exit_code == 0
