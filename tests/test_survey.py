"""What a tree is, said before any step runs (issue 42, items 6 and 9): code that is not torch (MLX, JAX, numpy ports)
and a serving engine's proposer are no decoder, in one line on every command; beside a torch decoder an MLX port is
left out and said so; check's ``decoders:`` line names what verify's own search finds, and its import headings say
whether the decoders reach the file.

The trees are written here, in the shapes the issue met (our own code): ``vendored/`` copies with a port beside them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_support import run

from drift.variants import VENDORED
from patcher.engine.survey import array_framework, decoder_function
from patcher.verify.subjects import decoders

RECIPE = ["--recipe", "qwen3_6-gdn", "-j", "1"]


pytestmark = pytest.mark.usefixtures("journal_home")  # DDPATCH_HOME in the test's tmp_path (tests/conftest.py)


#: a DFlash-style decode loop in another array framework: its import line, its array module's name
PORT = '''"""A block-diffusion draft-and-verify decoder, ported."""
{imports}


def dflash_generate(model, target, input_ids, max_new_tokens, block_size):
    target_cache = make_cache(target)
    draft_cache = model.make_cache()
    out = target(input_ids, cache=target_cache)
    ids, hidden, start = input_ids, out.hidden, input_ids.shape[1]
    while start < input_ids.shape[1] + max_new_tokens:
        block = {xp}.concatenate([ids[:, -1:], {xp}.zeros((1, block_size - 1), dtype={xp}.int32)], axis=1)
        draft = model(target.model.embed_tokens(block), target_hidden=hidden, cache=draft_cache)
        proposal = {xp}.argmax(target.lm_head(draft), axis=-1)
        verify = target(proposal, cache=target_cache)
        accepted = int(({xp}.cumprod(proposal[:, 1:] == {xp}.argmax(verify.logits, -1)[:, :-1])).sum())
        trim(target_cache, block_size - accepted - 1)
        draft_cache.crop(start)
        ids = {xp}.concatenate([ids, proposal[:, : accepted + 1]], axis=1)
        hidden, start = verify.hidden, start + accepted + 1
    return ids
'''
PORTS = {
    "MLX": ("import mlx.core as mx\nfrom mlx_lm.models.cache import make_prompt_cache as make_cache, trim_prompt_cache as trim", "mx",
            "mlx.core"),
    "JAX": ("import jax.numpy as jnp\n\nfrom .kv import make_cache, trim", "jnp", "jax.numpy"),
    "numpy": ("import numpy as np\n\nfrom .kv import make_cache, trim", "np", "numpy"),
}


def port(root: Path, name: str, rel: str = "port/generate.py") -> Path:
    imports, xp, _module = PORTS[name]
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PORT.format(imports=imports, xp=xp))
    return root


PROPOSER = '''"""Proposes a block of draft tokens for the engine's scheduler, one step of a batch at a time."""
import torch

from ..config import SpeculativeConfig


