"""Routing flips told from bugs (issue 32): the logits oracle's reference follows a decode's expert choice
where the two choices tie under rounding, and only there.

A tiny DeepSeek-V3 target (top-2 of 4 experts) in bfloat16, decoded token by token with a cache (an exact
decoder) under ``LogitsRecorder``. The planted tie: in layer 1 experts 2 and 3 get the same router row, so
their scores are equal for every token; the decode breaks that tie the other way at one position (expert 3
where the router's own top-k keeps 2). Their experts differ, so everything after that position moves by far
more than the tolerance: the plain from-scratch reference fails the run, the following one passes it. The
planted bug: the router's input at one position is pushed towards another expert; the router logits then
differ by far more than the router tolerance, and the flip is reported, not followed.
"""

from __future__ import annotations

import pytest
import torch

from patcher.verify.judge import calibration, logits as oracle, routers, tokens
from patcher.verify.models import load as models
from patcher.verify.models.presets import build_target

GATE = "model.layers.1.mlp.gate"
TWINS = (2, 3)
NEW = 12


@pytest.fixture(scope="module")
def tied():
    target = build_target("tiny-deepseek-v3").to(torch.bfloat16)
    gate = dict(target.named_modules())[GATE]
    experts = dict(target.named_modules())["model.layers.1.mlp.experts"]
    with torch.no_grad():
        gate.weight[TWINS[1]] = gate.weight[TWINS[0]]  # the twins' scores are equal for every token
        experts.down_proj[TWINS[1]] *= 4  # and their outputs far apart
    prompt = models.random_prompts(1, 8, 3, 60)[0]
    reference = models.greedy(target, prompt, NEW)
    cal = calibration.calibrate(target, [prompt], [reference])
    # a decode position where the router keeps exactly one twin: there the tie can be broken the other way
    with routers.Trace(target) as trace, torch.inference_mode():
        target(torch.tensor([prompt[0].tolist() + reference]), use_cache=False)
    ids = trace.take()[GATE][-1][2]
    sites = [p for p in range(ids.shape[0]) if len(set(ids[p].tolist()) & set(TWINS)) == 1]
    assert sites, "no position keeps exactly one twin: the tie cannot be broken the other way"
    decoded = [p for p in sites if p >= prompt.shape[1]]  # a decode step rather than the prefill, where there is one
    return target, prompt, cal, (decoded or sites)[0]


def _decode(target, prompt, hook_module, hook):
    """Greedy token by token with a cache, under the logits recorder, with ``hook`` on ``hook_module``."""
    handle = hook_module.register_forward_hook(hook) if hook_module is not None else None
    try:
        with oracle.LogitsRecorder(target) as recorder:
            new = models.greedy(target, prompt, NEW)
    finally:
        if handle is not None:
            handle.remove()
    return prompt[0].tolist() + new, recorder.calls


def _at_position(site, prompt_len):
    """The router call and row of absolute position ``site`` in a token-by-token decode (the prefill is call 0)."""
    return (0, site) if site < prompt_len else (site - prompt_len + 1, 0)


def test_a_tie_broken_the_other_way_is_followed_and_the_run_passes(tied):
    target, prompt, cal, site = tied
    assert cal.router_tolerance is not None and 0 < cal.router_floor < 0.05, cal.describe()
    call, row = _at_position(site, prompt.shape[1])
    seen = []

    def other_twin(module, args, output):
        logits, weights, ids = output
        seen.append(None)
        if len(seen) - 1 != call:
            return None
        ids = ids.clone()
        a, b = TWINS
        ids[row] = torch.where(ids[row] == a, b, torch.where(ids[row] == b, a, ids[row]))  # same score: same weight
        return logits, weights, ids

    final, calls = _decode(target, prompt, dict(target.named_modules())[GATE], other_twin)
    forced = oracle.reference_logits(target, final)
    verdict = oracle.judge_logits(calls, final, forced, prompt.shape[1], cal.tolerance)
    assert verdict.passed, verdict.describe()
    followed = verdict.routing["followed"]
    assert followed[0]["position"] == site and followed[0]["router"] == GATE and followed[0]["delta"] <= cal.router_tolerance
    assert "routing flip(s) followed" in verdict.describe() and verdict.as_dict()["routing"] == verdict.routing
    # the control: the same decode against the plain reference fails, at the flip or after it
    routers.release(target)
    with torch.inference_mode():
        plain = target(torch.tensor([final]), use_cache=False).logits[0].float()
    control = oracle.judge_logits(calls, final, plain, prompt.shape[1], cal.tolerance)
    assert not control.passed and control.first_over >= site + 1 - prompt.shape[1], control.describe()


