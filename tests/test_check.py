"""The one check type (patcher/verify/check.py): every verify row is a ``Check``; its JSON is the row the report
has always printed, key for key and in the same order, and every renderer reads it by its status."""

from __future__ import annotations

import json

import pytest

from patcher.results import Outcome
from patcher.verify.check import CONTROL, FAIL, INCONCLUSIVE, INFO, PASS, SKIP, WARNING, Check, checks_of

#: rows as verify writes them, keys in the order their oracles wrote them (a rollback row names its histogram first)
ROWS = [
    {"check": "lossless: ddtree", "passed": True, "evidence": "4/4 runs token-identical",
     "decoder": {"file": "ddtree.py", "function": "ddtree_generate", "kind": "tree", "drafter": "DFlashDraftModel"}},
    {"check": "rollback seen: dflash", "histogram": {"1": 3, "2": 1}, "passed": False, "inconclusive": True,
     "evidence": "inconclusive: no round ran", "real_drafter": True},
    {"check": "warms up", "passed": False, "error": "KeyError: 'x'", "hint": "crop", "evidence": "dflash (x.py): KeyError"},
    {"check": "drafter class D", "passed": True, "info": True, "evidence": "not run on this model: no config"},
    {"check": "native generate() (control): greedy", "passed": True, "control": True, "evidence": "ran"},
    {"check": "drafter: dflash", "passed": True, "skipped": True, "evidence": "drafter oracle: skipped (unbindable)"},
    {"check": "coverage: dflash", "passed": True, "warning": True, "evidence": "2 lines no run executed"},
    {"check": "upstream tests", "passed": True, "original": "/tmp/x"},  # no evidence at all
]


@pytest.mark.parametrize("row", ROWS, ids=[r["check"] for r in ROWS])
def test_a_row_round_trips_byte_for_byte(row):
    check = Check.from_json(row)
    assert json.dumps(check.to_json()) == json.dumps(row)  # same keys, same order
    assert Check.from_json(check.to_json()) == check


def test_status_from_passed_and_the_flags():
    assert [Check.from_json(r).status for r in ROWS] == [PASS, INCONCLUSIVE, FAIL, INFO, CONTROL, SKIP, WARNING, PASS]
    assert Check.of("x", passed=False, skipped=True).status == FAIL  # a flag never turns a failure into a pass


def test_of_keeps_the_keyword_order_and_with_updates_as_a_dict_would():
    made = Check.of("rollback seen: m", histogram={"1": 2}, passed=False, inconclusive=True, evidence="e")
    assert list(made.to_json()) == ["check", "histogram", "passed", "inconclusive", "evidence"]
    settled = made.with_(passed=True, inconclusive=False, evidence="seen", where="there")
    assert settled.to_json() == {"check": "rollback seen: m", "histogram": {"1": 2}, "passed": True, "inconclusive": False,
                                 "evidence": "seen", "where": "there"}
    assert list(settled.to_json())[-1] == "where" and made.passed is False  # frozen: the original is unchanged
    with pytest.raises(AttributeError):
        made.passed = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        made.figures["x"] = 1  # type: ignore[index]


def test_a_plain_check_writes_check_passed_evidence_then_its_figures():
    assert list(Check("n", True, "why", {"a": 1}).to_json()) == ["check", "passed", "evidence", "a"]
    assert "evidence" not in Check("n", True).to_json()
    with pytest.raises(ValueError, match="not a check row"):
        Check.from_json({"model": "m"})


def test_outcome_reads_its_rows_as_checks():
    outcome = Outcome({"checks": [ROWS[0]], "models": [{"model": "m", "checks": [ROWS[1]]}]}, 1.0)
    assert [c.name for c in checks_of(outcome.checks)] == ["lossless: ddtree", "rollback seen: dflash"]
    assert not outcome.passed
    assert Outcome({"checks": [ROWS[0]], "models": []}, 1.0).passed


def test_every_format_renders_a_check_by_its_status():
    from patcher.report.html import render_html
    from patcher.report.json_report import verify_verdict_word
    from patcher.report.text import _evidence, _mark, verify_verdict

    assert [_mark(Check.from_json(r)) for r in ROWS[:5]] == [
        "[green]pass[/]", "[bold red]FAIL[/]", "[bold red]FAIL[/]", "[blue]info[/]", "[cyan]control[/]"]
    crashed = Check.of("warms up", passed=False, error="E", frame="a.py:3", hint="crop", inside="in f", evidence="boom")
    assert _evidence(crashed) == "boom (at a.py:3) - hint: recipe step crop - in f"
    inconclusive = Outcome({"checks": [], "models": [{"model": "m", "checks": [ROWS[0], ROWS[1]]}]}, 1.0)
    assert verify_verdict_word(inconclusive) == "inconclusive"
    assert verify_verdict(inconclusive).startswith("[bold yellow]INCONCLUSIVE[/]: inconclusive")
    html = render_html(inconclusive, "INCONCLUSIVE")
    assert "<td>rollback seen: dflash</td><td class='inc'>inconclusive</td>" in html
    control = render_html(Outcome({"checks": [], "models": [{"model": "m", "checks": [ROWS[4]]}]}, 1.0), "PASS")
    assert "<td class='pass'>pass</td>" in control  # HTML shows a control row as a pass, as it always has


def test_the_oracles_rows_keep_the_key_order_the_report_always_printed():
    """The oracles make their rows with ``Check.of``: the JSON keys come out in the order the rows had as dict
    literals (a report stays byte-for-byte what it was), figures between ``passed`` and ``evidence`` included."""
    from patcher.verify.judge.drafter.verdict import class_row, method_check
    from patcher.verify.judge.rollback import rollback_check
    from patcher.verify.judge.tokens import lossless_check

    assert list(rollback_check("m", [1, 1], 4)) == ["check", "histogram", "passed", "inconclusive", "evidence"]
    assert list(rollback_check("m", [2, 3, 1], 4)) == ["check", "histogram", "passed", "evidence"]
    masked = [{"prompt": 0, "verdict": {"identical": False}, "ties": {"kind": "mask-token"}, "ties_description": "d"}]
    assert list(lossless_check("m", masked)) == ["check", "passed", "inconclusive", "evidence"]
    bad = {"passed": False, "failures": [1], "worst": {}, "top1": [0, 0], "rounds": 1}
    assert list(method_check("m", [{"prompt": 0, "drafter": bad, "drafter_description": "b"}])) == [
        "check", "failures", "passed", "evidence"]
    assert list(class_row("C", "why", False)) == ["check", "passed", "info", "evidence"]
