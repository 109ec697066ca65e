"""``ddpatch referee``: the engine's tokens and acceptance beside the reference, counted as engines count (issue 44).
The verdict's branches on made-up answers; bad input through the CLI. A real llama.cpp server runs it in
``tests/test_engine_llamacpp.py``."""

from __future__ import annotations

import json
import socket

import pytest
from click.testing import CliRunner

from patcher.cli import main
from patcher.referee.counters import Acceptance, EngineAnswer
from patcher.referee.reference import PromptReference, engine_floor, engine_rounds
from patcher.referee.run import judge_prompt, verdict

N = 16


def reference(at=4, reach=None, greedy=None) -> PromptReference:
    greedy = list(greedy or range(100, 100 + N))
    chain = {"at": [at] * N, "reachable": reach or [[at]] * N}
    return PromptReference(ids=[1, 2, 3], greedy=greedy, stop_at=None, methods={"dflash": chain, "ddtree_tb8": chain})


def answer(tokens, accepted, rounds) -> EngineAnswer:
    acc = Acceptance(drafted=accepted + rounds, accepted=accepted, rounds=rounds, rounds_exact=True, source="test")
    return EngineAnswer(engine="llama.cpp", api="completion", output_ids=list(tokens), text="", finish="length", prompt_tokens=3,
                        counters={}, acceptance=acc)


def test_engine_rounds_clip_the_last_drafts_and_a_lone_last_token_is_no_round():
    # 16 new tokens: the prefill decides the first; at 4 a round, the 15 others in 4 rounds, the last cut to the 3 left
    assert engine_rounds([4] * N, N) == [4, 4, 4, 3]
    assert engine_rounds([4] * N, 14) == [4, 4, 4]  # 13 to decide: the last one alone, a plain decode (no draft, no round)
    assert engine_floor([[4]] * N, N) == pytest.approx(15 / 4)
    assert engine_floor([[3, 4]] * N, N) < engine_floor([[4]] * N, N) <= engine_floor([[3, 4]] * N, N, lowest=False)


def test_the_engine_at_a_correct_dflashs_acceptance_is_exact():
    ref = reference()
    rows = [judge_prompt(0, ref, answer(ref.greedy, 11, 4), N, [8])]
    v = verdict(rows, "llama.cpp")
    assert v["passed"] and v["kind"] == "exact" and v["line"].startswith("the engine reaches a correct DFlash's acceptance"), v
    assert rows[0]["engine"] == pytest.approx(3.75) and rows[0]["reference"] == pytest.approx(3.75)


def test_an_engine_below_the_floor_loses_acceptance_with_both_figures():
    ref = reference()
    rows = [judge_prompt(0, ref, answer(ref.greedy, 5, 9), N, [8])]
    v = verdict(rows, "llama.cpp")
    assert not v["passed"] and v["kind"] == "loses acceptance"
    assert v["line"].startswith("the engine accepts 1.56 where a correct DFlash accepts 3.75: the integration loses acceptance"), v


def test_an_engine_that_counts_more_than_any_correct_dflash_could_is_named():
    ref = reference()
    v = verdict([judge_prompt(0, ref, answer(ref.greedy, 14, 1), N, [8])], "vllm")
    assert not v["passed"] and v["kind"] == "counts more" and "vllm's documented definition" in v["line"], v


def test_other_tokens_are_not_lossless_and_say_where():
    ref = reference()
    tokens = list(ref.greedy)
    tokens[5] = 7
    v = verdict([judge_prompt(0, ref, answer(tokens, 11, 4), N, [8])], "llama.cpp")
    assert not v["passed"] and v["kind"] == "not lossless"
    assert v["line"].startswith("the engine's output differs from the target's greedy at token 5 (prompt 0: 7 where the target "
                                "takes 105"), v


def test_a_drafter_that_predicts_nothing_is_inconclusive():
    ref = reference(at=1)
    v = verdict([judge_prompt(0, ref, answer(ref.greedy, 0, 14), N, [8])], "llama.cpp")
    assert not v["passed"] and v["kind"] == "inconclusive", v


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_engine_that_does_not_answer_is_one_line_and_exit_2(fmt):
    from patcher.verify.models.trained import FOLDER_PRESETS

    target, draft = FOLDER_PRESETS["trained-qwen3_5"]
    result = CliRunner().invoke(main, ["referee", "--engine", f"http://127.0.0.1:{_closed_port()}", "--target", str(target),
                                       "--draft", str(draft), "--format", fmt])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddpatch: error:") and "127.0.0.1" in lines[0], lines
    if fmt == "json":
        payload = json.loads(result.stdout)
        assert payload["command"] == "referee" and payload["exit_code"] == 2


def test_a_bad_folder_or_prompts_file_is_one_line_before_any_request(tmp_path):
    from patcher.verify.models.trained import FOLDER_PRESETS

    target, draft = FOLDER_PRESETS["trained-qwen3_5"]
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    for args, says in ((["--target", str(draft), "--draft", str(draft)], "is a drafter"),
                       (["--target", str(target), "--draft", str(draft), "--prompts-file", str(empty)], "prompts.jsonl")):
        result = CliRunner().invoke(main, ["referee", "--engine", "http://127.0.0.1:9", *args])
        assert result.exit_code == 2 and says in result.stderr, result.output


def test_the_html_page_draws_each_round_against_the_reference_and_acceptance_by_budget():
    from patcher.report.html import render_html
    from patcher.results import Outcome

    def row(name, mean, ref, judged):
        return {"check": f"acceptance: {name}", "passed": True, "evidence": "", "acceptance_mean": mean, "judged_mean": mean,
                "reference_mean": ref, "per_prompt": [{"prompt": 0, "judged": judged}]}

    judged = [{"round": 0, "start": 0, "accepted": 3, "reachable": [3]}, {"round": 1, "start": 3, "accepted": 1, "reachable": [4]}]
    checks = [row("dflash", 3.0, 3.2, judged), row("ddtree_tb8", 3.5, 3.6, judged), row("ddtree_tb16", 4.0, 4.1, judged)]
    page = render_html(Outcome({"tree": "t", "models": [{"model": "pair", "checks": checks, "methods": []}]}, 1.0), "FAIL")
    assert page.count('aria-label="acceptance per round against the reference') == 3
    assert 'aria-label="acceptance by tree budget against DFlash"' in page
    assert "round 1 at new token 4: accepted 1" in page and 'fill="#c00"' in page  # the round outside its set, in red


def test_prompts_above_and_below_a_correct_dflash_say_the_drafter_is_fed_otherwise():
    """The converter's ``+ 1`` forgotten: the same acceptance overall, other rounds on every prompt (docs/engines.md)."""
    ref = reference()
    rows = [judge_prompt(0, ref, answer(ref.greedy, 6, 5), N, [8]), judge_prompt(1, ref, answer(ref.greedy, 14, 1), N, [8])]
    v = verdict(rows, "llama.cpp")
    assert not v["passed"] and v["kind"] == "differs", v
    assert "1 of 2 prompts below their floor (prompt 0: 2.20 < 3.75), 1 above what a correct DFlash reaches (prompt 1: 15.00" in v["line"]
