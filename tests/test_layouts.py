"""Every upstream layout the recipe declares is detected, patched and verified lossless.

The DFlash layouts other than today's are made from ``vendored/`` by moving code, the way
upstream moved it: ``dflash-legacy`` (everything in ``benchmark.py``: the layout DDTree
copied) and ``dflash-2604`` (April 2026: the decoder is ``benchmark.py``'s private
``_dflash_generate``). Plus a fork that renamed the decoder's parameters.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENDORED = ROOT / "vendored"
SHAPE_ONLY = "verify-forward,tree-commit"
QUICK = ("--seeds", "0,1", "--prompts", "1", "--max-new-tokens", "24", "--greedy-only")


def ddpatch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "patcher.cli", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


# ----------------------------------------------------------------------------- layouts, by moving code
def dflash_legacy(dest: Path) -> Path:
    """DDTree's copy of DFlash without DDTree: the decoder, its timer and main() in benchmark.py."""
    tree = dest / "dflash-legacy"
    shutil.copytree(VENDORED / "ddtree", tree)
    (tree / "ddtree.py").unlink()
    decoder = (tree / "dflash.py").read_text()
    (tree / "dflash.py").unlink()
    bench = (tree / "benchmark.py").read_text()
    bench = bench.replace("from dflash import dflash_generate\n", "").replace("from ddtree import ddtree_generate\n", "")
    bench = re.sub(r"\n        for budget in args\.tree_budget:\n(            .*\n)+", "\n", bench)
    body = decoder.split('"""', 2)[2]  # the decoder module without its docstring
    docstring, rest = bench.split('"""', 2)[1], bench.split('"""', 2)[2]
    (tree / "benchmark.py").write_text(f'"""{docstring}"""\n{body}\n{rest}')
    return tree


def dflash_2604(dest: Path) -> Path:
    """DFlash between its April 2026 refactors: model.py keeps the draft, benchmark.py has ``_dflash_generate``."""
    tree = dest / "dflash-2604"
    shutil.copytree(VENDORED / "dflash", tree)
    model_py, bench_py = tree / "dflash" / "model.py", tree / "dflash" / "benchmark.py"
    model = model_py.read_text()
    begin = model.index("@torch.inference_mode()\ndef dflash_generate(")
    end = model.index("# ---------------------------------------------------------------- draft model")
    decoder = model[begin:end].replace("def dflash_generate(", "def _dflash_generate(")
    model = model[:begin] + model[end:]
    model = model.replace("return dflash_generate(self,", "from .benchmark import _dflash_generate\n\n        return _dflash_generate(self,")
    model_py.write_text(model)
    bench = bench_py.read_text()
    bench = bench.replace("from .model import DFlashDraftModel, dflash_generate", "from .model import DFlashDraftModel")
    bench = bench.replace("dflash_generate(", "_dflash_generate(")
    imports = (
        "import time\nfrom typing import Optional\n\nimport torch\nfrom torch import nn\nfrom transformers import DynamicCache\n\n"
        "from .model import DFlashDraftModel, _cuda_time, extract_context_feature, sample\n"
    )
    head, sep, tail = bench.partition("\n_DATASETS = {")
    bench_py.write_text(head + "\n" + imports + "\n" + decoder + sep + tail)
    init = tree / "dflash" / "__init__.py"
    init.write_text(init.read_text().replace('    "dflash_generate": ".model",\n', ""))
    return tree


RENAMES = {"model": "draft", "target": "target_model", "input_ids": "ids", "max_new_tokens": "max_tokens",
           "tree_budget": "node_budget", "mask_token_id": "mask_id", "stop_token_ids": "stop_ids"}


def renamed_fork(source: Path, dest: Path) -> Path:
    """A fork of a DDTree-shaped tree that renamed every decoder parameter (bodies follow the new names)."""
    tree = dest / "renamed"
    shutil.copytree(source, tree)
    for name, fn in (("dflash.py", "dflash_generate"), ("ddtree.py", "ddtree_generate")):
        path = tree / name
        text = path.read_text()
        begin = text.index(f"def {fn}(")
        for old, new in RENAMES.items():
            # every use of the name, but not a keyword argument of a call (``f(old=...)``)
            text = text[:begin] + re.sub(rf"(?<![\w.]){old}\b(?!\s*=(?!=))", new, text[begin:])
        path.write_text(text)
    return tree


LAYOUTS = {"dflash-legacy": dflash_legacy, "dflash-2604": dflash_2604}


def detected(tree: Path) -> str | None:
    proc = ddpatch("check", tree, "--recipe", "qwen3_6-gdn", "--format", "json")
    return json.loads(proc.stdout)["upstream"]


