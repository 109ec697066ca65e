"""``ddpatch verify --generate``: transformers' own speculative ``generate()`` under ``patcher.lossless``,
judged with the research decoders' oracles: token identity against plain greedy ``generate()``, the
logits the target used against one from-scratch forward, acceptance lengths, speed, and under
``--temperature`` the distributional test of the second new token.

On a preset the drafts are scripted, as ``verify`` scripts DFlash drafts: the assistant's and the MTP
head's proposals are the target's greedy continuation with probability ``RIGHT``, so rollbacks and
partial acceptances happen. With ``--target DIR`` nothing is scripted: ``--assistant DIR`` is the
user's own drafter, MTP reads the folder's ``mtp.`` weights.

Next to each mode's ``lossless`` check stands its native control, ``native generate() (control): MODE``: the same
run through transformers' own ``generate()`` without ``lossless``. It passes whatever it shows (it is the control,
not the verdict): on releases that refuse the mode on a stateful model (5.23) it says "refused by transformers X";
on releases that run it (5.24+) it names the first divergence from plain greedy ``generate()`` and the margin of the
target's own from-scratch forward there. ``benchmarks/repro_native_assisted_generate.py`` is the standalone
reproduction of the same measurement, for an upstream report.

Runs in this process (no child process, no timeout of its own).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from ..check import Check
from .distribution import chi_square_test, second_token_distribution
from .logits import LOGIT_TOLERANCE, LogitsRecorder, judge_logits, reference_logits
from .tokens import Verdict, compare

MODES = ("mtp", "assistant", "prompt-lookup", "dflash", "early-exit")
#: probability that a scripted draft proposes the target's own next token
RIGHT = 0.65
LOOKUP_TOKENS = 3


# ----------------------------------------------------------------------------- tiny models
def mtp_checkpoint(name: str, folder: Path, seed: int = 0):
    """Preset ``name`` with one seeded MTP layer, saved with its ``mtp.`` weights to ``folder`` and loaded
    back (transformers' ``MtpModel.from_pretrained`` reads them from ``config.name_or_path``)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    from ..models.presets import build_target

    model = build_target(name, seed=seed)
    MtpModel.get_mtp_weights_regex(model)  # raises where the class has no MTP weights to load
    text = model.config.get_text_config()
    text.num_mtp_layers = 1
    if getattr(text, "layer_types", None) is not None:  # a hybrid: the MTP layer is an attention layer
        text.mtp_layer_types = [next(t for t in text.layer_types if "attention" in t and "linear" not in t)]
    if getattr(text, "mlp_layer_types", None) is not None:
        text.mtp_mlp_layer_types = [text.mlp_layer_types[-1]]
    model.save_pretrained(folder)
    torch.manual_seed(seed + 1)
    shared = ("embed_tokens.", "shared_head.", "rotary_emb.")
    weights = {f"mtp.{k}": v.detach().clone().contiguous() for k, v in MtpModel(model, 1).state_dict().items()
               if not k.startswith(shared)}
    state = load_file(str(folder / "model.safetensors"))
    save_file({**state, **weights}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def dflash_drafter(target, seed: int = 0, block_size: int = 4):
    """A seeded transformers-format DFlash drafter (``MuseGlimmerAssistantModel``, 5.23's only one) fitting ``target``."""
    import torch
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    from ..models.presets import MASK_TOKEN_ID

    tc = target.config.get_text_config()
    torch.manual_seed(seed + 5)
    cfg = MuseGlimmerAssistantConfig(
        hidden_size=tc.hidden_size, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, block_size=block_size, mask_token_id=MASK_TOKEN_ID, vocab_size=tc.vocab_size, sliding_window=1024,
        target_layer_ids=sorted({min(1, tc.num_hidden_layers - 1), tc.num_hidden_layers - 2}),
    )
    return MuseGlimmerAssistantModel(cfg).eval()


def early_exit_layer(target) -> int | None:
    """The shallowest exit whose layers include an attention layer (transformers' truncated cache needs one)."""
    types = list(getattr(target.config.get_text_config(), "layer_types", None) or [])
    for i, kind in enumerate(types[:-1]):
        if "attention" in kind and "linear" not in kind:
            return i + 1
    return None


# ----------------------------------------------------------------------------- scripted drafts
class Script:
    """Proposes ``reference[p]`` for position ``p`` with probability ``RIGHT``, another token otherwise;
    per block of consecutive positions, counts the leading right proposals (what the target accepts)."""

    def __init__(self, reference, seed: int, vocab: int):
        import torch

        self.reference, self.vocab = list(reference), vocab
        self.gen = torch.Generator().manual_seed(20_011 + seed)
        self.proposed = self.right = 0
        self.blocks: list[list[int]] = []
        self._last = None

    def token(self, position: int) -> int:
        import torch

        self.proposed += 1
        if self._last is None or position != self._last + 1:
            self.blocks.append([0, 0])
        self._last = position
        block = self.blocks[-1]
        block[1] += 1
        true = self.reference[position] if position < len(self.reference) else 0
        if float(torch.rand((), generator=self.gen)) < RIGHT:
            self.right += 1
            if block[0] == block[1] - 1:
                block[0] += 1
            return true
        other = int(torch.randint(0, self.vocab - 1, (1,), generator=self.gen))
        return other if other < true else other + 1


@contextlib.contextmanager
def scripted_assistant(model, script: Script):
    """Make ``model``'s greedy choice at its last position ``script``'s proposal."""
    import torch

    from patcher.lossless import cache_of

    def hook(module, args, kwargs, output):
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


@contextlib.contextmanager
def scripted_mtp(script: Script):
    """Replace the proposal of transformers' ``MtpModel`` (it exists only inside generate(): a global
    module hook) by ``script``'s; ids only, so greedy runs only."""
    from torch.nn.modules.module import register_module_forward_hook

    def hook(module, args, kwargs, output):
        if type(module).__name__ != "MtpModel" or not isinstance(output, tuple):
            return None
        ids, *rest = output
        ids = ids.clone()  # the MTP layer reads token p (position_ids[-1] = p) and proposes token p + 1
        ids[:, 0] = script.token(int(kwargs["position_ids"].reshape(-1)[-1]) + 1)
        return (ids, *rest)

    handle = register_module_forward_hook(hook, with_kwargs=True)
    try:
        yield script
    finally:
        handle.remove()


# ----------------------------------------------------------------------------- one run
def _depth(model):
    return getattr(model.config.get_text_config(), "num_hidden_layers", None)


class _TargetCalls(LogitsRecorder):
    """The logits recorder, blind to early-exit drafts (the same model, run with fewer layers)."""

    def __init__(self, target):
        super().__init__(target)
        self.depth = _depth(target)

    def _before(self, module, args, kwargs):
        super()._before(module, args, _as_523(args, kwargs))

    def _after(self, module, args, kwargs, output):
        if _depth(module) == self.depth:
            # the recorded row is a copy: sampling scales output.logits in place
            super()._after(module, args, _as_523(args, kwargs), output)


def _as_523(args, kwargs) -> dict:
    """The recorder reads ``past_key_values=``; transformers 5.24+ passes the cache as ``cache=``."""
    from patcher.lossless import cache_of

    cache = cache_of(args, kwargs)
    return kwargs if cache is None or "past_key_values" in kwargs else {**kwargs, "past_key_values": cache}


def _calls(recorder) -> list[dict]:
    """The recorder's calls, once each: under ``lossless`` the hooks also see verify_forward's inner call."""
    out = []
    for call in recorder.calls:
        if out and out[-1]["ids"] == call["ids"] and out[-1]["positions"] == call["positions"]:
            continue
        out.append(call)
    return out


def acceptance_lengths(calls: list[dict], prompt_len: int, final_len: int) -> list[int]:
    """New tokens each target forward committed: from where the next forward starts."""
    starts = [c["positions"][0] for c in calls] + [final_len - 1]
    out = []
    for i, call in enumerate(calls):
        begin = prompt_len - 1 if call["positions"][0] == 0 else call["positions"][0]
        if starts[i + 1] > begin:  # a forward that committed nothing here (a re-run from 0) is no verify step
            out.append(starts[i + 1] - begin)
    return out


def generate_kwargs(mode: str, target, assistant, drafter) -> dict:
    if mode == "mtp":
        return {"use_mtp": True}
    if mode == "assistant":
        return {"assistant_model": assistant}
    if mode == "prompt-lookup":
        return {"prompt_lookup_num_tokens": LOOKUP_TOKENS}
    if mode == "dflash":
        return {"assistant_model": drafter, "speculation_type": "dflash"}
    if mode == "early-exit":
        return {"assistant_early_exit": early_exit_layer(target)}
    raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")


def run_mode(target, mode: str, ids, reference: list[int], max_new: int, kwargs: dict, script_for=None, sampling=None, seed=0):
    """(new tokens, acceptance lengths, seconds, logits verdict or None, script or None)."""
    import torch

    from patcher.lossless import lossless

    script = None
    scripting = contextlib.nullcontext()
    if script_for is not None and mode in ("mtp", "assistant"):
        script = Script(ids[0].tolist() + reference, seed, script_for)
        scripting = scripted_mtp(script) if mode == "mtp" else scripted_assistant(kwargs["assistant_model"], script)
    extra = dict(do_sample=True, **sampling) if sampling else dict(do_sample=False)
    with _TargetCalls(target) as recorder, scripting, lossless(target):
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = target.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, **extra, **kwargs)
        seconds = time.perf_counter() - start
    final = out[0].tolist()
    calls = _calls(recorder)
    dtype = str(target.dtype).replace("torch.", "")
    tolerance = LOGIT_TOLERANCE.get(dtype, LOGIT_TOLERANCE["float32"])
    verdict = judge_logits(calls, final, reference_logits(target, final), ids.shape[1], tolerance)
    return final[ids.shape[1]:], acceptance_lengths(calls, ids.shape[1], len(final)), seconds, verdict, script


# ----------------------------------------------------------------------------- the native control
#: transformers' refusal of speculative generate() on a stateful class (5.23 and older)
_REFUSAL = "not supported with stateful models"


# The same computation as `first_divergence` in benchmarks/repro_native_assisted_generate.py, duplicated on purpose:
# that script must run with torch and transformers alone (a user attaches it to a transformers report), and ddpatch
# must not import from benchmarks/ (not a package, not installed). Keep the two in step.
def native_divergence(model, prompt: list[int], expected: list[int], got: list[int]) -> dict | None:
    """None when ``got == expected``; else the first divergent new token (0-based), both tokens, and the margin
    ``z[expected] - z[got]`` of the target's own from-scratch forward (no cache) over the shared prefix."""
    import torch

    i = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if i is None:
        if len(expected) == len(got):
            return None
        i = min(len(expected), len(got))
    row = {"new_token": i, "expected": expected[i] if i < len(expected) else None,
           "got": got[i] if i < len(got) else None, "margin": None, "from_scratch_argmax": None}
    if row["expected"] is not None and row["got"] is not None:
        device = model.get_input_embeddings().weight.device
        with torch.no_grad():
            z = model(torch.tensor([prompt + expected[:i]], device=device), use_cache=False).logits[0, -1].float()
        row["from_scratch_argmax"] = int(z.argmax())
        row["margin"] = float(z[row["expected"]] - z[row["got"]])
    return row


def run_native(target, mode: str, ids, reference: list[int], max_new: int, kwargs: dict, script_for=None, seed=0) -> dict:
    """The control: the same greedy run (same scripted draft) through transformers' own ``generate()``, no ``lossless``.
    ``{"status": "exact" | "diverges" | "refused" | "error", ...}``."""
    import torch

    scripting = contextlib.nullcontext()
    if script_for is not None and mode in ("mtp", "assistant"):
        script = Script(ids[0].tolist() + reference, seed, script_for)
        scripting = scripted_mtp(script) if mode == "mtp" else scripted_assistant(kwargs["assistant_model"], script)
    try:
        with scripting:
            torch.manual_seed(seed)
            out = target.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a refusal, or transformers failing in this mode: both are the control's result
        status = "refused" if isinstance(exc, ValueError) and _REFUSAL in str(exc) else "error"
        return {"status": status, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    divergence = native_divergence(target, ids[0].tolist(), reference, out[0, ids.shape[1]:].tolist())
    return {"status": "exact", "divergence": None} if divergence is None else {"status": "diverges", "divergence": divergence}


def native_check(mode: str, runs: list[dict], lossless_evidence: str, version: str) -> dict:
    """The control's row, shown next to ``lossless: MODE``; it passes whatever it shows."""
    evidence = f"transformers {version}'s own generate(), no lossless: "
    if runs and all(r["status"] == "refused" for r in runs):
        evidence = f"refused by transformers {version} ({runs[0]['error'].split(': ', 1)[-1]})"
    elif any(r["status"] == "diverges" for r in runs):
        bad = [r for r in runs if r["status"] == "diverges"]
        d = bad[0]["divergence"]
        margin = f", from-scratch margin {d['margin']:.2e}" if d["margin"] is not None else ""
        evidence += (f"{len(bad)}/{len(runs)} runs differ; prompt {bad[0]['prompt']} diverges at new token {d['new_token']}: "
                     f"target greedy {d['expected']}, native {d['got']}{margin}")
    elif any(r["status"] == "error" for r in runs):
        err = next(r for r in runs if r["status"] == "error")
        evidence += f"fails on prompt {err['prompt']}: {err['error']}"
    else:
        evidence += f"{len(runs)}/{len(runs)} runs token-identical (exact here)"
    return Check.of(f"native generate() (control): {mode}", passed=True, control=True,
                    evidence=f"{evidence}; lossless: {lossless_evidence}", native=runs).to_json()


# ----------------------------------------------------------------------------- the verifier
def _models(preset: str | None, target_dir: str | None, assistant_dir: str | None, dtype: str | None, workdir: Path, sampling: bool):
    """(label, target, assistant, scripted vocab or None, mtp available) for a preset or the user's folders."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.load import prepare_for_sampling
    from ..models.presets import MASK_TOKEN_ID, build_target

    if target_dir is not None:
        kwargs = {"dtype": getattr(torch, dtype or "bfloat16"), "local_files_only": True}
        target = AutoModelForCausalLM.from_pretrained(target_dir, **kwargs).eval()
        assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, **kwargs).eval() if assistant_dir else None
        mtp = getattr(target.config.get_text_config(), "num_mtp_layers", None) is not None
        return Path(target_dir).name, target, assistant, None, mtp
    try:
        target, mtp = mtp_checkpoint(preset, workdir / preset), True
    except Exception:  # the family has no MTP weights in transformers (or its MtpModel cannot be built)
        target, mtp = build_target(preset, seed=0), False
    assistant = build_target("tiny-qwen3", seed=100)
    if sampling:
        prepare_for_sampling(target, MASK_TOKEN_ID)
        prepare_for_sampling(assistant, MASK_TOKEN_ID)
    return preset, target, assistant, (None if sampling else MASK_TOKEN_ID), mtp


def _prompts(n: int, seed: int, vocab_hi: int, length: int = 24):
    """Random prompts whose n-grams repeat, so that prompt lookup finds candidates."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(0, vocab_hi, (6,), generator=gen)
        out.append(torch.cat([motif] * (length // 6) + [motif[: length % 6]])[None])
    return out


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _unavailable(mode: str, target, assistant, mtp: bool) -> str | None:
    if mode == "mtp" and not mtp:
        return "the target has no MTP weights (num_mtp_layers) transformers can load"
    if mode == "assistant" and assistant is None:
        return "no --assistant folder"
    if mode == "early-exit" and early_exit_layer(target) is None:
        return "no attention layer before the last (transformers' early-exit cache needs one)"
    return None


def verify_model(label, target, assistant, script_vocab, mtp, modes, prompts, max_new, sampling, sampling_runs) -> dict:
    from .decode_loop import MethodStats

    checks: list[dict] = []
    drafter = dflash_drafter(target) if "dflash" in modes else None
    baseline = MethodStats("generate()")
    references = []
    for ids in prompts:  # plain greedy generate(): the reference, and the speed baseline
        start = time.perf_counter()
        ref = target.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)[0, ids.shape[1]:].tolist()
        baseline.seconds += time.perf_counter() - start
        baseline.tokens += len(ref)
        baseline.runs.append({"verdict": {"identical": True}})
        references.append(ref)
    stats, partial = {}, 0
    for mode in modes:
        why = _unavailable(mode, target, assistant, mtp)
        if why:
            checks.append(Check.of(f"mode: {mode}", passed=True, evidence=f"not run: {why}").to_json())
            continue
        st = stats[mode] = MethodStats(mode)
        kwargs = generate_kwargs(mode, target, assistant, drafter)
        for p, (ids, ref) in enumerate(zip(prompts, references)):
            try:
                new, acc, secs, logits, script = run_mode(target, mode, ids, ref, max_new, kwargs, script_vocab, sampling, seed=p)
            except Exception as exc:  # a mode transformers cannot run here: a failed check, with its reason
                st.runs.append({"prompt": p, "verdict": compare(ref, []).as_dict(), "error": f"{type(exc).__name__}: {exc}"})
                continue
            st.tokens, st.seconds = st.tokens + len(new), st.seconds + secs
            st.acceptance += acc
            partial += sum(1 for a, n in (script.blocks if script else []) if 0 < a < n)
            verdict = compare(ref, new) if not sampling else Verdict(True, got_len=len(new))
            st.runs.append({"prompt": p, "verdict": verdict.as_dict(), "description": verdict.describe(),
                            "logits": logits.as_dict(), "logits_description": logits.describe(), "sampled": bool(sampling)})
        bad = [r for r in st.runs if not r["verdict"]["identical"] or "error" in r]
        if not sampling:
            evidence = (f"{len(bad)}/{len(st.runs)} runs differ; prompt {bad[0]['prompt']}: {bad[0].get('error') or bad[0]['description']}"
                        if bad else f"{len(st.runs)}/{len(st.runs)} runs token-identical to plain generate()")
            checks.append(Check.of(f"lossless: {mode}", passed=not bad, evidence=evidence).to_json())
            # the control runs after the mode's lossless runs: an assistant's draft-length schedule carries over calls
            native = [{"prompt": p, **run_native(target, mode, ids, ref, max_new, kwargs, script_vocab, seed=p)}
                      for p, (ids, ref) in enumerate(zip(prompts, references))]
            checks.append(native_check(mode, native, evidence, _transformers_version()))
        judged = [r for r in st.runs if "logits" in r]
        over = [r for r in judged if not r["logits"]["passed"]]
        worst = max(judged, key=lambda r: r["logits"]["max_abs"], default=None)
        checks.append(Check.of(f"logits == from-scratch: {mode}", passed=bool(judged) and not over and len(judged) == len(st.runs),
                               evidence=(over[0]["logits_description"] if over else worst["logits_description"] if worst
                                         else (bad[0].get("error") if bad else "no run"))).to_json())
        if sampling and sampling_runs and mode in ("assistant", "prompt-lookup"):
            ids = prompts[0]
            expected = second_token_distribution(target, ids, {k: v for k, v in sampling.items() if v is not None})
            counts: dict[int, int] = {}
            for i in range(sampling_runs):
                new, *_ = run_mode(target, mode, ids, references[0], 2, kwargs, None, sampling, seed=50_000 + i)
                counts[new[1]] = counts.get(new[1], 0) + 1
            test = chi_square_test(counts, expected)
            checks.append(Check.of(f"sampling distribution: {mode}", passed=test.passed,
                                   evidence="2nd new token vs the target's exact distribution: " + test.describe()).to_json())
    methods = []
    for st in stats.values():
        row = st.as_dict(baseline)
        judged = [r["logits"] for r in st.runs if "logits" in r]
        if judged:
            worst = max(judged, key=lambda v: v["max_abs"])
            row["max_dlogit"], row["max_dlogit_at"] = worst["max_abs"], worst["at"]
        methods.append(row)
    if script_vocab is not None and "assistant" in stats:  # scripted drafts: the rollback must have been exercised
        checks.append(Check.of("partial acceptances (scripted assistant)", passed=partial > 0,
                               evidence=f"{partial} blocks accepted in part: rollbacks were exercised" if partial else
                               "no block was accepted in part: the rollback was never exercised").to_json())
    return {"model": label, "checks": checks, "baseline": baseline.as_dict(None), "methods": methods,
            "partial_acceptances": partial, "plumbing_figures": script_vocab is not None or sampling is not None,
            "sampling": sampling}


def run_generate(presets=None, target=None, assistant=None, modes=None, seeds=None, prompts=None, max_new_tokens=None,
                 temperature=None, top_p=None, top_k=None, sampling_runs=None, dtype=None, **_ignored):
    """Verify ``generate()`` under ``lossless`` on presets or the user's folders; an ``Outcome``."""
    import tempfile

    import torch
    import transformers

    from patcher.lossless import refusal
    from patcher.results import Outcome

    start = time.perf_counter()
    modes = list(modes or MODES)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k} if temperature else None
    env = {"transformers": transformers.__version__, "torch": torch.__version__}
    result = {"tree": "generate()", "environment": env, "checks": [], "models": [], "modes": modes}
    with tempfile.TemporaryDirectory(prefix="ddpatch-generate-") as tmp:
        for preset in ([None] if target else (presets or ["tiny-qwen3_5"])):
            label, model, helper, vocab, mtp = _models(preset, target, assistant, dtype, Path(tmp), bool(sampling))
            reason = refusal(model)
            if reason is not None:
                result["models"].append({"model": label, "checks": [Check.of("supported", passed=False, evidence=reason).to_json()]})
                continue
            vocab_hi = min(model.config.get_text_config().vocab_size - 1, 1000)
            ps = [p for s in (seeds or [0]) for p in _prompts(prompts or 1, s, vocab_hi)]
            ps = [p.to(model.get_input_embeddings().weight.device) for p in ps]
            result["models"].append(verify_model(label, model, helper, vocab, mtp, modes, ps, max_new_tokens or 24,
                                                 sampling, 200 if sampling_runs is None else sampling_runs))
    return Outcome(result, time.perf_counter() - start)
