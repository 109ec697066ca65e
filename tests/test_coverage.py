"""Coverage, stated by line and by flag (docs/verifier.md#coverage-by-line-and-by-flag): what a decoder's code is
(``subjects.coverage``), the row that names what never ran and fails what can change tokens behind a parameter
(``judge.coverage.rows``), the collector (coverage.py, ``judge.coverage.runs``) and, end to end, a KV-trim flag
planted in the real DDTree: named by flag and lines, and run with its True value, failing on the hybrid."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patcher.verify.judge.coverage import rows as coverage_rows
from patcher.verify.subjects.binding import BindError, call_generate
from patcher.verify.subjects.decoder_code import decoder_code
from patcher.verify.subjects.reach import Tree

ROOT = Path(__file__).resolve().parent.parent

FORK = '''\
from typing import Literal

from transformers import DynamicCache

from helpers import log, trim_cache


def fork_generate(model, target, input_ids, max_new_tokens, block_size=4, stop_token_ids=None, trim_kv: bool = False,
                  verbose: bool = False, attention: Literal["chain", "tree"] = "chain", schedule="fixed"):
    """A fork's decoder: every shape of mode the verifier reads."""
    cache = DynamicCache()
    trim = trim_kv and block_size > 1
    if block_size <= 1:
        return target(input_ids)
    out = []
    while len(out) < max_new_tokens:
        logits = target(input_ids, past_key_values=cache).logits
        if trim:
            trim_cache(cache, len(out))
        if verbose:
            print("round", len(out))
        if attention == "tree":
            cache.crop(3)
        elif schedule == "adaptive":
            log("adaptive")
        out.append(int(logits[0, -1].argmax()))
    return out
'''
HELPERS = '''\
def trim_cache(cache, n, hard=False):
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :n]
    if hard:
        cache.crop(n)


def log(message):
    print(message)
