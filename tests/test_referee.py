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
from patcher.referee.reference import PromptReference
from patcher.verify.judge.acceptance.reference_decode import floor, walk
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
    assert walk([4] * N, N, engine=True) == [4, 4, 4, 3]
    assert walk([4] * N, 14, engine=True) == [4, 4, 4]  # 13 to decide: the last one alone, a plain decode (no draft, no round)
    assert floor([[4]] * N, N, engine=True) == pytest.approx(15 / 4)
    assert floor([[3, 4]] * N, N, engine=True) < floor([[4]] * N, N, engine=True) <= floor([[3, 4]] * N, N, engine=True, lowest=False)


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


# ----------------------------------------------------------------------------- counts the engine derives (issue 50)
def measured_case():
    """llama-server at its defaults, prompt 3 as measured: 54 accepted drafts in 8 rounds, then one plain step (one token
    left: no draft), 64 new tokens; without --metrics the rounds are derived as 64 - 1 - 54 = 9."""
    from patcher.referee.counters import llamacpp_acceptance

    at = [8] * 64
    at[56] = 6  # the reference: 7 rounds of 8 tokens, one of 6, then the last token alone
    ref = PromptReference(ids=[1, 2, 3], greedy=list(range(100, 164)), stop_at=None,
                          methods={"dflash": {"at": at, "reachable": [[x] for x in at]}, "ddtree_tb8": {"at": at, "reachable": [[x] for x in at]}})
    return ref, llamacpp_acceptance({"draft_n": 62, "draft_n_accepted": 54, "predicted_n": 64})


def derived_answer(ref, acc) -> EngineAnswer:
    return EngineAnswer(engine="llama.cpp", api="/completion", output_ids=list(ref.greedy), text="", finish="limit",
                        prompt_tokens=3, counters={}, acceptance=acc)


def test_rounds_derived_one_too_many_are_judged_by_the_counted_accepted_tokens():
    ref, acc = measured_case()
    assert (acc.rounds, acc.rounds_range, acc.exact) == (9, (8, 9), False)
    rows = [judge_prompt(3, ref, derived_answer(ref, acc), 64, [8])]
    assert rows[0]["reference"] == pytest.approx(7.75) and rows[0]["engine"] == pytest.approx(7.0)  # the figure the old verdict failed
    v = verdict(rows, "llama.cpp")
    assert v["passed"] and v["kind"] == "exact", v
    assert rows[0]["judged_by"] == "accepted" and rows[0]["accepted_reference"] == [54, 54]
    assert "counts derived on prompt(s) 3" in v["line"] and "llama-server --metrics" in v["line"], v["line"]
    assert v["engine_range"] == [pytest.approx(7.0), pytest.approx(7.75)] and v["derived"] == [3]


def test_rounds_derived_still_fail_an_engine_that_accepts_fewer_drafts():
    from patcher.referee.counters import llamacpp_acceptance

    ref, _ = measured_case()
    acc = llamacpp_acceptance({"draft_n": 120, "draft_n_accepted": 40, "predicted_n": 64})
    v = verdict([judge_prompt(3, ref, derived_answer(ref, acc), 64, [8])], "llama.cpp")
    assert not v["passed"] and v["kind"] == "loses acceptance", v
    assert "prompt 3: 40 accepted < the fewest a correct DFlash accepts, 54 (rounds derived" in v["line"], v["line"]


def test_accepted_tokens_derived_across_the_floor_are_inconclusive_and_name_what_counts_them():
    ref, _ = measured_case()
    acc = Acceptance(accepted=54, rounds=8, rounds_exact=True, accepted_exact=False, accepted_range=(50, 54), source="test")
    rows = [judge_prompt(0, ref, derived_answer(ref, acc), 64, [8])]
    v = verdict(rows, "sglang")
    assert not v["passed"] and v["kind"] == "inconclusive" and rows[0]["counts"] == "undecided", v
    assert "prompt 0: its derived counts give 7.25 to 7.75 tokens a round, across its floor 7.75" in v["line"], v["line"]
    assert "spec_num_correct_drafts" in v["line"]
    acc.accepted_range = (53, 54)  # every value within one token of the floor: decided
    assert verdict([judge_prompt(0, ref, derived_answer(ref, acc), 64, [8])], "sglang")["passed"]


# ----------------------------------------------------------------------------- engines in their own precision (issue 50)
V = 8


