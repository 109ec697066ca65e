"""The acceptance floor's parts, without models: ddpatch's own tree (the best nodes), what a drafter within
epsilon may accept at one start (chain and tree), the lowest mean acceptance over every such decode, and the
``acceptance: METHOD`` row it feeds (judged, failed with both figures, or reported when there is no floor)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from patcher.verify.judge.acceptance import reference_decode as rd, verdict as acceptance


def _brute_force_best(logprobs, budget):
    depth, vocab = logprobs.shape
    scores = {}
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            scores[path] = float(sum(logprobs[i, t] for i, t in enumerate(path)))
    return set(sorted(scores, key=scores.get, reverse=True)[:budget])


@pytest.mark.parametrize("seed", range(6))
def test_the_tree_is_the_budget_best_nodes_of_the_implicit_tree(seed):
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(3, 4, generator=gen) * 2, -1)
    for budget in (1, 3, 5, 9, 20):
        assert set(rd.best_nodes(logprobs, budget)) == _brute_force_best(logprobs, budget), budget


def _logits(rows: list[dict[int, float]], vocab: int = 6):
    out = torch.full((len(rows), vocab), -5.0)
    for i, row in enumerate(rows):
        for t, v in row.items():
            out[i, t] = v
    return out


def test_a_chain_accepts_the_agreeing_prefix_and_a_near_tie_may_go_either_way():
    gold = [1, 2, 3]
    clear = _logits([{1: 3.0}, {2: 3.0}, {4: 3.0}])
    assert rd.chain_at(clear, gold, eps=1e-3) == (3, [3])  # two proposals agree, the third does not: 2 + the target's
    tied = _logits([{1: 3.0}, {2: 3.0, 5: 3.0 - 1e-3}, {4: 3.0}])  # gold's token 1e-3 above another: within 2 eps
    assert rd.chain_at(tied, gold, eps=1e-3) == (3, [2, 3])
    assert rd.chain_at(tied, gold, eps=1e-4) == (3, [3])


def test_a_confident_tree_has_no_tie_with_its_own_descendants():
    """Budget 4 of a drafter sure of every token: the depth-5 node scores a hair below the depth-4 one, but a child
    can never come before its parent, so the round accepts 5 whatever the noise (not anywhere from 1 to 5)."""
    gold = [1, 2, 3, 4, 5, 1, 2]
    sure = _logits([{g: 12.0} for g in gold])
    assert rd.tree_at(sure, gold, budget=4, eps=1.4e-3) == (5, [5])
    assert rd.tree_at(sure, gold, budget=8, eps=1.4e-3) == (8, [8])


def test_a_tree_boundary_tie_with_an_unrelated_node_is_reachable_both_ways():
    gold = [1, 2]
    # depth 1: token 1 (gold), token 3 almost as likely; depth 2: token 2, sure. Budget 2: the gold path (1,), (1, 2)
    # just ahead of (3,) and (3, 2). Within epsilon (3,) may come before (1, 2) (accepted 2), or (3,) and (3, 2)
    # before (1,) itself (accepted 1): from scratch 3
    logits = _logits([{1: 2.0, 3: 2.0 - 1e-4}, {2: 12.0}])
    assert rd.tree_at(logits, gold, budget=2, eps=1e-3) == (3, [1, 2, 3])
    assert rd.tree_at(logits, gold, budget=2, eps=1e-7) == (3, [3])
    assert rd.tree_at(logits, gold, budget=3, eps=1e-3) == (3, [2, 3])  # (3,) and (3, 2) may still push out (1, 2)
    assert rd.tree_at(logits, gold, budget=4, eps=1e-3) == (3, [3])  # room for all four


def _brute_force_floor(reachable_at, n):
    best = float("inf")

    def go(s, total, rounds):
        nonlocal best
        if s >= n:
            best = min(best, total / rounds)
            return
        for a in reachable_at[s]:
            go(s + a, total + a, rounds + 1)

    go(0, 0, 0)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_the_floor_is_the_lowest_mean_of_every_decode_within_epsilon(seed):
    rng = random.Random(seed)
    n = rng.randint(4, 14)
    reach = [sorted(rng.sample(range(1, 6), rng.randint(1, 2))) for _ in range(n)]
    assert rd.floor(reach, n) == pytest.approx(_brute_force_floor(reach, n))
    exact = [[r[0]] for r in reach]  # no near-tie: the floor is the one decode's mean
    rounds = rd.walk([r[0] for r in reach], n)
    assert rd.floor(exact, n) == pytest.approx(sum(rounds) / len(rounds))


def test_a_stop_token_ends_the_walk_like_upstream_loops():
    at = [3] * 10
    assert rd.walk(at, 10) == [3, 3, 3, 3]
    assert rd.walk(at, 10, stop_at=5) == [3, 3]  # the second round commits new tokens 4..6
    assert rd.floor([[3]] * 10, 10, stop_at=5) == 3.0


# ----------------------------------------------------------------------------- the row
def _floor(at, reach=None, greedy=(5, 6, 7, 8, 9, 10, 11, 12)):
    reach = reach or [[a] for a in at]
    entry = {"at": at, "reachable": reach, "reference_decode": rd.walk(at, 8)}
    return {"settings": {"dtype": "float32", "block_size": 4, "budgets": [4], "max_new_tokens": 8, "stop_token_ids": []},
            "prompts": [{"ids": [1, 2], "greedy": list(greedy), "stop_at": None, "methods": {"dflash": entry, "ddtree_tb4": entry}}]}


CFG = {"block_size": 4, "max_new_tokens": 8, "stop_token_ids": [], "temperature": 0.0}
OK = {"passed": True}


def _run(acc, identical=True):
    return [{"prompt": 0, "acceptance": acc, "verdict": {"identical": identical}}]


def test_the_row_passes_at_the_reference_and_fails_below_the_floor_naming_both_figures():
    data = _floor([4] * 8)
    refs = [[5, 6, 7, 8, 9, 10, 11, 12]]
    good = acceptance.method_check("dflash", _run([4, 4]), data, "", CFG, "float32", refs, OK)
    assert good["check"] == "acceptance: dflash" and good["passed"] and not good.get("info"), good
    assert good["evidence"].startswith("the integration is exact: the drafter is the limit")
    assert "reference 4.00" in good["evidence"] and "drafter oracle: pass" in good["evidence"]
    bad = acceptance.method_check("ddtree_tb4", _run([2, 2, 2, 2]), data, "", CFG, "float32", refs, OK)
    assert not bad["passed"] and bad["check"] == "acceptance: ddtree_tb4"
    assert bad["verdict"].startswith("the integration loses acceptance: mean 2.00 < floor 4.00 on prompt 0"), bad
    assert "first round that differs: prompt 0, round 0, at new token 1: accepted 2 where a correct tree accepts 4" in bad["verdict"]
    # a near-tie at the first start lets a correct tree accept 3 there: 3 + 4 + ... is still at or above the floor
    tied = _floor([4] * 8, reach=[[3, 4]] + [[4]] * 7)
    assert acceptance.method_check("dflash", _run([3, 4, 4]), tied, "", CFG, "float32", refs, OK)["passed"]


def test_every_round_is_judged_from_its_own_start_both_ways():
    """A round may not accept less than any correct decoder could from its start, nor more: a tree built against
    the algorithm (a budget off by one) can accept more where its mean still looks fine."""
    refs = [list(range(5, 21))]
    cfg = {**CFG, "max_new_tokens": 16}
    data = _floor([2] * 16, greedy=refs[0])
    data["settings"]["max_new_tokens"] = 16
    up = acceptance.method_check("ddtree_tb4", _run([2, 2, 3, 2, 2]), data, "", cfg, "float32", refs, OK)
    assert not up["passed"] and up["verdict"].startswith("the tree is not built as the algorithm says: prompt 0, round 2, at new "
                                                         "token 5: accepted 3 where a correct tree accepts at most 2"), up
    first = up["per_prompt"][0]
    assert first["acceptance"] == [2, 2, 3, 2, 2] and first["reference_acceptance"] == [2, 2, 2, 2, 2, 2]
    assert [o["way"] for o in first["off"]] == ["above"]
    # one round short among rounds at the reference: the mean may stay above the floor of a prompt with near-ties
    # elsewhere, the round is still named
    reach = [[2]] * 4 + [[1, 2, 3]] * 12
    short = acceptance.method_check("dflash", _run([2, 1, 3, 3, 3, 3]), _floor([2] * 4 + [3] * 12, reach=reach, greedy=refs[0]) |
                                    {"settings": {**data["settings"]}}, "", cfg, "float32", refs, OK)
    assert not short["passed"] and "round 1, at new token 3: accepted 1 where a correct DFlash accepts 2" in short["verdict"], short


def test_a_drafter_that_predicts_nothing_is_inconclusive_not_a_pass():
    refs = [[5, 6, 7, 8, 9, 10, 11, 12]]
    row = acceptance.method_check("dflash", _run([1, 1, 1, 1]), _floor([1] * 8), "", CFG, "float32", refs, OK)
    assert not row["passed"] and row["inconclusive"] and "accepts 1 token in every one of the 4 rounds" in row["evidence"], row


def test_without_a_floor_or_outside_its_settings_the_row_reports_and_never_fails():
    refs = [[5, 6, 7, 8, 9, 10, 11, 12]]
    row = acceptance.method_check("dflash", _run([1, 1, 1]), None, "no stored floor for this drafter", CFG, "float32", refs,
                                  {"passed": False})
    assert row["passed"] and row["info"] and "no stored floor for this drafter" in row["evidence"]
    assert "mean 1.00" in row["evidence"] and "drafter oracle: FAIL" in row["evidence"]
    for cfg, dtype, why in (({**CFG, "block_size": 8}, "float32", "block size 4"), (CFG, "bfloat16", "measured in float32"),
                            ({**CFG, "max_new_tokens": 16}, "float32", "covers 8 new tokens")):
        row = acceptance.method_check("dflash", _run([1] * 8), _floor([4] * 8), "", cfg, dtype, refs, OK)
        assert row["passed"] and row["info"] and why in row["evidence"], row
    row = acceptance.method_check("ddtree_tb16", _run([1] * 8), _floor([4] * 8), "", CFG, "float32", refs, OK)
    assert row["info"] and "no floor for tree budget 16" in row["evidence"]


def test_a_prompt_whose_greedy_continuation_differs_is_left_out_not_judged():
    data = _floor([4] * 8)
    other = [[5, 6, 7, 99, 9, 10, 11, 12]]  # a near-tie of the target on this machine
    row = acceptance.method_check("dflash", _run([1] * 8), data, "", CFG, "float32", other, OK)
    assert row["passed"] and row["info"] and "left out" in row["evidence"]