def test_the_drafter_oracles_reference_reads_the_same_experts_until_the_next_decode(tied):
    target, prompt, cal, site = tied
    call, row = _at_position(site, prompt.shape[1])
    count = []

    def other_twin(module, args, output):
        count.append(None)
        if len(count) - 1 != call:
            return None
        logits, weights, ids = output
        ids = ids.clone()
        ids[row] = torch.where(ids[row] == TWINS[0], TWINS[1], torch.where(ids[row] == TWINS[1], TWINS[0], ids[row]))
        return logits, weights, ids

    final, _ = _decode(target, prompt, dict(target.named_modules())[GATE], other_twin)
    forced = oracle.reference_logits(target, final)
    assert forced.routing.followed
    ids = torch.tensor([final])
    with torch.inference_mode():
        again = target(ids, use_cache=False, output_hidden_states=True).logits[0].float()
        assert torch.equal(again, forced)  # the drafter oracle's from-scratch forward follows too
        with oracle.LogitsRecorder(target):
            pass  # a new decode starts: the follower is gone
        plain = target(ids, use_cache=False).logits[0].float()
    assert not torch.equal(plain, forced)


def test_a_router_input_that_already_differs_is_not_followed_and_fails(tied):
    target, prompt, cal, site = tied
    call, row = _at_position(site, prompt.shape[1])
    moe = dict(target.named_modules())["model.layers.1.mlp"]
    gate = dict(target.named_modules())[GATE]
    calls_seen = []

    def push(module, args):
        calls_seen.append(None)
        if len(calls_seen) - 1 != call:
            return None
        hidden = args[0].clone()
        with torch.inference_mode():
            scores = gate.weight.float() @ hidden[0, row].float()
            low = int(scores.argmin())  # the expert least wanted here becomes the favourite
            direction = gate.weight[low].float() / gate.weight[low].float().norm()
        hidden[0, row] += (8.0 * direction).to(hidden.dtype)
        return (hidden, *args[1:])

    handle = moe.register_forward_pre_hook(push)
    try:
        with oracle.LogitsRecorder(target) as recorder:
            new = models.greedy(target, prompt, NEW)
    finally:
        handle.remove()
    final = prompt[0].tolist() + new
    forced = oracle.reference_logits(target, final)
    verdict = oracle.judge_logits(recorder.calls, final, forced, prompt.shape[1], cal.tolerance)
    assert not verdict.passed and verdict.first_over == site + 1 - prompt.shape[1], verdict.describe()
    unexplained = verdict.routing["unexplained"]
    assert unexplained["position"] == site and unexplained["delta"] > cal.router_tolerance, verdict.routing
    assert not verdict.routing["followed"] and "not a tie" in verdict.describe()


def test_a_target_without_routers_has_no_router_tolerance_and_a_plain_reference():
    target = build_target("tiny-qwen3_5").to(torch.bfloat16)
    prompt = models.random_prompts(1, 8, 0, 60)[0]
    reference = models.greedy(target, prompt, 6)
    cal = calibration.calibrate(target, [prompt], [reference])
    assert cal.router_floor is None and cal.router_tolerance is None and routers.tolerance_of(target) is None
    with oracle.LogitsRecorder(target) as recorder:
        new = models.greedy(target, prompt, 6)
    final = prompt[0].tolist() + new
    forced = oracle.reference_logits(target, final)
    assert getattr(forced, "routing", None) is None and all(not c["routes"] for c in recorder.calls)
    assert oracle.judge_logits(recorder.calls, final, forced, prompt.shape[1], cal.tolerance).routing is None


def _forced(rows: list[int], vocab: int = 12, prompt_len: int = 4):
    """Teacher-forced logits whose argmax at new token i is ``rows[i]`` (by 1.0; ties nowhere)."""
    forced = torch.zeros(prompt_len + len(rows), vocab)
    for i, token in enumerate(rows):
        forced[prompt_len - 1 + i, token] = 1.0
    return forced


