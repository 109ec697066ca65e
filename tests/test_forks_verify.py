"""Forks as verify meets them (issue 49, the verify side): a tree that is a package imports as one, parameters are
bound by name and never guessed, two drafter classes of one name stay apart, a timeout keeps the verdicts it has, and
what a fork adds is named first in the coverage text.

The trees are small ones written here, in our own words, and z-lab's ``dflash`` 0.1.0 wheel from the package index.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from patcher.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _journal_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# ----------------------------------------------------------------------------- 1. a tree that is a package
def _wheel_cache() -> Path:
    matrix = os.environ.get("DDPATCH_MATRIX_DIR") or os.path.join(os.environ.get("TMPDIR") or "/tmp", "ddpatch-matrix")
    return Path(matrix) / "wheels"


def dflash_wheel() -> Path:
    """z-lab's ``dflash`` 0.1.0 wheel, downloaded once into the matrix cache (never installed: it pins
    transformers==5.15.0); skips, saying why, where the package index cannot be reached."""
    cache = _wheel_cache()
    found = sorted(cache.glob("dflash-0.1.0-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "dflash==0.1.0",
                               "-d", str(cache)], check=False, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("the package index did not answer within 180 s: cannot fetch dflash==0.1.0")
    found = sorted(cache.glob("dflash-0.1.0-*.whl"))
    if proc.returncode != 0 or not found:
        pytest.skip(f"cannot fetch dflash==0.1.0 from the package index: {(proc.stderr or proc.stdout).strip()[-300:]}")
    return found[0]


def test_a_package_tree_imports_as_its_package_not_as_top_level_modules(tmp_path):
    """A tree whose root has ``__init__.py`` and whose modules import each other relatively: the child imports its
    modules as ``pkg.mod`` (top-level, ``from . import`` raises 'no known parent package')."""
    from patcher.verify.subjects import methods

    tree = tmp_path / "some_out_name"
    tree.mkdir()
    (tree / "__init__.py").write_text("from .helpers import WIDTH\n")
    (tree / "helpers.py").write_text("WIDTH = 3\n")
    (tree / "model.py").write_text("from . import helpers\n\ndef width():\n    return helpers.WIDTH\n")
    module = methods._import(tree, "model")
    assert module.width() == 3 and module.__name__ == "some_out_name.model"
    assert str(tree) not in sys.path  # the tree's own names (model, helpers) do not shadow anyone's top-level modules


def test_a_package_tree_takes_the_name_its_code_imports_itself_by(tmp_path):
    from patcher.verify.subjects import methods

    tree = tmp_path / "patched-copy"  # not an identifier: --out may name the folder anything
    tree.mkdir()
    (tree / "__init__.py").write_text("")
    (tree / "model.py").write_text("X = 1\n")
    (tree / "bench.py").write_text("from mypkg_zq.model import X\n")
    assert methods.package_name(tree) == "mypkg_zq"
    (tree / "bench.py").write_text("import torch.nn\n")  # someone else's package is never taken
    assert methods.package_name(tree) == "ddpatch_tree"


@pytest.mark.heavy
def test_zlabs_dflash_wheel_applies_and_verifies_end_to_end(tmp_path):
    """``pip install dflash`` puts the package at ``site-packages/dflash``: patched with ``--out`` and verified, it passes
    (before: the ``loads`` row failed on the runtime's relative import, 'no known parent package')."""
    wheel = dflash_wheel()
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    assert (site / "dflash" / "__init__.py").is_file()
    out = tmp_path / "patched"
    applied = run("apply", site / "dflash", "--out", out)
    assert applied.exit_code == 0, applied.output
    assert "from . import _ddpatch_runtime" in (out / "model.py").read_text()
    result = run("verify", out, "--preset", "tiny-qwen3_5", "--greedy-only", "--format", "json")
    report = json.loads(result.stdout)
    loads = next(c for c in report["checks"] if c["check"] == "loads")
    assert loads["passed"], loads
    assert result.exit_code == 0, result.output[-3000:]


# ----------------------------------------------------------------------------- 3. classes resolve by module
_DRAFTER = '''
import torch


class DFlashDraftModel(torch.nn.Module):
    def forward(self, target_hidden=None, noise_embedding=None, past_key_values=None):
        return noise_embedding
{extra}
'''

_OWN_DECODER = '''
    def naive_generate(self, target, input_ids, max_new_tokens, mask_token_id=None):
        cache = None
        while input_ids.shape[1] < max_new_tokens:
            out = target(input_ids, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
        return input_ids
'''


def _two_drafters_tree(tmp_path: Path) -> Path:
    """Two modules define ``class DFlashDraftModel``; only the second has a decoding method of its own."""
    tree = tmp_path / "two_drafters"
    (tree / "alpha").mkdir(parents=True)
    (tree / "beta").mkdir()
    (tree / "alpha" / "model.py").write_text(_DRAFTER.format(extra=""))
    (tree / "beta" / "model.py").write_text(_DRAFTER.format(extra=_OWN_DECODER))
    return tree


def test_two_drafter_classes_of_one_name_are_resolved_by_module(tmp_path):
    """The decoder ``beta/model.py:DFlashDraftModel.naive_generate`` runs on beta's class (before: on alpha's, which
    has no ``naive_generate``: verify crashed, exit 3)."""
    from patcher.verify.plumbing.events import error_summary
    from patcher.verify.subjects import decoders, methods

    tree = _two_drafters_tree(tmp_path)
    plan = decoders.plan(tree)
    assert [d["qualname"] for d in plan["decoders"]] == ["DFlashDraftModel.naive_generate"]
    loaded = methods.load(tree, plan, [4], error_summary)
    assert loaded.methods, loaded.decoders
    for method in loaded.methods:
        cls = loaded.drafters[method.drafter]
        assert cls.__module__ == "beta.model" and callable(getattr(cls, "naive_generate", None)), method
    assert {c.__module__ for c in loaded.drafters.values()} == {"alpha.model", "beta.model"}


# ----------------------------------------------------------------------------- 2. never guess an argument
_GUARDED = '''
import torch


def _open_scorer(path, device):
    if path is None:
        raise ValueError("a scorer checkpoint is required")
    return torch.load(path)


def scored_tree_generate(model, target, input_ids, mask_token_id, max_new_tokens, block_size, stop_token_ids,
                         temperature=0.0, scorer_path=None, scorer=None):
    if scorer is None:
        scorer = _open_scorer(scorer_path, input_ids.device)
    cache = None
    while input_ids.shape[1] < max_new_tokens:
        out = target(input_ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return input_ids


def fit_thresholds(model, target, input_ids, batches, rounds=4):
    cache = None
    for batch in batches:
        out = target(batch, past_key_values=cache)
    return out
'''


def _fn(src: str, name: str):
    import linecache

    filename = f"<fork {abs(hash(src))}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # inspect.getsource reads it
    namespace: dict = {}
    exec(compile(src, filename, "exec"), namespace)  # noqa: S102 -- our own test text
    return namespace[name]


def test_an_optional_parameter_of_no_known_name_is_never_bound_by_position():
    """TAPS's shape: upstream's ``tree_budget`` sits 9th, a fork puts ``scorer_path=None`` there; before, verify passed
    the tree budget to it (and the fork's ``torch.load(4)`` failed as if the decoder were wrong)."""
    from patcher.verify.subjects.binding import bind_roles

    roles = bind_roles(_fn(_GUARDED, "scored_tree_generate"))
    assert "scorer_path" not in roles and "scorer" not in roles
    assert roles["temperature"] == "temperature" and roles["max_new_tokens"] == "max_new_tokens"


def test_a_renamed_required_parameter_in_upstreams_order_is_still_bound_by_position():
    from patcher.verify.subjects.binding import NeedsArgument, NotADecoder, bind_roles

    fn = _fn("def f(model, target, input_ids, mask_token_id, new_len, block_size, stop_token_ids): pass", "f")
    assert bind_roles(fn)["new_len"] == "max_new_tokens"
    # not upstream's order: no position is trusted, and the decoder is named with what it needs
    shuffled = _fn("def f_generate(model, target, input_ids, block_size, new_len, mask_token_id): pass", "f_generate")
    with pytest.raises(NeedsArgument, match="needs 'new_len'"):
        bind_roles(shuffled)
    # and a loop that takes no length and is no generate routine is no decoder
    with pytest.raises(NotADecoder, match="not a decoder: calibrate"):
        bind_roles(_fn("def calibrate(model, target, input_ids, batches): pass", "calibrate"))


def test_a_parameter_the_decoder_raises_on_when_left_none_is_what_it_needs():
    from patcher.verify.subjects.needs import needed

    assert needed(_fn(_GUARDED, "scored_tree_generate"), {"model", "target", "input_ids", "mask_token_id", "max_new_tokens",
                                                          "block_size", "stop_token_ids", "temperature"}) == [
        ("scorer_path", "left None, _open_scorer raises ValueError('a scorer checkpoint is required')")]
    # a guard the defaults do not reach (another parameter is given) is no need
    other = _GUARDED.replace("if scorer is None:", "if scorer == 'off':")
    assert needed(_fn(other, "scored_tree_generate"), {"model"}) == []


def test_a_decoder_that_needs_a_value_is_not_verified_and_named_and_a_routine_is_left_out(tmp_path):
    from patcher.verify.plumbing.events import error_summary
    from patcher.verify.subjects import decoders, methods

    tree = tmp_path / "fork"
    tree.mkdir()
    (tree / "scored.py").write_text("import _ddpatch_runtime\n" + _GUARDED)
    (tree / "_ddpatch_runtime.py").write_text("")
    plan = decoders.plan(tree)
    loaded = methods.load(tree, plan, [4], error_summary)
    by_name = {d["qualname"]: d for d in loaded.decoders}
    scored, fit = by_name["scored_tree_generate"], by_name["fit_thresholds"]
    assert not scored["verified"] and scored["needs"] == "scorer_path" and not loaded.methods
    assert scored["reason"].startswith("needs 'scorer_path'") and "--entry" in scored["reason"]
    assert fit["not_decoder"] and not fit["verified"]
    row = methods.coverage_check(loaded.decoders, [], [])
    assert not row["passed"]  # the decoder it could not verify is a finding ...
    assert "scored.py:scored_tree_generate (needs 'scorer_path'" in row["evidence"]
    assert "1 decoder(s) in files ddpatch patched were not verified: scored.py:scored_tree_generate;" in row["evidence"]
    assert "left out, not decoders (no max_new_tokens: they generate nothing): scored.py:fit_thresholds" in row["evidence"]


# ----------------------------------------------------------------------------- 6. partial verdicts, never none
_LOOP = '''
def {name}(model, target, input_ids, max_new_tokens):
    cache = "{name}"  # each body its own: copies of one body are verified once
    while input_ids.shape[1] < max_new_tokens:
        out = target(input_ids, past_key_values=cache)
        model(target_hidden=out, noise_embedding=None)
    return input_ids
'''

#: a stand-in for the verifier's child: it judges its chunk at once, except a chunk holding ``slow_gen`` (it hangs),
#: or, with ``die`` in the chunk's decoder names, it exits without a result
_FAKE_WORKER = '''
import json, os, sys, time
cfg = json.loads(sys.stdin.read())
mine = [tuple(k) for k in cfg.get("run_only") or [[d["file"], d["qualname"]] for d in cfg["plan"]["decoders"]]]
if any(q == "slow_gen" for _, q in mine):
    time.sleep(120)
if any(q == "die_gen" for _, q in mine):
    os._exit(9)
decoders = [dict(d, verified=True, reason="", kind="chain") for d in cfg["plan"]["decoders"]]
rows = [{"check": "loads", "passed": True, "evidence": "all"},
        {"check": "decoders", "passed": True, "evidence": f"{len(decoders)} found, {len(decoders)} verified"}]
model = {"model": "tiny-qwen3_5", "checks": [{"check": "lossless: " + q, "passed": True, "evidence": "4/4 identical",
                                             "decoder": {"file": f, "function": q}} for f, q in mine], "methods": []}
print(json.dumps({"event": "result", "result": {"tree": cfg["tree"], "checks": rows, "models": [model], "decoders": decoders}}))
'''


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A tree of three decoders verified in three chunks, one at a time, by the stand-in child."""
    from patcher.verify.process import runner

    tree = tmp_path / "three"
    tree.mkdir()
    worker = tmp_path / "fake_worker.py"
    worker.write_text(_FAKE_WORKER)
    monkeypatch.setattr(runner, "WORKER", worker)
    monkeypatch.delenv(runner.WARM_ENV, raising=False)
    monkeypatch.setattr(runner, "_slots", lambda: 1)
    monkeypatch.setattr(runner, "warm_verifier", contextlib.nullcontext)  # the stand-in serves no warm verifier

    def split(cfg, cores=None):
        keys = [[d["file"], d["qualname"]] for d in cfg["plan"]["decoders"]]
        return [{**cfg, "run_only": [k], "wave": i} for i, k in enumerate(keys)]

    monkeypatch.setattr(runner, "split", split)

    def verify(*names, timeout=20.0):
        for name in names:
            (tree / f"{name}.py").write_text(_LOOP.format(name=name))
        return runner.run_verify(tree, timeout=timeout, presets=["tiny-qwen3_5"], greedy_only=True)

    return verify


def _row(outcome, name):
    return next(c for c in outcome.result["checks"] if c["check"] == name)


def test_a_timeout_keeps_every_verdict_judged_and_names_the_rest(chunked):
    """Before: 'verify timed out after N s', exit 2, and none of the verdicts the finished children gave."""
    outcome = chunked("a_gen", "b_gen", "slow_gen", timeout=8)
    assert not outcome.passed  # exit 1: findings
    judged = [c["check"] for m in outcome.result["models"] for c in m["checks"]]
    assert judged == ["lossless: a_gen", "lossless: b_gen"]
    slow = next(d for d in outcome.result["decoders"] if d["qualname"] == "slow_gen")
    assert not slow["verified"] and slow["reason"] == "not verified on tiny-qwen3_5: timed out after 8 s"
    assert _row(outcome, "decoders")["evidence"].startswith("1 decoder(s) not verified: slow_gen.py:slow_gen (timed out after 8 s)")
    finished = _row(outcome, "verify finished")
    assert not finished["passed"] and finished["evidence"].startswith("2 of 3 part(s) judged; timed out after 8 s")
    cli = run("verify", outcome.result["tree"], "--preset", "tiny-qwen3_5", "--greedy-only", "--timeout", "8")
    assert cli.exit_code == 1 and "not verified: slow_gen.py:slow_gen (timed out after 8 s)" in cli.output, cli.output
    assert "lossless: b_gen" in cli.output


def test_a_child_that_dies_leaves_the_others_verdicts(chunked):
    outcome = chunked("a_gen", "die_gen", "c_gen")
    assert [c["check"] for m in outcome.result["models"] for c in m["checks"]] == ["lossless: a_gen", "lossless: c_gen"]
    dead = next(d for d in outcome.result["decoders"] if d["qualname"] == "die_gen")
    assert not dead["verified"] and "its verifier child died" in dead["reason"]
    assert not _row(outcome, "verify finished")["passed"]


def test_a_timeout_before_anything_was_judged_is_still_one_line_naming_the_decoders(chunked):
    from patcher.errors import VerifyError

    with pytest.raises(VerifyError, match=r"timed out after 3 s before any decoder was judged \(not verified: slow_gen.py:slow_gen"):
        chunked("slow_gen", timeout=3)


# ----------------------------------------------------------------------------- 5. what a fork adds is named first
_RECOVERING = '''\
from transformers import DynamicCache

from aa_shared import log_round, tidy


def recover_generate(model, target, input_ids, max_new_tokens, block_size=4, stop_token_ids=None, recovery=None):
    cache = DynamicCache()
    out = []
    while len(out) < max_new_tokens:
        logits = target(input_ids, past_key_values=cache).logits
        if recovery is not None:
            cache.crop(len(out))
            recovery.rewind(cache)
        log_round(cache, len(out))
        if len(out) > 10**9:
            cache.crop(0)
        out.append(int(logits[0, -1].argmax()))
    return out
'''
_SHARED = '''\
def log_round(cache, n, deep=False):
    if deep:
        cache.crop(n)
    if n > 10**9:
        cache.crop(0)
        tidy(cache)
    if n < 0:
        cache.crop(1)


def tidy(cache):
    cache.crop(0)
'''


def test_the_path_behind_a_none_parameter_is_named_first_and_said_unproven(tmp_path):
    """A fork's recovery path behind ``recovery=None`` that no run entered: first in the text, by name and line, and said
    to be unproven there (before: after the shared helper's branches, and past the text's cut, only in the JSON)."""
    from patcher.verify.judge.coverage import rows as coverage_rows
    from patcher.verify.subjects.decoder_code import decoder_code
    from patcher.verify.subjects.reach import Tree

    (tmp_path / "fork.py").write_text(_RECOVERING)
    (tmp_path / "aa_shared.py").write_text(_SHARED)  # a helper file that sorts before the fork's own
    roles = {"model": "draft", "target": "target", "input_ids": "input_ids", "max_new_tokens": "max_new_tokens",
             "block_size": "block_size", "stop_token_ids": "stop_token_ids"}
    dc = decoder_code(Tree(tmp_path), ("fork.py", "recover_generate"), roles, {"block_size": 4})
    lines = _RECOVERING.splitlines()
    guard = next(i for i, text in enumerate(lines, 1) if "if recovery is not None" in text)
    huge = next(i for i, text in enumerate(lines, 1) if "if len(out) > 10**9" in text)
    ran: dict = {}
    for (file, _qualname), code in dc.functions().items():  # every statement ran but the arms' bodies
        for first, own in code.statements.items():
            if not (file == "fork.py" and (guard < first <= guard + 2 or first == huge + 1)) \
                    and not (file == "aa_shared.py" and first not in (1, 2, 4, 7)):
                ran.setdefault(file, set()).update(own)
    row = coverage_rows.row("recover", dc, ran, {"roles": roles}, sampled=True)
    never = row["evidence"].split("never ran: ", 1)[1]
    assert never.startswith(f"fork.py:recover_generate line {guard + 1}-{guard + 2} (if recovery is not None; behind recovery, "
                            "it defaults to None and no run gave it a value: this path is unproven"), row["evidence"]
    own = never.index(f"fork.py:recover_generate line {huge + 1} (if len(out) > 10 ** 9")
    assert own < never.index("aa_shared.py:log_round"), "the fork's own branch comes before a shared helper's"


def test_apply_writes_the_relative_runtime_import_at_a_package_trees_root(tmp_path):
    from patcher.engine.packages import package_modes

    (tmp_path / "__init__.py").write_text("")
    assert package_modes(tmp_path, {"model.py": "import torch\n", "sub/x.py": "import torch\n"}) == {"model.py": True,
                                                                                                     "sub/x.py": "both"}
    (tmp_path / "__init__.py").unlink()  # a checkout's root: its modules are imported from the root
    assert package_modes(tmp_path, {"model.py": "import torch\n"}) == {"model.py": False}