def patched(tree: Path, out: Path, ignore: str | None = None) -> Path:
    args = ["apply", tree, "--recipe", "qwen3_6-gdn", "--out", out] + (["--ignore", ignore, "--allow-lossy"] if ignore else [])
    proc = ddpatch(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def verify(tree: Path, *args) -> tuple[int, dict]:
    proc = ddpatch("verify", tree, "--format", "json", *QUICK, *args)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def checks_of(payload: dict) -> dict:
    return {(m["model"], c["check"]): c for m in payload["models"] for c in m["checks"]} | {
        ("-", c["check"]): c for c in payload["checks"]
    }


# ----------------------------------------------------------------------------- tests
def test_the_verifier_knows_every_decoder_the_recipe_anchors():
    import tomllib

    from patcher.verify.subjects.decoders import CANONICAL

    recipe = tomllib.loads((ROOT / "recipes" / "qwen3_6-gdn.toml").read_text())
    known = {name for names in CANONICAL.values() for name in names}
    decoders = {a for up in recipe["upstreams"].values() for a in up["anchors"] if a.endswith("_generate")}
    assert decoders and decoders <= known, decoders - known


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_is_detected(layout, tmp_path):
    assert detected(LAYOUTS[layout](tmp_path)) == layout


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_patched_is_lossless(layout, tmp_path):
    tree = patched(LAYOUTS[layout](tmp_path), tmp_path / "out")
    code, payload = verify(tree)
    checks = checks_of(payload)
    assert code == 0, [c for c in checks.values() if not c["passed"]]
    assert checks[("-", "runs without ddpatch")]["passed"]
    model = payload["models"][0]
    # the chain decoder, and the drafter's own decoder where the layout's drafter has one (spec_generate)
    assert [m["method"] for m in model["methods"]][0] == "dflash"
    assert set(m["method"] for m in model["methods"]) <= {"dflash", "DFlashDraftModel.spec_generate"}
    assert model["partial_acceptances"] > 0


def test_dflash_layout_code_shape_only_fails_with_partial_acceptances(tmp_path):
    tree = patched(VENDORED / "dflash", tmp_path / "out", ignore=SHAPE_ONLY)
    code, payload = verify(tree)
    check = checks_of(payload)[("tiny-qwen3_5", "lossless: dflash")]
    assert code == 1 and not check["passed"] and "diverges at new token" in check["evidence"]
    model = payload["models"][0]
    assert model["partial_acceptances"] > 0, "the control must exercise the rollback it shows missing"
    assert len(model["methods"][0]["acceptance_histogram"]) > 1


@pytest.mark.slow
def test_a_fork_with_renamed_parameters_is_called_correctly(tmp_path):
    # renamed after patching: what is tested is how verify calls the decoders, not the codemods
    fork = renamed_fork(patched(VENDORED / "ddtree", tmp_path / "out"), tmp_path)
    assert "draft: DFlashDraftModel, target_model: AutoModelForCausalLM, ids: torch.Tensor" in (fork / "ddtree.py").read_text()
    code, payload = verify(fork, "--tree-budgets", "4")
    assert code == 0, [c for c in checks_of(payload).values() if not c["passed"]]
    assert {m["method"] for m in payload["models"][0]["methods"]} == {"dflash", "ddtree_tb4", "DFlashDraftModel.spec_generate"}


# ----------------------------------------------------------------------------- binding, in process
def _fn(src: str):
    scope: dict = {}
    exec(src, scope)
    return scope["f"]


@pytest.mark.parametrize(
    "src,expected",
    [
        ("def f(model, target, input_ids, mask_token_id, max_new_tokens, block_size, stop_token_ids, temperature=0.0, tree_budget=None): pass",
         {"model": "draft", "target": "target", "tree_budget": "tree_budget"}),
        ("def f(draft, target_model, ids, mask_id, max_tokens, block_size, stop_ids, temperature=0.0, budget=None): pass",
         {"draft": "draft", "target_model": "target", "ids": "input_ids", "max_tokens": "max_new_tokens", "budget": "tree_budget"}),
        # renamed beyond recognition: upstream's positional order decides
        ("def f(a, b, c, d, e, g, h, temperature=0.0): pass",
         {"a": "draft", "b": "target", "c": "input_ids", "d": "mask_token_id", "e": "max_new_tokens", "g": "block_size", "h": "stop_token_ids"}),
        # DFlash's newer order, told apart by the names it kept
        ("def f(m, t, input_ids, max_new_tokens, stop_token_ids, temperature, block_size=None, mask_token_id=None, return_stats=False): pass",
         {"m": "draft", "t": "target", "max_new_tokens": "max_new_tokens", "mask_token_id": "mask_token_id"}),
        # annotations name the roles whatever the order
        ("def f(tgt: 'AutoModelForCausalLM', drf: 'DFlashDraftModel', input_ids, max_new_tokens, *, temperature=0.0): pass",
         {"tgt": "target", "drf": "draft"}),
        ("def f(target, model, *, input_ids, max_new_tokens, **kw): pass", {"target": "target", "model": "draft"}),
        # keyword-only, out of upstream's order: only the names can tell
        ("def f(*, ids, target_model, draft, max_tokens, mask_id, block_len, stop_ids, node_budget=None): pass",
         {"ids": "input_ids", "target_model": "target", "draft": "draft", "max_tokens": "max_new_tokens",
          "mask_id": "mask_token_id", "block_len": "block_size", "stop_ids": "stop_token_ids", "node_budget": "tree_budget"}),
    ],
)
def test_parameters_are_bound_by_signature(src, expected):
    from patcher.verify.subjects.binding import bind_roles

    roles = bind_roles(_fn(src))
    assert {k: roles[k] for k in expected} == expected


@pytest.mark.parametrize(
    "src,needle",
    [
        # a fork that added a tokenizer: the verifier has none to give
        ("def f(model, target, tokenizer, input_ids, mask_token_id, max_new_tokens, block_size, stop_token_ids): pass", "'tokenizer'"),
        ("def f(model, target, **kw): pass", "no parameter takes the input_ids, max_new_tokens"),
    ],
)
def test_a_signature_that_cannot_be_bound_is_one_clear_error(src, needle):
    from patcher.verify.subjects.binding import BindError, bind_roles

    with pytest.raises(BindError, match="cannot call f") as info:
        bind_roles(_fn(src))
    assert needle in str(info.value)
