"""Each decoder judged on its own (issue 42, item 1): one decoder's crash, or a module that does not import, hides no
other decoder's verdict. The shape is the seed's own hand patch: the cache made from the target's config, the input
embeddings through the accessor and a legal crop in the tree's two decoders, but no exact rollback (lossy on a hybrid),
and the drafter's own ``spec_generate`` left with a bare ``DynamicCache()`` (an IndexError on a hybrid)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.heavy


def ddpatch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "patcher.cli", *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def checks_of(payload: dict) -> dict[tuple[str, str], dict]:
    rows = {("-", c["check"]): c for c in payload.get("checks", [])}
    rows.update({(m["model"], c["check"]): c for m in payload["models"] for c in m["checks"]})
    return rows


@pytest.fixture(scope="module")
def hand_patched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("seed") / "p"
    proc = ddpatch("apply", ROOT / "vendored" / "ddtree", "--out", out, "--ignore", "verify-forward,tree-commit", "--allow-lossy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = out / "model" / "dflash.py"
    text = model.read_text()
    assert text.count("target_cache = DynamicCache(config=target.config)") == 1
    model.write_text(text.replace("target_cache = DynamicCache(config=target.config)", "target_cache = DynamicCache()"))
    return out


def verify(tree: Path, *args: str) -> tuple[int, dict]:
    proc = ddpatch("verify", tree, "--format", "json", "--greedy-only", "--preset", "tiny-qwen3_5", "--seeds", "0",
                   "--prompts", "1", "--max-new-tokens", "24", *args)
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_a_crashing_decoder_hides_no_other_decoders_loss(hand_patched):
    code, payload = verify(hand_patched)
    checks = checks_of(payload)
    assert code == 1
    crash = checks[("tiny-qwen3_5", "warms up: DFlashDraftModel.spec_generate")]
    assert not crash["passed"] and "IndexError" in crash["evidence"] and crash["hint"].startswith("target-cache-config"), crash
    assert crash["decoder"]["function"] == "DFlashDraftModel.spec_generate"
    assert not checks[("tiny-qwen3_5", "warms up")]["passed"]
    for method in ("dflash", "ddtree_tb4", "ddtree_tb8"):  # still judged in the same run: lossy without the rollback
        row = checks[("tiny-qwen3_5", f"lossless: {method}")]
        assert not row["passed"] and "diverges at new token" in row["evidence"], (method, row)
    assert ("tiny-qwen3_5", "lossless: DFlashDraftModel.spec_generate") not in checks


def test_a_decoder_whose_module_does_not_import_hides_no_other_decoder(hand_patched, tmp_path):
    import shutil

    tree = tmp_path / "tree"
    shutil.copytree(hand_patched, tree)
    (tree / "ddtree.py").write_text("import a_module_nobody_installed\n" + (tree / "ddtree.py").read_text())
    code, payload = verify(tree, "--tree-budgets", "4")
    checks = checks_of(payload)
    assert code == 1
    row = checks[("-", "loads: ddtree")]
    assert not row["passed"] and "a_module_nobody_installed" in row["evidence"] and row["decoder"]["file"] == "ddtree.py", row
    loads = checks[("-", "loads")]
    assert not loads["passed"] and "the others are judged below" in loads["evidence"]
    assert not checks[("tiny-qwen3_5", "lossless: dflash")]["passed"], "dflash.py still imports and is judged lossy"
    assert ("tiny-qwen3_5", "lossless: ddtree_tb4") not in checks


def test_a_hint_names_a_step_only_where_the_step_touched_the_failing_code(tmp_path):
    """The error reads like input-embeddings' (``no attribute 'embed_tokens'``), but it is raised in a helper of the
    tree's own that no step touched: no step is blamed (issue 42, item 8)."""
    out = tmp_path / "p"
    assert ddpatch("apply", ROOT / "vendored" / "ddtree", "--out", out).returncode == 0
    path = out / "dflash.py"
    text = path.read_text()
    anchor = "def dflash_generate("
    assert text.count(anchor) == 1
    text = text.replace(anchor, "def _embed_scale(target):\n    return target.config.embed_tokens\n\n\n" + anchor)
    body = text.index(":\n", text.index(anchor)) + 2
    text = text[:body] + "    _embed_scale(target)\n" + text[body:]
    path.write_text(text)
    code, payload = verify(out, "--entry", "dflash.py:dflash_generate")
    row = checks_of(payload)[("tiny-qwen3_5", "warms up: dflash")]
    assert code == 1 and "no attribute 'embed_tokens'" in row["evidence"], row
    assert row["hint"] is None and "no recipe step touched dflash.py:" in row["not_a_step"] and "_embed_scale" in row["not_a_step"], row