@pytest.mark.parametrize("flip_position,kind", [(4, "routing"), (3, "routing"), (5, "loss"), (None, "loss")])
def test_a_divergence_after_a_followed_routing_flip_is_judged_on_the_decodes_experts(flip_position, kind):
    """Greedy (other experts from new token 1 on) emitted 7 at new token 1, the decode 8, which is the argmax of the
    reference that follows the decode's experts: a flip at position 4 (decides new token 1) or earlier explains it; a
    flip after it, or none, does not (8 lies 1.0 below 7 in those logits: a loss)."""
    from patcher.verify.judge import neartie

    reference, new = [3, 7, 9, 4], [3, 8, 9, 4]
    forced = _forced(new)
    if flip_position is not None:
        forced.routing = routers.Flips(0.01, followed=[{"position": flip_position, "router": GATE, "decoder": [0, 1],
                                                        "reference": [0, 2], "delta": 0.0}])
    else:
        forced[4, 7] = 2.0  # without a flip the greedy token is the plain reference's argmax there
    verdict = neartie.judge_ties(reference, new, forced, 4, 0.02, max_new_tokens=4)
    assert verdict.kind == kind, verdict.describe()
    run = {"prompt": 0, "verdict": tokens.compare(reference, new).as_dict(), "ties": verdict.as_dict(),
           "ties_description": verdict.describe()}
    assert tokens.lossless_check("dflash", [run])["passed"] is (kind == "routing")
    if kind == "routing":
        assert verdict.flip_at == flip_position - 3 and "after a routing flip at new token" in verdict.describe()
        assert "routing flips" in tokens.lossless_check("dflash", [run])["evidence"]


def test_the_router_floor_is_measured_and_the_router_tolerance_is_a_fixed_multiple_of_it():
    """GraniteMoeHybrid in bf16: the routers' floor is the largest |Δ router logits| between one multi-token forward
    and token-by-token decoding with a cache, recomputed here; it lies above one ulp of the router logits (so it is
    measured, not the ulp), and the router tolerance is 4 floors."""
    from transformers import DynamicCache

    target = build_target("tiny-granitemoehybrid").to(torch.bfloat16)
    prompt = models.random_prompts(1, 8, 0, 60)[0]
    reference = models.greedy(target, prompt, 12)
    cal = calibration.calibrate(target, [prompt], [reference])
    sequence = prompt[0].tolist() + reference
    with routers.Trace(target) as trace, torch.inference_mode():
        target(torch.tensor([sequence]), use_cache=False)
        whole = {name: calls[-1][0].float() for name, calls in trace.take().items()}
        cache = DynamicCache(config=target.config)
        steps = {name: [] for name in whole}
        for start, end in [(0, prompt.shape[1])] + [(i, i + 1) for i in range(prompt.shape[1], len(sequence) - 1)]:
            target(torch.tensor([sequence[start:end]]), past_key_values=cache, use_cache=True)
            for name, calls in trace.take().items():
                steps[name].append(calls[-1])
    stepped = {name: torch.cat([c[0].float() for c in calls]) for name, calls in steps.items()}
    measured = max(float((whole[n][: len(stepped[n])] - stepped[n]).abs().max()) for n in whole)
    ulp = calibration.ulp_of(max(float(s.abs().max()) for s in stepped.values()), torch.bfloat16)
    assert measured > ulp and cal.router_floor == measured, (measured, ulp, cal.describe())
    assert cal.router_tolerance == 4.0 * cal.router_floor and cal.router_flips == 0  # no flip: nothing was followed
    assert routers.tolerance_of(target) == cal.router_tolerance
    assert "router floor" in cal.describe() and cal.as_dict()["router_tolerance"] == cal.router_tolerance