def forced(path: list[int], prompt_len: int = 3, at: int | None = None, margin: float = 0.0, other: int = 0):
    """Made-up teacher-forced float32 logits over the prompt and ``path``: each emitted token the argmax by 4 logits;
    at ``at`` the token ``other`` on top by ``margin``."""
    import torch

    rows = torch.zeros(prompt_len + len(path), V)
    for i, token in enumerate(path):
        rows[prompt_len - 1 + i, token] = 4.0
    if at is not None:
        rows[prompt_len - 1 + at, other] = 4.0 + margin
    return rows


def tie_case(margin: float, dtype: str | None = "bfloat16", dtype_tolerance: float = 0.05):
    from patcher.referee import ties

    greedy = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2]
    got = greedy[:5] + [0, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3]  # parts at token 5, then its own sequence
    div = ties.judge(forced(got, at=5, margin=margin, other=greedy[5]), 3, greedy, got, 0.0109, dtype=dtype,
                     dtype_tolerance=dtype_tolerance, max_new_tokens=N)
    ref = reference(greedy=greedy)
    engine = answer(got, 11, 4)
    return ref, engine, div, reference(greedy=got)


def test_a_near_tie_in_the_engines_precision_passes_judged_along_its_own_tokens():
    ref, engine, div, along = tie_case(0.0065)
    assert div.kind == "near-tie" and div.margin == pytest.approx(0.0065, abs=1e-6) and "within ε" in div.reason, div
    rows = [judge_prompt(0, ref, engine, N, [8], div, along)]
    assert rows[0]["tokens"] == "near-tie" and rows[0]["reference_along"] == "engine"
    v = verdict(rows, "vllm")
    assert v["passed"] and v["kind"] == "exact" and v["near_ties"] == [0], v
    assert "prompt 0 parts from the target's float32 greedy at token 5 at a near-tie (0 for 6" in v["line"], v["line"]


def test_a_margin_within_the_dtypes_measured_tolerance_is_a_near_tie_and_outside_every_one_is_a_loss():
    _, _, div, _ = tie_case(0.03)  # outside ε, inside bfloat16's measured 0.05
    assert div.kind == "near-tie" and "bfloat16's measured tolerance" in div.reason, div
    _, _, div, _ = tie_case(0.03, dtype="float32", dtype_tolerance=0.0)  # a float32 engine: only ε
    assert div.kind == "loss", div
    ref, engine, div, along = tie_case(3.0)
    assert div.kind == "loss" and not div.ok
    v = verdict([judge_prompt(0, ref, engine, N, [8], div, along)], "vllm")
    assert not v["passed"] and v["kind"] == "not lossless", v
    assert "at token 5 (prompt 0: 0 where the target takes 6: the target's margin there is 3 logits, outside every tolerance" in v["line"]


def test_an_engine_whose_dtype_is_unknown_is_undecided_between_eps_and_bfloat16_and_names_the_flag():
    ref, engine, div, along = tie_case(0.03, dtype=None)
    assert div.kind == "undecided" and "--engine-dtype" in div.reason, div
    v = verdict([judge_prompt(0, ref, engine, N, [8], div, along)], "vllm")
    assert not v["passed"] and v["kind"] == "inconclusive" and "--engine-dtype" in v["line"], v
    _, _, div, _ = tie_case(0.03, dtype=None)
    from patcher.referee import ties

    greedy = ref.greedy
    quantized = ties.judge(forced(engine.output_ids, at=5, margin=0.03, other=greedy[5]), 3, greedy, engine.output_ids, 0.0109,
                           dtype=None, dtype_tolerance=0.05, quantized="Q4_K_M", max_new_tokens=N)
    assert quantized.kind == "undecided" and "Q4_K_M" in quantized.reason
    assert tie_case(3.0, dtype=None)[2].kind == "loss"  # beyond even bfloat16: a loss whatever the dtype


def test_two_logits_that_round_to_one_bfloat16_value_are_told():
    from patcher.referee.ties import rounds_alike

    assert rounds_alike(10.0, 10.0065, "bfloat16") and not rounds_alike(10.0, 10.0065, "float32")
    assert not rounds_alike(10.0, 10.2, "bfloat16")