class DFlash2Proposer:
    def __init__(self, config: SpeculativeConfig, drafter, embed):
        self.config, self.drafter, self.embed = config, drafter, embed

    @torch.inference_mode()
    def propose(self, last_tokens: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        block = torch.full((last_tokens.shape[0], self.config.block_size), self.config.mask_token_id, device=last_tokens.device)
        block[:, 0] = last_tokens
        hidden = self.drafter(noise_embedding=self.embed(block), target_hidden=target_hidden, position_ids=positions)
        return self.drafter.logits(hidden[:, 1:]).argmax(-1)


class DFlashWorker:
    def __init__(self, proposer: DFlash2Proposer):
        self.proposer = proposer

    def execute(self, batch):
        torch.cuda.synchronize()
        return self.proposer.propose(batch.last_tokens, batch.hidden, batch.positions)
'''


def engine_tree(root: Path) -> Path:
    (root / "serve" / "spec").mkdir(parents=True)
    (root / "serve" / "__init__.py").write_text("")
    (root / "serve" / "spec" / "__init__.py").write_text("")
    (root / "serve" / "config.py").write_text("from dataclasses import dataclass\n\n\n@dataclass\nclass SpeculativeConfig:\n"
                                              "    block_size: int = 8\n    mask_token_id: int = 0\n")
    (root / "serve" / "spec" / "dflash_proposer.py").write_text(PROPOSER)
    return root


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and result.stdout == "", (result.exit_code, result.stdout, result.stderr)
    return lines[0]


# ----------------------------------------------------------------------------- not torch
@pytest.mark.parametrize("command", ["check", "diff", "apply", "verify"])
@pytest.mark.parametrize("name", sorted(PORTS))
def test_a_port_that_is_not_torch_is_one_line_on_every_command(tmp_path, name, command):
    tree = port(tmp_path / "tree", name)
    args = [command, tree] + (RECIPE if command != "verify" else []) + (["--out", tmp_path / "out"] if command == "apply" else [])
    line = one_line(run(*args))
    assert line.startswith(f"ddpatch: error: no DDTree/DFlash decoder found in {tree.resolve()} (looked for the functions ")
    assert f"found instead: port/generate.py is {name} code (imports {PORTS[name][2]}), not torch" in line
    assert not (tmp_path / "out").exists()
    payload = json.loads(run(*args, "--format", "json").stdout)
    assert payload["exit_code"] == 2 and payload["error"] == line.removeprefix("ddpatch: error: ")


def test_apply_allow_partial_writes_no_torch_runtime_call_into_mlx_code(tmp_path):
    """The issue's apply --allow-partial wrote `_ddpatch_runtime.verify_forward(...)` into MLX code: now nothing is written."""
    tree = port(tmp_path / "tree", "MLX")
    one_line(run("apply", tree, *RECIPE, "--allow-partial", "--out", tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    # --upstream says what to run, on any tree: the MLX file is still left out, said so, and never written
    forced = run("apply", tree, *RECIPE, "--upstream", "dflash", "--allow-partial", "--out", tmp_path / "forced")
    assert forced.exit_code == 1
    assert "left out (MLX code, not torch: the recipe writes torch runtime calls): 1 file(s): port/generate.py" in forced.stdout
    assert (tmp_path / "forced" / "port" / "generate.py").read_text() == (tree / "port" / "generate.py").read_text()
    assert not list((tmp_path / "forced").rglob("_ddpatch_runtime*"))


def test_a_tree_with_a_torch_decoder_and_an_mlx_port_patches_the_torch_files_only(tmp_path):
    tree = tmp_path / "dflash"
    shutil.copytree(VENDORED / "dflash", tree, ignore=shutil.ignore_patterns("__pycache__"))
    port(tree, "MLX", "dflash/model_mlx.py")
    check = run("check", tree, *RECIPE)
    assert check.exit_code == 1 and not [e for e in check.stderr.splitlines() if "no-match" in e], check.stderr
    assert "decoders: dflash/model.py\n" in check.stdout
    assert "left out (MLX code, not torch: the recipe writes torch runtime calls): 1 file(s): dflash/model_mlx.py" in check.stdout
    assert "mlx" not in check.stdout.split("left out")[1].split("\n", 1)[1], "an import of a file left out is not listed"
    payload = json.loads(run("check", tree, *RECIPE, "--format", "json").stdout)
    assert {"path": "dflash/model_mlx.py", "by": "MLX code, not torch: the recipe writes torch runtime calls"} in payload["excluded"]
    assert not any(s["path"] == "dflash/model_mlx.py" for step in payload["steps"] for s in step["sites"])
    out = tmp_path / "out"
    assert run("apply", tree, *RECIPE, "--out", out).exit_code == 0
    assert (out / "dflash/model_mlx.py").read_text() == (tree / "dflash/model_mlx.py").read_text()
    assert "_ddpatch_runtime.verify_forward(" in (out / "dflash/model.py").read_text()


def test_which_files_are_not_torch():
    assert array_framework("import mlx.core as mx\n") == ("MLX", "mlx.core")
    assert array_framework("from jax import numpy as jnp\n") == ("JAX", "jax")
    assert array_framework("import numpy as np, json\n") == ("numpy", "numpy")
    assert array_framework("import numpy as np\nimport mlx.nn as nn\n") == ("MLX", "mlx.nn"), "the framework, not numpy"
    # torch anywhere in the file (DFlash's benchmark imports torch and mlx inside functions) makes it torch code
    assert array_framework("import numpy as np\n\ndef run():\n    import torch\n    from mlx_lm import load\n") is None
    assert array_framework("from transformers import DynamicCache\nimport jax\n") is None
    assert array_framework("import json\n") is None


# ----------------------------------------------------------------------------- an engine's proposer
@pytest.mark.parametrize("command", ["check", "diff", "apply", "verify"])
def test_an_engines_proposer_is_no_decoder_in_one_line(tmp_path, command):
    tree = engine_tree(tmp_path / "engine")
    line = one_line(run(command, tree, *(RECIPE if command != "verify" else [])))
    assert line.startswith(f"ddpatch: error: no DDTree/DFlash decoder found in {tree.resolve()} (looked for")
    assert ("found instead: serve/spec/dflash_proposer.py: `DFlash2Proposer.propose` hands a drafter `target_hidden=` once, "
            "with no decode loop and no cache (a serving engine's proposer or worker?)") in line
    assert "no-match" not in line and len(line) < 1000


def test_a_drafter_call_is_a_decoders_in_a_loop_or_beside_a_cache():
    once = "def propose(model, hidden, noise):\n    return model(target_hidden=hidden, noise_embedding=noise)\n"
    loop = "def spec(model, hidden, noise, n):\n    for _ in range(n):\n        noise = model(target_hidden=hidden, noise_embedding=noise)\n"
    cache = ("def step(model, target, ids, hidden, cache):\n    target(ids, past_key_values=cache)\n"
             "    return model(target_hidden=hidden)\n")
    assert decoder_function(once) is None and "once, with no decode loop" in decoder_function(once, why_not=True)[1]
    assert decoder_function(loop) == "`spec` hands a drafter `target_hidden=`"
    assert decoder_function(cache) == "`step` hands a drafter `target_hidden=`"


# ----------------------------------------------------------------------------- reports that agree with themselves
def legacy_tree(tmp_path: Path) -> Path:
    """vendored/ddtree without ddtree.py (DFlash's legacy layout: `dflash_generate` and `cuda_time`), with `cuda_time`
    moved into model/utils.py, as a fork had it, and an import of a module not installed here in the decoder's file."""
    tree = tmp_path / "legacy"
    shutil.copytree(VENDORED / "ddtree", tree, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "ddtree.py").unlink()
    dflash = tree / "dflash.py"
    text = dflash.read_text()
    start = text.index("def cuda_time() -> float:")
    end = text.index("\n\n\n", start) + 3
    timer = text[start:end]
    text = (text[:start] + text[end:]).replace("from model import", "from model.utils import cuda_time\nfrom model import", 1)
    dflash.write_text(text.replace("import time\n", "import time\nimport not_installed_stats\n", 1))
    utils = tree / "model" / "utils.py"
    utils.write_text(utils.read_text() + "\n\n" + timer)
    bench = tree / "benchmark.py"
    text = bench.read_text().replace("from ddtree import ddtree_generate\n", "")
    bench.write_text(text.replace("import os\n", "import os\nimport absent_plotting\n", 1))
    return tree


def section(lines: list[str], heading: str) -> list[str]:
    """The indented lines right under ``heading``."""
    out = []
    for line in lines[lines.index(heading) + 1:]:
        if not line.startswith("  "):
            break
        out.append(line)
    return out


def test_the_decoders_line_names_what_verify_finds(tmp_path):
    """The line listed model/utils.py (it defines `cuda_time`, a marker that tells layouts apart, no decoder) and
    left out model/dflash.py (its `spec_generate`, which verify runs)."""
    named = {}
    for tree in (legacy_tree(tmp_path), VENDORED / "ddtree", VENDORED / "dflash"):
        payload = json.loads(run("check", tree, *RECIPE, "--format", "json").stdout)
        found = {d.file for d in decoders.inventory(tree).decoders}
        assert set(payload["decoders"]) == found, (tree, payload["decoders"])
        line = next(l for l in run("check", tree, *RECIPE).stdout.splitlines() if l.startswith("decoders: "))
        assert line == "decoders: " + ", ".join(sorted(found))
        named[tree.name] = found
    assert named["legacy"] == {"dflash.py", "model/dflash.py"} and named["ddtree"] == {"ddtree.py", "dflash.py", "model/dflash.py"}


def test_import_headings_say_whether_the_decoders_reach_the_file(tmp_path):
    tree = legacy_tree(tmp_path)
    payload = json.loads(run("check", tree, *RECIPE, "--format", "json").stdout)
    assert payload["upstream"] == "dflash-legacy"
    assert {(i["path"], i["module"], i["reached"], i["blocking"]) for i in payload["unresolved_imports"]} == {
        ("dflash.py", "not_installed_stats", True, False), ("benchmark.py", "absent_plotting", False, False)}
    lines = run("check", tree, *RECIPE).stdout.splitlines()
    reached = section(lines, "imports the decoders reach that are not installed here (verify cannot load them here):")
    others = section(lines, "imports that resolve to nothing, in files no decoder imports:")
    assert len(reached) == 1 and reached[0].startswith("  dflash.py:") and "the decoders import this file" in reached[0]
    assert len(others) == 1 and others[0].startswith("  benchmark.py:") and "the decoders import" not in others[0]
