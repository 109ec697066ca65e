"""``patcher.lossless``: transformers' own speculative generate() on stateful models equals plain greedy.

Each mode is run on seeded stateful presets whose state matters, with drafts that are right often
but not always (so rollbacks and partial acceptances happen), against plain greedy ``generate()``.
The controls lift only transformers' refusal (``record=False``) and must come out different: it is
the runtime's recording, not the lifting, that makes the output exact.
"""

from __future__ import annotations

import contextlib
import inspect
import subprocess
import sys

import pytest
import torch
import transformers

import generate_support as gs
from patcher import runtime as rt
from patcher.lossless import lossless, refusal

ASSISTANT_PRESETS = ("tiny-qwen3_5", "tiny-nemotron-h")


def first_divergence(expected, got):
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None if len(expected) == len(got) else min(len(expected), len(got)))


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    return gs.mtp_checkpoint("tiny-qwen3_5", tmp_path_factory.mktemp("mtp-qwen3_5"))


def scripted_run(model, mode: str, ids, reference, record: bool = True, seed: int = 0):
    """(new tokens, the script) of one greedy generate() in ``mode`` with a draft right ~65% of the time."""
    script = gs.Script(ids[0].tolist() + reference, seed=seed, vocab=gs.MASK_TOKEN_ID)
    if mode == "mtp":
        with gs.scripted_mtp(script), lossless(model, record=record):
            return gs.greedy(model, ids, use_mtp=True), script
    helper = gs.assistant(seed)
    with gs.scripted_assistant(helper, script), lossless(model, record=record):
        return gs.greedy(model, ids, assistant_model=helper), script


def verify_lengths(model, run):
    """The input lengths of the target's own forwards during ``run()`` (prefill included)."""
    lengths, seen = [], []

    def hook(module, args, kwargs):
        ids = kwargs["input_ids"]
        if not seen or seen[-1] is not ids:  # under lossless the hooks also see verify_forward's inner call
            seen.append(ids)
            lengths.append(ids.shape[1])

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = run()
    finally:
        handle.remove()
    return out, lengths


@pytest.fixture
def recorded(monkeypatch):
    """The number of cached target forwards ``lossless`` routed through ``runtime.verify_forward`` so far.

    On 5.24+ transformers runs speculative generate() on stateful models itself, so a run can come out
    token-identical without any recording (when the native rollback happens to be exact there): the
    count is what says that the runtime recorded the run."""
    calls = [0]
    real = rt.verify_forward

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(rt, "verify_forward", counting)
    return lambda: calls[0]