def test_two_ties_broken_in_two_layers_are_followed_in_causal_order():
    """Twins in both routed layers; the decode breaks the layer-1 tie at one position and then a layer-2 tie at a later
    one, which reads the earlier flip's output (through attention). Both are ties: PASS, and they are followed in
    causal order, the cause before what reads it (judged the other way round, a consequence can look like a router
    input that differs)."""
    target = build_target("tiny-deepseek-v3").to(torch.bfloat16)
    named = dict(target.named_modules())
    with torch.no_grad():
        for layer in (1, 2):
            named[f"model.layers.{layer}.mlp.gate"].weight[TWINS[1]] = named[f"model.layers.{layer}.mlp.gate"].weight[TWINS[0]]
            named[f"model.layers.{layer}.mlp.experts"].down_proj[TWINS[1]] *= 4
    prompt = models.random_prompts(1, 8, 1, 60)[0]
    cal = calibration.calibrate(target, [prompt], [models.greedy(target, prompt, NEW)])
    swapped: dict = {}

    def breaker(layer):
        seen = []

        def hook(module, args, output):
            logits, weights, ids = output
            position = prompt.shape[1] + len(seen) - 1 if seen else None  # the prefill is call 0
            seen.append(None)
            first = swapped.get(1)
            wanted = position is not None and (layer == 1 and first is None or layer == 2 and first is not None
                                               and position > first and 2 not in swapped)
            if not wanted or len(set(ids[0].tolist()) & set(TWINS)) != 1:
                return None
            swapped[layer] = position
            ids = ids.clone()
            ids[0] = torch.where(ids[0] == TWINS[0], TWINS[1], torch.where(ids[0] == TWINS[1], TWINS[0], ids[0]))
            return logits, weights, ids

        return hook

    handles = [named[f"model.layers.{layer}.mlp.gate"].register_forward_hook(breaker(layer)) for layer in (1, 2)]
    try:
        with oracle.LogitsRecorder(target) as recorder:
            new = models.greedy(target, prompt, NEW)
    finally:
        for h in handles:
            h.remove()
    assert set(swapped) == {1, 2} and swapped[2] > swapped[1], swapped
    final = prompt[0].tolist() + new
    verdict = oracle.judge_logits(recorder.calls, final, oracle.reference_logits(target, final), prompt.shape[1], cal.tolerance)
    assert verdict.passed, verdict.describe()
    followed = [(f["position"], f["router"]) for f in verdict.routing["followed"]]
    assert followed[:2] == [(swapped[1], "model.layers.1.mlp.gate"), (swapped[2], "model.layers.2.mlp.gate")], followed


def _run(passed: bool, routing: dict | None, kind: str = "identical") -> dict:
    return {"prompt": 0, "logits": {"passed": passed, "routing": routing}, "ties": {"kind": kind}, "drafter": {"passed": True}}


TOO_MANY = {"tolerance": 1e-2, "followed": [{}] * routers.MAX_FLIPS, "unexplained": None, "too_many": True}
UNEXPLAINED = {"tolerance": 1e-2, "followed": [], "unexplained": {"position": 9, "delta": 0.3}, "too_many": False}


@pytest.mark.parametrize("runs, dtype, verdict", [
    ([_run(True, None), _run(False, TOO_MANY, "loss")], "bfloat16", "inconclusive"),  # only unfollowable runs failed
    ([_run(False, TOO_MANY, "loss")], "float32", "fail"),  # float32 is exact: no tie to follow, never inconclusive
    ([_run(False, UNEXPLAINED, "loss")], "bfloat16", "fail"),  # a router input that already differs: a real loss
    ([_run(False, TOO_MANY), _run(False, None, "loss")], "bfloat16", "fail"),  # one failed run has no routing excuse
    ([_run(False, {**TOO_MANY, "unexplained": UNEXPLAINED["unexplained"]})], "bfloat16", "fail"),
])
def test_a_check_is_inconclusive_only_when_every_failed_run_hit_more_flips_than_are_followed(runs, dtype, verdict):
    """Issue 32: where routing flips cannot all be followed, bf16 says "inconclusive in this dtype" and names the
    float32 command, never FAIL; a failure routing does not explain stays a failure."""
    failed = {"check": "logits == from-scratch: dflash", "passed": False, "evidence": "1/2 runs over tolerance"}
    out = routers.inconclusive(failed, runs, dtype, "ddpatch verify T --target M --dtype float32")
    assert ("inconclusive" if out.get("inconclusive") else "fail") == verdict, out
    if verdict == "inconclusive":
        assert out["float32_command"].endswith("--dtype float32") and "inconclusive in bfloat16" in out["evidence"]
    passed = {"check": "lossless: dflash", "passed": True, "evidence": "2/2"}
    assert routers.inconclusive(passed, runs, dtype, "cmd") is passed, "a passing check is never touched"