'''
ROLES = {"model": "draft", "target": "target", "input_ids": "input_ids", "max_new_tokens": "max_new_tokens",
         "block_size": "block_size", "stop_token_ids": "stop_token_ids"}


@pytest.fixture
def fork(tmp_path):
    (tmp_path / "fork.py").write_text(FORK)
    (tmp_path / "helpers.py").write_text(HELPERS)
    return decoder_code(Tree(tmp_path), ("fork.py", "fork_generate"), ROLES, {"block_size": 4})


def line_of(text: str, source: str = FORK) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


def arm(dc, head: str, key=("fork.py", "fork_generate")):
    code = dc.functions()[key]
    source = FORK if key[0] == "fork.py" else HELPERS
    return code, next(a for a in code.arms if a.line == line_of(head, source))


def every_line(dc, leave_out=()) -> dict:
    """The lines a run that executed every statement would report, less the statements in ``leave_out``'s spans."""
    ran: dict = {}
    for (file, _), code in dc.functions().items():
        for first, own in code.statements.items():
            if not any(f == file and a <= first <= b for f, a, b in leave_out):
                ran.setdefault(file, set()).update(own)
    return ran


def test_a_decoders_modes_guards_and_sites_are_read_from_its_code(fork):
    assert fork.modes["trim_kv"]["values"] == [True] and fork.modes["verbose"]["values"] == [True]
    assert fork.modes["attention"]["values"] == ["tree"], "a Literal: every value but the default"
    assert fork.modes["schedule"]["values"] == ["adaptive"], "a parameter compared with a string constant"
    assert fork.modes["block_size"]["values"] == [1], "the value that turns `block_size <= 1` the other way than 4"
    assert "stop_token_ids" not in fork.modes and "max_new_tokens" not in fork.modes, "inputs the verifier sets are no modes"
    code, trim = arm(fork, "if trim:")
    assert fork.guards(code, trim) == ["block_size", "trim_kv"], "through the local `trim = trim_kv and block_size > 1`"
    assert any("calls trim_cache (a cache-layer edit (layer.keys))" in s for st in code.arm_statements(trim)
               for s in fork.sites[code.key].get(st, ()))
    code, verbose = arm(fork, "if verbose:")
    assert fork.guards(code, verbose) == ["verbose"] and not any(fork.sites[code.key].get(st) for st in code.arm_statements(verbose))
    code, tree = arm(fork, 'if attention == "tree":')
    assert fork.guards(code, tree) == ["attention"] and fork.sites[code.key][tree.first] == ["a cache call (.crop)"]
    code, adaptive = arm(fork, 'elif schedule == "adaptive":')
    assert fork.guards(code, adaptive) == ["attention", "schedule"], "an elif is behind the tests before it too"
    code, hard = arm(fork, "if hard:", ("helpers.py", "trim_cache"))
    assert fork.guards(code, hard) == [], "no call site passes `hard`: data, not a decoder parameter"
    assert set(fork.helpers) == {("helpers.py", "trim_cache"), ("helpers.py", "log")}


def test_the_row_fails_a_cache_edit_behind_a_flag_warns_a_print_and_says_when_every_line_ran(fork):
    code, trim = arm(fork, "if trim:")
    body = [("fork.py", trim.first, trim.last), ("helpers.py", 1, 99)]
    row = coverage_rows.row("fork", fork, every_line(fork, body), {"roles": ROLES}, sampled=True)
    assert not row["passed"] and "1 unproven branch" in row["evidence"], row["evidence"]
    assert f"fork.py:fork_generate line {trim.first} (if trim; behind block_size" in row["evidence"]
    assert "behind trim_kv, not run: no value was tried" in row["evidence"]
    (finding,) = [f for f in row["coverage"]["never_ran"] if f["unproven"]]
    assert finding["lines"] == [trim.first, trim.last] and finding["guards"] == ["block_size", "trim_kv"]

    record = {"roles": ROLES, "runs": [{"values": {"trim_kv": True}, "method": "fork", "passed": False}]}
    row = coverage_rows.row("fork", fork, every_line(fork), record, sampled=True)
    assert "mode runs: trim_kv=True (FAILED: see its rows)" in row["evidence"]

    record = {"roles": ROLES, "runs": [{"values": {"trim_kv": True}, "passed": True}, {"values": {"block_size": 1}, "passed": True}]}
    row = coverage_rows.row("fork", fork, every_line(fork, body), record, sampled=True)
    assert row["passed"] and row["warning"], "every value of what it reads ran, and it still did not: the data decides"
    assert "behind trim_kv, ran with trim_kv=True: the branch still did not run" in row["evidence"], row["evidence"]

    _, verbose = arm(fork, "if verbose:")
    row = coverage_rows.row("fork", fork, every_line(fork, [("fork.py", verbose.first, verbose.last)]), {"roles": ROLES}, True)
    assert row["passed"] and row["warning"], row
    assert f"no token or cache change in: fork.py:fork_generate line {verbose.first} (behind verbose)" in row["evidence"]

    row = coverage_rows.row("fork", fork, every_line(fork), {"roles": ROLES}, sampled=True)
    total = sum(len(c.statements) for c in fork.functions().values())
    assert row["passed"] and not row["warning"] and row["evidence"] == \
        f"ran {total}/{total} lines of fork.py:fork_generate and 2 helper(s): every line ran", row["evidence"]


def test_a_branch_behind_the_temperature_warns_when_the_user_left_sampling_out(tmp_path):
    (tmp_path / "d.py").write_text(textwrap.dedent('''\
        def gen(model, target, input_ids, max_new_tokens, temperature=0.0):
            cache = make()
            if temperature > 0:
                cache.crop(1)
            return target(input_ids, past_key_values=cache)
        '''))
    roles = {**ROLES, "temperature": "temperature"}
    dc = decoder_code(Tree(tmp_path), ("d.py", "gen"), roles, {"block_size": 4})
    ran = every_line(dc, [("d.py", 4, 4)])
    assert not coverage_rows.row("gen", dc, ran, {"roles": roles}, sampled=True)["passed"]
    row = coverage_rows.row("gen", dc, ran, {"roles": roles}, sampled=False)
    assert row["passed"] and row["warning"] and "this verify ran no sampled pass (--greedy-only)" in row["evidence"]


def test_the_lines_after_an_early_return_are_behind_its_test(tmp_path):
    (tmp_path / "s.py").write_text("def sample(logits, temperature=0.0):\n    if temperature < 1e-5:\n        return logits.argmax()\n"
                                   "    probs = logits.softmax(-1)\n    return probs.multinomial(1)\n")
    dc = decoder_code(Tree(tmp_path), ("s.py", "sample"), {"temperature": "temperature"}, {})
    _, items = coverage_rows.findings(dc, {"s.py": {2, 3}})
    (item,) = items
    assert (item.first, item.last, item.guards) == (4, 5, ["temperature"]) and item.test == "after line 3 (if temperature < 1e-05)"


def test_mode_runs_are_planned_one_value_at_a_time_then_the_combination_a_branch_still_needs(tmp_path):
    from patcher.verify.judge.coverage.runs import plan

    both = FORK.replace("if trim:", "if trim_kv and attention == 'tree':")
    (tmp_path / "fork.py").write_text(both)
    (tmp_path / "helpers.py").write_text(HELPERS)
    dc = decoder_code(Tree(tmp_path), ("fork.py", "fork_generate"), ROLES, {"block_size": 4})
    heads = ("if block_size <= 1:", "if trim_kv and attention", 'if attention == "tree":', "if verbose:", "elif schedule")
    leave = [("fork.py", a.first, a.last) for a in dc.decoder.arms if any(a.line == line_of(h, both) for h in heads)]
    leave.append(("helpers.py", 1, 99))  # no default run entered them
    ran = every_line(dc, leave)
    runs, not_run = plan(dc, ran, ROLES)
    assert runs == [{"block_size": 1}, {"trim_kv": True}, {"attention": "tree"}], runs
    assert set(not_run) == {"verbose", "schedule"} and "prints" in not_run["verbose"]
    runs, _ = plan(dc, ran, ROLES, tried=runs)
    assert runs == [{"trim_kv": True, "attention": "tree"}], "the branch reads both: one run with both"


def test_a_warning_row_reads_warn_and_passes_the_verdict(capsys):
    from patcher.report.text import render_verify
    from patcher.results import Outcome

    row = {"check": "coverage: fork", "passed": True, "warning": True, "evidence": "ran 9/10 lines; never ran: ..."}
    outcome = Outcome({"tree": "t", "environment": {"transformers": "5.24.0", "torch": "2"}, "checks": [row], "models": []}, 1.0)
    render_verify(outcome, color="never")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "coverage: fork" in ln)
    assert " warn " in line and outcome.passed


def test_the_collector_keeps_each_decoders_lines_apart(tmp_path):
    pytest.importorskip("coverage")
    from patcher.verify.judge.coverage.runs import Collector

    (tmp_path / "flagged.py").write_text("def f(flag=False):\n    x = 1\n    if flag:\n        x = 2\n    return x\n")
    spec = importlib.util.spec_from_file_location("flagged_for_coverage", tmp_path / "flagged.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    collector = Collector(tmp_path)
    with collector.measuring("plain"):
        module.f()
    with collector.measuring('flagged|{"flag": true}'):
        module.f(True)
    module.f(True)  # not measured: outside the decoder's call
    assert collector.contexts() == {"plain": {"flagged.py": [2, 3, 5]}, 'flagged|{"flag": true}': {"flagged.py": [2, 3, 4, 5]}}


def test_a_decoder_gets_extra_keyword_arguments_by_name():
    import torch

    def gen(model, target, input_ids, mask_token_id, max_new_tokens, block_size, stop_token_ids, temperature=0.0,
            tree_budget=None, trim_kv=False):
        return torch.tensor([[0, 1, 2, int(trim_kv)]])

    common = dict(model=object(), target=object(), input_ids=torch.zeros(1, 2, dtype=torch.long), mask_token_id=0,
                  max_new_tokens=2, block_size=4, stop_token_ids=None)
    assert call_generate(gen, **common, extra={"trim_kv": True})[0] == [2, 1]
    assert call_generate(gen, **common)[0] == [2, 0]
    with pytest.raises(BindError, match="takes no chain_attention"):
        call_generate(gen, **common, extra={"chain_attention": True})


# ----------------------------------------------------------------------------- end to end: a flag planted in the real DDTree
SMALL = ["--preset", "tiny-qwen3_5", "--seeds", "0", "--prompts", "1", "--max-new-tokens", "16", "--greedy-only", "--format", "json"]


def ddpatch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "patcher", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def edit(tree: Path, rel: str, old: str, new: str) -> Path:
    path = tree / rel
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    return tree


def plant_trim_kv(tree: Path) -> Path:
    """A fork's KV trim behind a flag (``trim_kv=False``), the shape issue 42 met: it trims ``.keys`` of every cache layer,
    which a hybrid's linear-attention layers do not have; and a flag behind which the loop only prints."""
    edit(tree, "ddtree.py", "    tree_budget: int | None = None,\n) -> SimpleNamespace:",
         "    tree_budget: int | None = None, trim_kv: bool = False, verbose: bool = False,\n) -> SimpleNamespace:")
    return edit(tree, "ddtree.py", "        start += committed\n", "        start += committed\n" + textwrap.indent(textwrap.dedent('''\
        if trim_kv:  # keep nothing past the committed prefix
            for layer in past_key_values_target.layers:
                layer.keys = layer.keys[:, :, :start]
                layer.values = layer.values[:, :, :start]
        if verbose:
            print(f"round {len(acceptance_lengths)}: committed {committed}")
        '''), " " * 8))


def verify(tree: Path, *args) -> tuple[int, dict]:
    proc = ddpatch("verify", tree, *SMALL, *args)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def rows(payload: dict) -> dict:
    out = {c["check"]: c for c in payload["checks"]}
    out.update({c["check"]: c for m in payload["models"] for c in m["checks"]})
    return out


@pytest.mark.slow
def test_a_kv_trim_flag_planted_in_ddtree_is_named_by_flag_and_lines_and_its_run_fails_on_the_hybrid(tmp_path):
    pytest.importorskip("coverage")
    proc = ddpatch("apply", ROOT / "vendored" / "ddtree", "--out", tmp_path / "patched")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tree = plant_trim_kv(tmp_path / "patched")
    text = (tree / "ddtree.py").read_text().splitlines()
    first = next(i for i, line in enumerate(text, 1) if line.strip().startswith("if trim_kv:"))
    printed = next(i for i, line in enumerate(text, 1) if line.strip().startswith("if verbose:"))

    code, payload = verify(tree, "--mode-runs", "0")
    row = rows(payload)["coverage: ddtree"]
    assert code == 1 and not row["passed"], row["evidence"]
    assert f"ddtree.py:ddtree_generate line {first + 1}-{first + 3} (if trim_kv; behind trim_kv, not run: --mode-runs 0; " \
           "a cache-layer edit (layer.keys)" in row["evidence"], row["evidence"]
    (trim,) = [f for f in row["coverage"]["never_ran"] if f["guards"] == ["trim_kv"]]
    assert trim["unproven"] and trim["lines"] == [first + 1, first + 3]
    (loud,) = [f for f in row["coverage"]["never_ran"] if f["guards"] == ["verbose"]]
    assert not loud["unproven"] and loud["lines"] == [printed + 1, printed + 1], "a branch that only prints is listed, not failed"

    code, payload = verify(tree)
    checks = rows(payload)
    run = checks["lossless: ddtree_tb4 [trim_kv=True]"]
    assert code == 1 and not run["passed"] and "'LinearAttentionLayer' object has no attribute 'keys'" in run["evidence"], run
    assert run["decoder"]["mode"] == {"trim_kv": True}
    assert "mode runs: block_size=1, trim_kv=True (FAILED: see its rows)" in checks["coverage: ddtree"]["evidence"]
    assert "lossless: ddtree_tb4 [verbose=True]" not in checks, "a flag behind which nothing can change tokens gets no run"
    assert checks["lossless: ddtree_tb4 [block_size=1]"]["passed"], "ddtree's own `block_size <= 1` branch, run and exact"
    assert checks["coverage: dflash"]["passed"] and checks["coverage: dflash"]["warning"], checks["coverage: dflash"]["evidence"]