@contextlib.contextmanager
def scripted_candidates(generator_class, script):
    """Replace the candidates ``generator_class.get_candidates`` proposes by ``script``'s (greedy runs): the
    draft (a DFlash drafter) still runs, its proposals become right ~65% of the time."""
    original = generator_class.get_candidates

    def get_candidates(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if ids.shape[1] > input_ids.shape[1]:
            ids = ids.clone()
            for position in range(input_ids.shape[1], ids.shape[1]):
                ids[0, position] = script.token(position)
        return ids, logits

    generator_class.get_candidates = get_candidates
    try:
        yield script
    finally:
        generator_class.get_candidates = original


# ----------------------------------------------------------------------------- the API's contract
#: transformers up to 5.23 marks stateful classes (``_is_stateful = True``) and refuses speculative generate() on
#: them; 5.24+ has neither the flag nor the refusal and runs it (lossy, measured on 5.25)
CLASS_STATEFUL = getattr(type(gs.target("tiny-qwen3_5")), "_is_stateful", False)
REFUSES = CLASS_STATEFUL and "not supported with stateful" in __import__(
    "inspect").getsource(__import__("transformers.generation.utils", fromlist=["x"]))


def test_the_stateful_flag_is_what_this_release_says_it_is():
    """The per-release facts the other tests branch on: a release that refuses has the flag on the class, one
    that runs the modes has no flag at all (nothing for ``lossless`` to shadow)."""

    source = __import__("inspect").getsource(__import__("transformers.generation.utils", fromlist=["x"]))
    if REFUSES:
        assert CLASS_STATEFUL is True and "_is_stateful" in source
    else:
        assert not hasattr(type(gs.target("tiny-qwen3_5")), "_is_stateful"), transformers.__version__
        assert "_is_stateful" not in source and "not supported with stateful" not in source


def test_outside_the_context_transformers_behaves_as_before():
    model = gs.target("tiny-qwen3_5")
    ids = gs.repeated_prompt(0)
    before = vars(model).copy()
    if REFUSES:
        with pytest.raises(ValueError, match="stateful"):
            model.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=3)
    else:
        plain = gs.greedy(model, ids, prompt_lookup_num_tokens=3)
    with lossless(model):
        assert getattr(model.forward, "__ddpatch_lossless__", False)
        if CLASS_STATEFUL:  # the class's refusal is shadowed on this instance
            assert vars(model)["_is_stateful"] is False and type(model)._is_stateful is True
        else:  # nothing to shadow: no flag is added
            assert "_is_stateful" not in vars(model) and not hasattr(model, "_is_stateful")
    assert vars(model).keys() == before.keys() and "forward" not in vars(model) and "_is_stateful" not in vars(model)
    assert getattr(model, "_is_stateful", False) is CLASS_STATEFUL
    if REFUSES:
        with pytest.raises(ValueError, match="stateful"):
            model.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=3)
    else:
        assert gs.greedy(model, ids, prompt_lookup_num_tokens=3) == plain


def test_other_instances_are_untouched():
    model, other = gs.target("tiny-qwen3_5"), gs.build_target("tiny-qwen3_5", seed=1)
    with lossless(model):
        assert "forward" in vars(model) and "forward" not in vars(other) and "_is_stateful" not in vars(other)
        assert getattr(other, "_is_stateful", False) is CLASS_STATEFUL
        if REFUSES:
            with pytest.raises(ValueError, match="stateful"):
                other.generate(gs.prompt(0), max_new_tokens=4, prompt_lookup_num_tokens=3)


def test_importing_patcher_imports_no_torch():
    code = "import sys, patcher; assert 'torch' not in sys.modules; print(patcher.lossless.__name__, callable(patcher.lossless))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "patcher.lossless True", proc.stderr


def test_the_forward_keeps_its_signature():
    model = gs.target("tiny-qwen3_5")
    plain = inspect.signature(model.forward)
    with lossless(model):
        assert inspect.signature(model.forward) == plain  # transformers builds position_ids from it


