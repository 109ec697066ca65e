"""Cache surgery found (issue 42, item 4): a fork that edits a cache's layers by hand is rewritten to an exact cache
operation, or named with its line and the flag that guards it.

On a hybrid target the hand trim a fork writes (``for layer in cache.layers: layer.keys = layer.keys[:, :, :n]``)
raises on the linear-attention layers, or, skipping them, leaves a recurrent state that still holds the dropped
tokens; the rewrite (``crop_cache``) equals a from-scratch run. The real DDTree with a planted ``trim_kv`` flag (cloned
at run time from ``../shared/upstream``, never committed) is named by ``apply``, line and flag, where it exited 0
and named neither. The codemod's own cases are ``tests/fixtures/cache-surgery/``, the forks ``tests/drift/variants_surgery.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_support import run
from fixture_support import CHAIN_DECODER as DECODER
from fixture_support import run_codemod
from runtime_support import ATOL, RTOL, model, one_thread, prefill  # noqa: F401 (fixture)

from patcher import runtime as rt

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT.parent / "shared" / "upstream" / "ddtree.bundle"
RECIPE = ["--recipe", "qwen3_6-gdn", "-j", "1"]

#: a fork's trim helper, skipping layers without keys (so it does not raise on a hybrid: it keeps their state whole)
HELPER = '''def rewind(cache, length):
    for layer in cache.layers:
        if not hasattr(layer, "keys"):
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]
'''


pytestmark = pytest.mark.usefixtures("journal_home")  # DDPATCH_HOME in the test's tmp_path (tests/conftest.py)


def load(text: str, monkeypatch):
    """``rewind`` from ``text``, its ``_ddpatch_runtime`` import bound to this checkout's runtime."""
    monkeypatch.setitem(sys.modules, "_ddpatch_runtime", rt)
    namespace: dict = {}
    exec(compile(text, "<fork>", "exec"), namespace)
    return namespace["rewind"]


def next_logits(m, cache):
    return m(torch.tensor([[5]]), past_key_values=cache, use_cache=True).logits[0, -1]


def test_on_a_hybrid_the_hand_trim_is_lossy_and_its_rewrite_is_exact(monkeypatch):
    """After a recorded chain verify of 4 tokens, keep 2: the rewrite equals a from-scratch run of prompt + 2 tokens;
    the hand trim it replaces raises without its guard, and with it decodes on from a state that kept all 4."""
    patched, sites, _ = run_codemod("cache-surgery", HELPER)
    assert [s.status for s in sites] == ["applied"] and "_ddpatch_runtime.crop_cache(cache, length)" in patched
    m = model("tiny-qwen3_5")
    prompt, block = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        expected = next_logits(m, prefill(m, torch.cat([prompt, block[:, :2]], dim=1)))
        outcomes = {}
        for name, text in (("rewritten", patched), ("guarded", HELPER), ("bare", HELPER.replace(
                '        if not hasattr(layer, "keys"):\n            continue\n', ""))):
            cache = prefill(m, prompt)
            rt.verify_forward(m, block, position_ids=torch.arange(4, 8)[None], past_key_values=cache, use_cache=True)
            try:
                load(text, monkeypatch)(cache, 6)
                got = next_logits(m, cache)
                outcomes[name] = torch.allclose(got, expected, atol=ATOL, rtol=RTOL)
            except (AttributeError, RuntimeError) as exc:
                outcomes[name] = type(exc).__name__
    assert outcomes["rewritten"] is True, outcomes
    assert outcomes["bare"] == "AttributeError", outcomes  # a linear-attention layer has no `keys`
    assert outcomes["guarded"] in (False, "RuntimeError"), outcomes  # lossy, or refused by the runtime: never exact


# ----------------------------------------------------------------------------- the real DDTree, with a flag planted
def clone_ddtree(dest: Path) -> Path:
    if not BUNDLE.is_file():
        pytest.skip(f"{BUNDLE} is absent: the real upstream histories live in ../shared/upstream (CI and the developers' "
                    "machines have it); a clone elsewhere has no bundles to test on")
    subprocess.run(["git", "clone", "-q", str(BUNDLE), str(dest)], check=True, capture_output=True)
    return dest


def plant(tree: Path, body: str) -> int:
    """``ddtree_generate(..., trim_kv=False)`` whose branch runs ``body`` on the target's cache before the compaction;
    returns the line of the planted loop."""
    path = tree / "ddtree.py"
    text = path.read_text()
    signature = "    save_tree_traces: bool = False,\n) -> SimpleNamespace:"
    compaction = "        compact_dynamic_cache(past_key_values_target, start, accepted_indices)\n"
    assert text.count(signature) == 1 and text.count(compaction) == 1, "the real DDTree changed: re-plant the flag"
    loop = "            for layer in past_key_values_target.layers:\n"
    text = text.replace(signature, signature.replace(",\n)", ",\n    trim_kv: bool = False,\n)"))
    text = text.replace(compaction, "        if trim_kv:\n" + loop + body + compaction)
    path.write_text(text)
    return text.splitlines().index(loop.rstrip("\n")) + 1