# ----------------------------------------------------------------------------- the whole referee, a made-up engine
class MadeUpEngine:
    """An engine that decodes the shipped pair's target in float32, takes ``mode``'s token at one position of prompt 0
    ("tie": the runner-up where the target's two best logits lie closest; "loss": the token the target likes least), and
    continues greedily from there; its counters are a correct DFlash's along its own tokens."""

    kind = "vllm"

    def __init__(self, target, draft, mode: str):
        self.target, self.draft, self.mode, self.url, self.calls = target, draft, mode, "http://made-up", 0

    def info(self):
        from patcher.referee.engines import EngineInfo

        return EngineInfo("vllm", self.url, model="made-up", context_length=4096, dtype="bfloat16", dtype_source="test")

    def check_tokenizer(self, text, ids):
        pass

    def generate(self, prompt, n):
        from patcher.referee.reference import along
        from patcher.referee.ties import forward

        seq, part = list(prompt), None
        if self.calls == 0 and self.mode:
            greedy = list(prompt)
            for _ in range(n):
                greedy.append(int(forward(self.target, greedy)[-1].argmax()))
            rows = forward(self.target, greedy)[len(prompt) - 1 : -1]
            top = rows.topk(2, dim=-1)
            margins = (top.values[:, 0] - top.values[:, 1])[2 : n - 6]
            part = 2 + int(margins.argmin()) if self.mode == "tie" else 3
            pick = int(top.indices[part, 1]) if self.mode == "tie" else int(rows[part].argmin())
            seq = greedy[: len(prompt) + part] + [pick]
        self.calls += 1
        while len(seq) < len(prompt) + n:
            seq.append(int(forward(self.target, seq)[-1].argmax()))
        got = seq[len(prompt):]
        at = along(self.target, self.draft, list(prompt), got, [8], 0.0).chain["at"]  # the drafter kind's own chain
        rounds = walk(at, n, engine=True)
        acc = Acceptance(drafted=None, accepted=sum(rounds) - len(rounds), rounds=len(rounds), rounds_exact=True, source="made up")
        return EngineAnswer(engine="vllm", api="made-up", output_ids=got, text="", finish="length", prompt_tokens=len(prompt),
                            counters={"part": part}, acceptance=acc)


@pytest.mark.parametrize("mode", ["tie", "loss"])
def test_the_referee_on_the_shipped_pair_passes_a_near_tie_and_fails_a_loss(monkeypatch, mode):
    from patcher.referee import engines, run
    from patcher.referee.reference import load_pair
    from patcher.verify.models.trained import FOLDER_PRESETS

    target, draft = map(str, FOLDER_PRESETS["trained-qwen3_5"])
    engine = MadeUpEngine(*load_pair(target, draft), mode)
    monkeypatch.setattr(engines, "connect", lambda *a, **k: engine)
    result = run.referee("http://made-up", target, draft, prompts=2, max_new_tokens=24, budgets=(8,))
    v, first = result["verdict"], result["per_prompt"][0]
    assert result["engine_precision"] == {"dtype": "bfloat16", "source": "test", "quantized": None}
    assert first["identical"] is False and first["divergence"]["at"] >= 2, first
    if mode == "tie":
        assert first["tokens"] == "near-tie" and first["divergence"]["margin"] <= first["divergence"]["tolerance"], first
        assert first["reference_along"] == "engine" and first["engine"] == pytest.approx(first["reference"])
        assert v["passed"] and v["near_ties"] == [0] and "at a near-tie" in v["line"], v
    else:
        assert first["tokens"] == "differs" and first["divergence"]["margin"] > 1.0, first
        assert not v["passed"] and v["kind"] == "not lossless" and "outside every tolerance" in v["line"], v


def test_the_text_report_shows_near_ties_derived_ranges_and_the_verdict_as_a_check():
    from patcher.report.referee import referee_text, verdict_check

    row = {"prompt": 0, "identical": False, "first_difference": 38, "tokens": "near-tie", "engine": 3.5, "reference": 3.5,
           "floor": 3.2, "acceptance": {"accepted": 54, "rounds": 9, "exact": False}, "derived": True,
           "engine_range": [6.0, 7.75]}
    result = {"engine": {"kind": "llama.cpp", "url": "http://127.0.0.1:1", "model": "m"}, "seconds": 1.0, "target": "t",
              "draft": "d", "prompts_made": "1 prompt", "max_new_tokens": 64, "per_prompt": [row], "ddtree": {},
              "verdict": {"kind": "inconclusive", "passed": False, "line": "inconclusive: why", "engine": 3.5,
                          "reference": 3.5}}
    text = referee_text(result)
    assert "near-tie at 38" in text and "differs at" not in text
    assert "6.00-7.75" in text  # every value the derived rounds allow
    assert text.rstrip().endswith("INCONCLUSIVE: inconclusive: why")
    check = verdict_check(result)
    assert (check.name, check.status, check.evidence) == ("referee: llama.cpp", "inconclusive", "inconclusive: why")
    result["verdict"].update(kind="exact", passed=True, line="the engine reaches it")
    assert verdict_check(result).status == "pass" and referee_text(result).rstrip().endswith("PASS: the engine reaches it")