def test_a_recorded_cache_reports_croppable_inside_the_context_and_its_class_comes_back_on_exit():
    """transformers 5.24 refuses assisted decoding after the prefill when the cache says it cannot be cropped (a
    linear-attention layer holds a recurrent state); inside ``lossless`` the runtime commits its crop exactly, so
    the recorded cache says it can, and only until the context ends."""
    model = gs.target("tiny-qwen3_5")
    ids = gs.repeated_prompt(0)
    seen = []
    with lossless(model):
        out = model.generate(ids, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=3,
                             return_dict_in_generate=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        seen.append((type(cache), getattr(cache, "is_croppable", True)))
    assert seen[0][1] is True, "inside the context the recorded cache says it can be cropped"
    assert not hasattr(type(cache), "__ddpatch_croppable__"), f"{type(cache)} kept ddpatch's class after the context"
    if hasattr(type(seen[0][0]), "__ddpatch_croppable__"):  # 5.24: the class was swapped, and is swapped back
        assert type(cache) is type(seen[0][0]).__ddpatch_croppable__


def test_decorator_form_is_lossless():
    model = gs.target("tiny-nemotron-h")
    ids = gs.repeated_prompt(1)
    reference = gs.greedy(model, ids)

    @lossless(model)
    def speculative():
        return gs.greedy(model, ids, prompt_lookup_num_tokens=3)

    assert speculative() == reference
    assert "forward" not in vars(model)


def test_a_family_it_cannot_roll_back_is_refused_in_one_line():
    """Mamba: its multi-token forward on a non-empty cache is not exact (measured on 5.23 and 5.25), and up to 5.23
    transformers' assisted loop needs a cache it is not given: refused on every release, by what it does."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8)).eval()
    with pytest.raises(rt.UnsupportedModelError) as err:
        with lossless(model):
            pass
    line = str(err.value)
    assert "\n" not in line and line.startswith("ddpatch: mamba: ") and "stays refused" in line
    assert "a multi-token step of generate() on a non-empty cache" in line or "speculative generate() fails" in line, line
    assert "_is_stateful" not in vars(model) and "forward" not in vars(model)
    assert refusal(gs.target("tiny-qwen3_5")) is None


# ----------------------------------------------------------------------------- MTP
def test_mtp_is_lossless_with_a_head_often_but_not_always_right(mtp_target):
    ids = gs.prompt(0)
    reference = gs.greedy(mtp_target, ids)
    got, script = scripted_run(mtp_target, "mtp", ids, reference)
    assert got == reference, f"diverges at new token {first_divergence(reference, got)}"
    assert 0 < script.right < script.proposed, (script.right, script.proposed)


def test_mtp_with_its_own_seeded_head_is_lossless(mtp_target):
    ids = gs.prompt(2)
    reference = gs.greedy(mtp_target, ids)
    with lossless(mtp_target):
        assert gs.greedy(mtp_target, ids, use_mtp=True) == reference


def test_control_mtp_without_recording_diverges(mtp_target):
    ids = gs.prompt(0)
    reference = gs.greedy(mtp_target, ids)
    got, _ = scripted_run(mtp_target, "mtp", ids, reference, record=False)
    assert got != reference


# ----------------------------------------------------------------------------- assistant, prompt lookup
@pytest.mark.parametrize("name", ASSISTANT_PRESETS)
def test_assistant_is_lossless_with_partial_acceptances(name):
    model = gs.target(name)
    ids = gs.prompt(0)
    reference = gs.greedy(model, ids)
    got, script = scripted_run(model, "assistant", ids, reference)
    assert got == reference, f"diverges at new token {first_divergence(reference, got)}"
    partial = [a for a, n in script.blocks if 0 < a < n]
    assert partial, f"no partial acceptance among blocks {script.blocks}"


@pytest.mark.parametrize("name", ASSISTANT_PRESETS)
def test_prompt_lookup_on_repeated_ngrams_is_lossless(name):
    model = gs.target(name)
    ids = gs.repeated_prompt(0)
    reference = gs.greedy(model, ids)
    with lossless(model):
        got, lengths = verify_lengths(model, lambda: gs.greedy(model, ids, prompt_lookup_num_tokens=3))
    assert got == reference, f"diverges at new token {first_divergence(reference, got)}"
    assert lengths[0] > ids.shape[1], "the first forward covers prompt + candidates"
    assert max(lengths[1:]) > 1, "prompt lookup proposed no candidate after the prefill"


@contextlib.contextmanager
def scripted_early_exit(model, script):
    """Make the early-exit draft's greedy choice (the model run with fewer layers) ``script``'s proposal, with
    a confident logit, so that transformers keeps drafting long blocks; the full-depth forwards are untouched."""
    from patcher.lossless import cache_of

    depth = model.config.get_text_config().num_hidden_layers

    def hook(module, args, kwargs, output):
        if module.config.get_text_config().num_hidden_layers == depth:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = cache_of(args, kwargs)
        past = int(cache.get_seq_length()) - ids.shape[1] if cache is not None else 0
        logits = torch.zeros_like(output.logits[:, -1])
        logits[:, script.token(past + ids.shape[1])] = 10.0
        output.logits[:, -1] = logits
        return output

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield script
    finally:
        handle.remove()


def early_exit_run(model, ids, reference, exit_layer, record=True, seed=0):
    script = gs.Script(ids[0].tolist() + reference, seed=seed, vocab=gs.MASK_TOKEN_ID)
    with scripted_early_exit(model, script), lossless(model, record=record):
        return gs.greedy(model, ids, assistant_early_exit=exit_layer), script


def test_early_exit_is_lossless_with_partial_acceptances_and_its_control_fails(recorded):
    """Qwen3.5's early exit runs its first 4 layers (an attention layer among them, as transformers' truncated
    cache needs) as the draft; scripted, its proposals are right ~65% of the time. On prompt 1 (measured on
    5.25) the control, with the refusal lifted and nothing recorded, diverges."""
    model = gs.target("tiny-qwen3_5")
    ids = gs.prompt(1)
    reference = gs.greedy(model, ids)
    got, script = early_exit_run(model, ids, reference, 4, seed=1)
    assert got == reference, f"diverges at new token {first_divergence(reference, got)}"
    assert 0 < script.right < script.proposed and any(0 < a < n for a, n in script.blocks), script.blocks
    assert recorded() > 0, "no cached forward went through the runtime"
    control, _ = early_exit_run(model, ids, reference, 4, record=False, seed=1)
    assert control != reference, "the control did not fail: the rollback did not matter here"


def test_early_exit_on_nemotron_h_drafts_with_the_whole_model_and_stays_exact(recorded):
    """NemotronH derives num_hidden_layers from its layer pattern and ignores the lowered value transformers
    sets for the draft: the "early-exit" draft is the full model, every candidate is the target's own token
    (nothing to roll back). Exact, and recorded all the same."""
    model = gs.target("tiny-nemotron-h")
    ids = gs.prompt(0)
    reference = gs.greedy(model, ids)
    with lossless(model):
        got, lengths = verify_lengths(model, lambda: gs.greedy(model, ids, assistant_early_exit=2))
    assert got == reference, f"diverges at new token {first_divergence(reference, got)}"
    assert recorded() > 0 and max(lengths[1:]) > 1, lengths


# ----------------------------------------------------------------------------- DFlash
def dflash_run(model, drafter, ids, reference, record=True, seed=0):
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    script = gs.Script(ids[0].tolist() + reference, seed=seed, vocab=gs.MASK_TOKEN_ID)
    with scripted_candidates(DFlashTokenCandidateGenerator, script), lossless(model, record=record):
        return gs.greedy(model, ids, assistant_model=drafter, speculation_type="dflash"), script


def test_dflash_is_lossless_with_partial_acceptances(recorded):
    """transformers' DFlash mode (``speculation_type="dflash"``, a seeded MuseGlimmer drafter of block 4), its
    candidates scripted. On 5.25 the native rollback is exact for this block size (the cache keeps one
    recurrent state per drafted token), so the control below must equal the reference too: the recording
    is seen in the count; on 5.23 the control is transformers' refusal."""
    from patcher.verify.judge.generate_mode import dflash_drafter

    model = gs.target("tiny-qwen3_5")
    drafter = dflash_drafter(model)
    ids = gs.prompt(0)
    reference = gs.greedy(model, ids)
    got, script = dflash_run(model, drafter, ids, reference)
    assert got == reference, f"diverges at new token {first_divergence(reference, got)}"
    assert any(0 < a < n for a, n in script.blocks), script.blocks
    assert recorded() > 0, "no cached forward went through the runtime"
    if REFUSES:
        with pytest.raises(ValueError, match="stateful"):
            model.generate(ids, max_new_tokens=4, assistant_model=drafter, speculation_type="dflash")
    else:
        control, _ = dflash_run(model, drafter, ids, reference, record=False)
        assert control == reference