def test_a_trim_kv_flag_planted_in_the_real_ddtree_is_named_by_line_and_flag(tmp_path):
    """Keys trimmed, values not: no cache operation does that. apply exits 1, names the line and the flag, writes nothing."""
    tree = clone_ddtree(tmp_path / "ddtree")
    line = plant(tree, "                layer.keys = layer.keys[:, :, : start + 1]\n")
    result = run("apply", tree, *RECIPE, "--out", tmp_path / "out")
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    [named] = [e for e in result.stderr.splitlines() if e.startswith("ddpatch: error: no-match cache-surgery: ")]
    assert f"ddtree.py:{line}: `for layer in past_key_values_target.layers`: `layer.keys = ...` edits the target's cache" in named
    assert "only under `if trim_kv:`: `trim_kv` is a parameter of `ddtree_generate`, default `False`" in named
    assert "`_ddpatch_runtime.crop_cache(cache, n)`" in named and len(named) < 1000
    assert f"cache-surgery         no-match        ddtree.py:{line} no-match" in result.stdout


def test_a_whole_trim_planted_in_the_real_ddtree_becomes_crop_cache_and_says_its_flag(tmp_path):
    tree = clone_ddtree(tmp_path / "ddtree")
    line = plant(tree, "                layer.keys = layer.keys[:, :, : start + 1]\n"
                       "                layer.values = layer.values[:, :, : start + 1]\n")
    result = run("apply", tree, *RECIPE, "--out", tmp_path / "out", "--format", "json")
    payload = json.loads(result.stdout)
    assert result.exit_code == 0, result.stdout[-2000:]
    [site] = next(s for s in payload["steps"] if s["id"] == "cache-surgery")["sites"]
    assert (site["path"], site["line"], site["status"], site["function"]) == ("ddtree.py", line, "applied", "ddtree_generate")
    assert "crop_cache(past_key_values_target, start + 1)" in site["message"] and "`trim_kv` is a parameter" in site["message"]
    patched = (tmp_path / "out" / "ddtree.py").read_text()
    assert "            _ddpatch_runtime.crop_cache(past_key_values_target, start + 1)  # ddpatch cache-surgery" in patched
    assert "layer.keys = layer.keys[" not in patched
    again = json.loads(run("check", tmp_path / "out", *RECIPE, "--format", "json").stdout)
    [site] = next(s for s in again["steps"] if s["id"] == "cache-surgery")["sites"]
    assert site["status"] == "already-applied"


# ----------------------------------------------------------------------------- linear-attention state by hand (issue 49)
#: a fork's snapshot and restore of the Gated DeltaNet state, as the issue met it (written here in our own words)
STATE_HELPERS = '''def snapshot(cache):
    return [(layer.conv_states.clone(), layer.recurrent_states.clone()) for layer in cache.layers
            if hasattr(layer, "conv_states")]


def restore(cache, saved):
    linear = [layer for layer in cache.layers if hasattr(layer, "conv_states")]
    for layer, (conv, recurrent) in zip(linear, saved):
        layer.conv_states.copy_(conv)
        layer.recurrent_states.copy_(recurrent)
'''
#: the decoder beside it (the tree is a decoder's, or check refuses it whole)


def test_a_hand_snapshot_of_linear_state_is_named_where_it_breaks_on_this_transformers(tmp_path):
    """check names each line of the hand snapshot and restore, with the error the line raises here (a linear layer's
    `conv_states` is a dict on 5.25), and apply writes nothing; the claim is checked against this transformers: the
    fork's own helper raises exactly that on a hybrid's config-built cache."""
    tree = tmp_path / "fork"
    tree.mkdir()
    (tree / "state.py").write_text(STATE_HELPERS)
    (tree / "decode.py").write_text(DECODER)
    payload = json.loads(run("check", tree, *RECIPE, "--format", "json").stdout)
    step = next(s for s in payload["steps"] if s["id"] == "cache-surgery")
    assert step["status"] == "no-match"
    assert [(s["path"], s["line"]) for s in step["sites"]] == [("state.py", n) for n in (2, 2, 9, 10)]
    assert [(s["line"], s["status"]) for s in step["sites"]] == [(2, "no-match"), (2, "no-match"), (9, "no-match"), (10, "no-match")]
    assert all("'dict' object has no attribute" in s["message"] and "crop_cache" in s["message"] for s in step["sites"])
    out = tmp_path / "out"
    assert run("apply", tree, *RECIPE, "--out", out).exit_code == 1 and not out.exists()
    cache = prefill(model("tiny-qwen3_5"), torch.tensor([[1, 2, 3]]))
    namespace: dict = {}
    exec(compile(STATE_HELPERS, "<fork>", "exec"), namespace)
    with pytest.raises(AttributeError, match="'dict' object has no attribute 'clone'"):
        namespace["snapshot"](cache)