# ----------------------------------------------------------------------------- controls on every stateful preset
#: presets where lifting the refusal alone is already exact for these runs (measured): LFM2's short conv
#: keeps only a conv window, and transformers' native crop rolls conv windows back. There the recording
#: is seen in the count of recorded forwards, not in the tokens.
NATIVELY_EXACT = {"tiny-lfm2"}
#: the prompt and script seed per preset: on 5.25 (native recurrent-state history) Falcon-H1's seed-0 runs stay
#: exact without recording, its seed-2 assistant run does not (measured)
SEEDS = {"tiny-falcon-h1": 2}


@pytest.mark.parametrize("name", gs.STATEFUL)
def test_every_stateful_preset_is_lossless_and_its_control_fails(name, recorded):
    model = gs.target(name)
    seed = SEEDS.get(name, 0)
    ids, repeated = gs.prompt(seed), gs.repeated_prompt(seed)
    reference, reference_repeated = gs.greedy(model, ids), gs.greedy(model, repeated)
    got, _ = scripted_run(model, "assistant", ids, reference, seed=seed)
    assert got == reference, f"assistant diverges at new token {first_divergence(reference, got)}"
    assert recorded() > 0, "no cached forward of the assistant run went through the runtime"
    before = recorded()
    with lossless(model):
        assert gs.greedy(model, repeated, prompt_lookup_num_tokens=3) == reference_repeated
    assert recorded() > before, "no cached forward of the prompt-lookup run went through the runtime"
    before = recorded()
    control, _ = scripted_run(model, "assistant", ids, reference, record=False, seed=seed)
    with lossless(model, record=False):
        control_lookup = gs.greedy(model, repeated, prompt_lookup_num_tokens=3)
    assert recorded() == before, "the control recorded"
    if name in NATIVELY_EXACT:
        assert control == reference and control_lookup == reference_repeated
    else:
        assert control != reference or control_lookup != reference_repeated, "the control did not fail"


# ----------------------------------------------------------------------------- sampling
def sampled_second_tokens(model, ids, runs: int, **mode) -> dict[int, int]:
    counts: dict[int, int] = {}
    for i in range(runs):
        torch.manual_seed(50_000 + i)
        with lossless(model):
            out = model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=True, temperature=0.8, top_k=0, **mode)
        token = int(out[0, ids.shape[1] + 1])
        counts[token] = counts.get(token, 0) + 1
    return counts


def sampling_pair(name: str):
    from patcher.verify.models.load import prepare_for_sampling

    model = gs.build_target(name, seed=0)
    prepare_for_sampling(model, gs.MASK_TOKEN_ID)  # a peaked distribution, as `verify --temperature` uses
    helper = gs.assistant()
    prepare_for_sampling(helper, gs.MASK_TOKEN_ID)
    return model, helper


def second_token_test(model, ids, counts):
    from patcher.verify.judge.distribution import second_token_distribution
    from patcher.verify.judge.distribution import chi_square_test

    return chi_square_test(counts, second_token_distribution(model, ids, {"temperature": 0.8}))


def test_speculative_sampling_with_an_assistant_follows_the_target():
    """The distributional test of ``verify --temperature``: the 2nd new token against its exact law.
    With 2 new tokens a rejected first candidate is cut back before the 2nd token is drawn."""
    model, helper = sampling_pair("tiny-qwen3_5")
    ids = gs.prompt(0)
    calls = []
    real = rt.verify_forward

    def counting(*args, **kwargs):  # a draw's target forwards, as the runtime recorded them
        calls.append(kwargs.get("input_ids", args[1] if len(args) > 1 else None).shape[1])
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rt, "verify_forward", counting)
        verdict = second_token_test(model, ids, sampled_second_tokens(model, ids, 200, assistant_model=helper))
    assert verdict.passed and verdict.dof >= 5, verdict.describe()
    # every draw's first target forward covers prompt + candidates and was recorded; the draws whose 2nd
    # token needed a second forward were cut back (a rejected candidate) before it
    assert len(calls) >= 200 and sum(n > ids.shape[1] for n in calls) >= 200, calls[:10]


@pytest.mark.heavy
@pytest.mark.parametrize("name", ("tiny-qwen3_5", "tiny-nemotron-h"))
def test_speculative_sampling_with_prompt_lookup_follows_the_target(name):
    model, _ = sampling_pair(name)
    ids = gs.repeated_prompt(0)
    verdict = second_token_test(model, ids, sampled_second_tokens(model, ids, 300, prompt_lookup_num_tokens=3))
    assert verdict.passed and verdict.dof >= 5, verdict.describe()


def test_the_same_test_fails_a_sampler_that_ignores_the_target():
    """The test can fail: counts from the assistant's own sampling (the draft's law, not the target's)."""
    model, helper = sampling_pair("tiny-qwen3_5")
    ids = gs.prompt(0)
    counts: dict[int, int] = {}
    for i in range(200):
        torch.manual_seed(50_000 + i)
        out = helper.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=True, temperature=0.8, top_k=0)
        counts[int(out[0, -1])] = counts.get(int(out[0, -1]), 0) + 1
    assert not second_token_test(model, ids, counts).passed


# ----------------------------------------------------------------------------- ddpatch verify --generate
def test_verify_generate_passes_and_reports_the_modes():
    import json

    from patcher.cli import main
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["verify", "--generate", "--preset", "tiny-qwen3_5", "--mode", "mtp,assistant,prompt-lookup",
                                       "--max-new-tokens", "16", "--format", "json"])
    payload = json.loads(result.stdout[result.stdout.index("{"):])
    checks = {c["check"]: c for m in payload["models"] for c in m["checks"]}
    assert result.exit_code == 0 and payload["passed"], checks
    for mode in ("mtp", "assistant", "prompt-lookup"):
        assert checks[f"lossless: {mode}"]["passed"] and checks[f"logits == from-scratch: {mode}"]["passed"]
    assert checks["partial acceptances (scripted assistant)"]["passed"]
    methods = {m["method"]: m for m in payload["models"][0]["methods"]}
    assert set(methods) == {"mtp", "assistant", "prompt-lookup"} and all("speedup" in m for m in methods.values())


def test_verify_generate_fails_when_only_the_refusal_is_lifted(monkeypatch):
    """The verifier's status can fail: the same run with lossless reduced to its control."""
    import functools

    import patcher.lossless  # noqa: F401  (loads the module; generate_mode reads its `lossless` at call time)
    from patcher.verify.judge.generate_mode import run_generate

    monkeypatch.setattr(sys.modules["patcher.lossless"], "lossless", functools.partial(lossless, record=False))
    outcome = run_generate(presets=["tiny-qwen3_5"], modes=["assistant", "prompt-lookup"], max_new_tokens=24)
    failed = {c["check"] for c in outcome.checks if not c["passed"]}
    assert not outcome.passed, outcome.checks
    assert failed & {"lossless: assistant", "lossless: prompt-lookup"}, failed
    assert failed & {"logits == from-scratch: assistant", "logits == from-scratch: prompt-lookup"}, failed


@pytest.mark.heavy
def test_verify_generate_under_sampling_judges_logits_and_the_distribution():
    from patcher.verify.judge.generate_mode import run_generate

    outcome = run_generate(presets=["tiny-qwen3_5"], modes=["assistant", "prompt-lookup"], max_new_tokens=12,
                           temperature=0.8, sampling_runs=120)
    checks = {c["check"]: c for c in outcome.checks}
    assert outcome.passed, checks
    for mode in ("assistant", "prompt-lookup"):
        assert checks[f"logits == from-scratch: {mode}"]["passed"], "sampling must not touch the recorded logits"
        assert "over 120 runs" in checks[f"sampling distribution: {mode}"]["evidence"]


def test_verify_generate_runs_early_exit_and_dflash_exactly_and_fails_a_perturbed_commit(monkeypatch):
    """``verify --generate --mode early-exit,dflash``: both modes run through the runtime and come out token-identical
    with from-scratch logits; the same run with every commit nudging the recurrent state by 1e-2 fails both modes."""
    from patcher.runtime import commit
    from patcher.verify.judge.generate_mode import run_generate

    calls = []
    real_verify = rt.verify_forward

    def counting(*args, **kwargs):
        calls.append(None)
        return real_verify(*args, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(rt, "verify_forward", counting)
        outcome = run_generate(presets=["tiny-qwen3_5"], modes=["early-exit", "dflash"], max_new_tokens=24)
    checks = {c["check"]: c for c in outcome.checks}
    assert outcome.passed, checks
    for mode in ("early-exit", "dflash"):
        assert checks[f"lossless: {mode}"]["passed"] and checks[f"logits == from-scratch: {mode}"]["passed"]
    methods = {m["method"]: m for m in outcome.result["models"][0]["methods"]}
    assert set(methods) == {"early-exit", "dflash"} and len(calls) > 2 * len(methods), len(calls)

    real_commit = commit._commit

    def nudged(cache, record, keep):
        real_commit(cache, record, keep)
        for layer in cache.layers:
            for state in getattr(layer, "recurrent_states", {}).values():
                if state is not None:
                    state.add_(1e-2)

    monkeypatch.setattr(commit, "_commit", nudged)
    broken = run_generate(presets=["tiny-qwen3_5"], modes=["early-exit", "dflash"], max_new_tokens=24)
    failed = {c["check"] for c in broken.checks if not c["passed"]}
    assert not broken.passed and {"logits == from-scratch: early-exit", "logits == from-scratch: dflash"} <= failed, failed


# ----------------------------------------------------------------------------- every documented import (issue 38)
IMPORTS = {
    "import patcher": "import patcher",
    "import patcher.lossless": "import patcher.lossless",
    "from patcher.lossless import refusal": "from patcher.lossless import refusal",
    "from patcher.lossless import lossless": "from patcher.lossless import lossless",
    "from patcher import lossless": "from patcher import lossless",
}


@pytest.fixture
def fresh_patcher_lossless():
    """``patcher.lossless`` as a fresh interpreter has it (never imported), put back afterwards."""
    import patcher

    saved_module, saved_name = sys.modules.pop("patcher.lossless", None), vars(patcher).pop("lossless", None)
    try:
        yield
    finally:
        sys.modules.pop("patcher.lossless", None)
        vars(patcher).pop("lossless", None)
        if saved_module is not None:
            sys.modules["patcher.lossless"] = saved_module
        if saved_name is not None:
            vars(patcher)["lossless"] = saved_name


@pytest.mark.parametrize("way", IMPORTS)
def test_every_documented_import_leaves_patcher_lossless_callable(way, fresh_patcher_lossless):
    """``import patcher.lossless`` binds the package's attribute to the module: the module is callable, so that
    ``with patcher.lossless(m):`` (the README's line) works after any of them, as does the name each one binds."""
    namespace: dict = {}
    exec(IMPORTS[way], namespace)
    import patcher

    model = gs.target("tiny-qwen3_5")
    ids = gs.repeated_prompt(0)
    reference = gs.greedy(model, ids)
    with patcher.lossless(model):
        assert gs.greedy(model, ids, prompt_lookup_num_tokens=3) == reference
    bound = namespace.get("lossless")
    if bound is not None:  # the name the statement bound: the module or the class, both make the context
        with bound(model):
            assert getattr(model.forward, "__ddpatch_lossless__", False)
    assert "forward" not in vars(model)
    assert patcher.lossless is sys.modules["patcher.lossless"] and patcher.lossless.refusal(model) is None


def test_the_readme_example_runs_after_importing_the_module_first():
    """In a fresh interpreter: the submodule imported before the package's attribute was read (the order that broke)."""
    code = (
        "from patcher.lossless import refusal\n"
        "import patcher, torch\n"
        "from patcher.verify.models.presets import build_target\n"
        "model = build_target('tiny-qwen3_5')\n"
        "ids = torch.tensor([[5, 9, 5, 9, 5, 9, 1, 2]])\n"
        "plain = model.generate(ids, max_new_tokens=8, do_sample=False)\n"
        "with patcher.lossless(model):\n"
        "    out = model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)\n"
        "assert out.tolist() == plain.tolist() and refusal(model) is None\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
