"""The decode loop of one model, which feeds the oracles: the target's greedy reference continuations and the noise
floor on them, a warm-up (every method once), then per prompt the target-alone speed baseline and one decode per
method under the oracles' recorders (the logits recorder, the drafter recorder, line coverage); under sampling, the
short decodes the distribution oracle counts. ``DecodeLoop.decode`` is one decode; what it yields is a ``Decode``.

A *method* is one decoder of the tree with one drafter class (and for a tree decoder one budget):
``methods.Method``. ``one_model.verify_model`` runs the loop and asks each oracle for its rows."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from . import calibration, logits, neartie
from .coverage import runs as coverage
from .drafter import recorder as drafter_recorder, verdict as drafter_verdict
from .rollback import first_partial
from .tokens import compare
from ..check import Check
from ..models.load import greedy
from ..models.script import ScriptedDraft
from ..plumbing.events import emit, error_summary
from ..plumbing.shims import environment_failure, retried_without
from ..subjects.binding import BindError, bind_roles, call_generate, unsupported_sampling

#: prompts the target-alone baseline runs on (its tokens/s is the speedup's denominator)
BASELINE_PROMPTS = 4


def sampling_of(cfg: dict) -> dict | None:
    """The sampling options a run passes to the decoder, or None for greedy decoding."""
    if not cfg.get("temperature"):
        return None
    return {"temperature": cfg["temperature"], "top_p": cfg.get("top_p"), "top_k": cfg.get("top_k")}


@dataclass
class Decode:
    """What one decode yields: its new tokens, acceptance lengths and seconds, and the oracles' verdicts on it (None
    where a decode is not judged: the warm-up, the distribution oracle's short runs)."""

    new: list[int]
    acceptance: list[int]
    seconds: float
    logits: "logits.LogitsVerdict | None" = None
    ties: "neartie.TieVerdict | None" = None  # greedy decodes only
    drafter: "drafter_verdict.DrafterVerdict | None" = None
    script: ScriptedDraft | None = None  # the scripted draft that proposed (a preset's drafter)

    def row(self, p_index: int, reference: list[int], sampling: dict | None, block_size: int) -> dict:
        """The run's row of its method (``MethodStats.runs``), which the oracles' method rows read."""
        partial_at = first_partial(self.acceptance, block_size)
        drafter_row = {"drafter": self.drafter.as_dict(), "drafter_description": self.drafter.describe()} if self.drafter else {}
        if sampling:  # sampled tokens have no greedy reference: the logits oracle judges them
            return {"prompt": p_index, "verdict": {"identical": True}, "sampled": True, "logits": self.logits.as_dict(),
                    "logits_description": self.logits.describe(), "first_partial": partial_at, "acceptance": list(self.acceptance),
                    **drafter_row}
        verdict = compare(reference, self.new)
        return {"prompt": p_index, "verdict": verdict.as_dict(), "description": verdict.describe(),
                "logits": self.logits.as_dict(), "logits_description": self.logits.describe(),
                "ties": self.ties.as_dict(), "ties_description": self.ties.describe(), "first_partial": partial_at,
                "acceptance": list(self.acceptance), **drafter_row}


@dataclass
class MethodStats:
    """A method's decodes over the prompts: tokens and seconds (its speed), its acceptance lengths and one row per run."""

    name: str
    tokens: int = 0
    seconds: float = 0.0
    acceptance: list[int] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)

    def add(self, run: "Decode", p_index: int, reference: list[int], sampling: dict | None, block_size: int) -> None:
        self.tokens += len(run.new)
        self.seconds += run.seconds
        self.acceptance += run.acceptance
        self.runs.append(run.row(p_index, reference, sampling, block_size))

    def as_dict(self, baseline: "MethodStats | None") -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        out = {
            "method": self.name,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(tps, 2),
            "identical_runs": sum(r["verdict"]["identical"] for r in self.runs),
            "near_ties": sum(len(r.get("ties", {}).get("near_ties", [])) for r in self.runs if r.get("ties", {}).get("kind") == "near-tie"),
            "runs": self.runs,
        }
        if self.acceptance:
            hist: dict[int, int] = {}
            for a in self.acceptance:
                hist[a] = hist.get(a, 0) + 1
            out["acceptance_mean"] = round(sum(self.acceptance) / len(self.acceptance), 3)
            out["acceptance_histogram"] = {str(k): v for k, v in sorted(hist.items())}
        if baseline is not None and baseline.seconds and self.seconds and baseline.tokens:
            out["speedup"] = round((self.tokens / self.seconds) / (baseline.tokens / baseline.seconds), 3)
        return out


def decoder_of(method) -> dict:
    """The method's decoder (file and function), kind and drafter class, as its rows name them."""
    return {"file": method.decoder["file"], "function": method.decoder["qualname"], "kind": method.kind, "drafter": method.drafter}


def decoder_row(check: dict, method) -> dict:
    """``check`` naming the method's decoder."""
    return {**check, "decoder": decoder_of(method)}


def block_of(method, drafts: dict, block_size: int) -> int:
    """The block size a method decodes with: the run's, where its decoder takes one, else its drafter's own (a drafter's
    ``spec_generate`` that reads ``self.block_size``)."""
    draft = drafts.get(method.drafter)
    try:
        takes = "block_size" in bind_roles(method.callable_for(draft), method.required()).values()
    except BindError:
        takes = True
    own = getattr(draft, "block_size", None) or getattr(getattr(draft, "config", None), "block_size", None)
    return block_size if takes or not isinstance(own, int) else own


def warm_rows(methods: list, failed: dict) -> list[dict]:
    """``warms up`` for the model (its first failure's error, hint and what it does once shimmed, every failure named),
    and a failing ``warms up: METHOD`` row of each method that did not run: the others are judged on."""
    if not failed:
        return [Check.of("warms up", passed=True, evidence="every method ran once").to_json()]

    def text(method, err):
        return f"{method.name} ({method.where}): {err['error']}" + (f"; {err['then']['text']}" if err.get("then") else "")

    (m0, e0), *_ = failed.values()
    others = [m.name for m in methods if m.name not in failed]
    rows = [Check.of("warms up", passed=False, **e0, evidence="; ".join(text(m, e) for m, e in failed.values())
                     + (f"; {len(others)} other method(s) ran and are judged below" if others else "")).to_json()]
    rows += [decoder_row(Check.of(f"warms up: {m.name}", passed=False, **e, evidence=text(m, e)).to_json(), m)
             for m, e in failed.values()]
    return rows


def never_emitted(target, prompts, references) -> int:
    """A mask id for the scripted draft that the target's reference runs never emit: of the ids absent
    from every reference and every prompt, the one whose largest logit over the reference positions is lowest.
    Not a prompt id: upstream decoders drop the mask id from the whole row, prompt included."""
    import torch

    seen = {t for ref in references for t in ref} | {int(t) for prompt in prompts for t in prompt.flatten().tolist()}
    worst = None
    with torch.inference_mode():
        for prompt, ref in zip(prompts, references):
            # the forward the oracles ask for again
            shared = logits.plain_forward(target, prompt[0].tolist() + list(ref), hidden_states=True)
            if shared is not None:
                top = shared[0].amax(dim=0).clone()
            else:
                ids = torch.cat([prompt, torch.tensor([ref], device=prompt.device)], dim=1) if ref else prompt
                top = target(ids, use_cache=False).logits[0].float().amax(dim=0).cpu().clone()
            worst = top if worst is None else torch.maximum(worst, top)
    worst = worst.clone()  # out of inference mode
    if seen:
        worst[list(seen)] = float("inf")
    return int(worst.argmin())


class DecodeLoop:
    """One model's decodes and what the oracles read of them: the run's settings, the reference continuations, the
    noise floor (``cal``), the drafter oracle's calibration per drafter class (``dcals``), the methods still judged,
    and after ``decode_prompts`` each method's ``MethodStats`` and scripted drafts."""

    def __init__(self, label: str, cfg: dict, loaded, target, drafts: dict, mask_token_id, is_preset: bool, prompts,
                 scripted: bool = False, choose_mask: bool = False):
        self.label, self.cfg, self.loaded, self.target, self.drafts = label, cfg, loaded, target, drafts
        self.is_preset = is_preset
        self.real = not (is_preset or scripted)  # a real drafter proposes (no scripted draft replaces its output)
        self.block_size = cfg["block_size"]
        self.stop_ids = cfg.get("stop_token_ids") or None
        self.stops = self.stop_ids or ()
        self.max_new = cfg["max_new_tokens"]
        self.sampling = sampling_of(cfg)
        self.dtype = str(target.dtype).replace("torch.", "")
        self.f32 = calibration.float32_command(cfg)
        device = target.get_input_embeddings().weight.device
        self.prompts = [p.to(device) for p in prompts]
        budgets = set(cfg["tree_budgets"])
        self.methods = [m for m in loaded.methods if (m.kind != "tree" or m.budget in budgets) and (m.drafter is None or m.drafter in drafts)]
        self.stats: dict[str, MethodStats] = {}
        self.scripts: dict[str, list] = {}
        self.baseline: MethodStats | None = None
        self.distributions: dict[str, dict] = {}  # the distribution oracle's tests, by method
        self.floors: dict = {}  # the acceptance oracle's floors, by (drafter class, block size)
        self.done = self.total = 0

        # the reference continuations, then the noise floor on them: the tolerance follows this target, dtype and device
        # (greedy's own forwards give the noise floor's token-by-token rows and, for prompt 0, the drafter oracle's
        # token-by-token features: nothing computed twice)
        stepped = [[] for _ in self.prompts]
        hidden0: list | None = [] if drafts else None
        self.references = [greedy(target, p, self.max_new, self.stops, rows=rows, hidden=hidden0 if i == 0 else None)
                           for i, (p, rows) in enumerate(zip(self.prompts, stepped))]
        if choose_mask:
            mask_token_id = never_emitted(target, self.prompts, self.references)
            for draft in drafts.values():
                draft.mask_token_id = mask_token_id
        self.mask_token_id = mask_token_id
        self.cal = calibration.calibrate(target, self.prompts, self.references, override=cfg.get("logit_tolerance"), stepped=stepped)
        del stepped
        self.tolerance = self.cal.tolerance
        self.dcals = {name: drafter_verdict.calibrated(target, draft, self.prompts[0], self.references[0], mask_token_id,
                                                       self.block_size, hidden0)
                      for name, draft in drafts.items()}

    def block_of(self, method) -> int:
        return block_of(method, self.drafts, self.block_size)

    def progress(self, text: str) -> None:
        emit("progress", done=self.done, total=self.total, label=f"{self.label}: {text}")

    # ------------------------------------------------------------------ one decode
    def decode(self, method, prompt, reference: list[int], seed: int, max_new_tokens: int | None = None, judge: bool = True) -> Decode:
        """One decode of ``method`` under the recorders; ``judge``: the logits, near-tie and drafter verdicts on it."""
        import torch

        max_new_tokens = self.max_new if max_new_tokens is None else max_new_tokens
        target, draft = self.target, self.drafts.get(method.drafter)
        hook = script = None
        if draft is not None and not self.real:
            script = ScriptedDraft(target, prompt[0].tolist() + reference, seed=seed, forbidden=[self.mask_token_id],
                                   from_distribution=self.sampling is not None)
            hook = script.attach(draft)
        if self.sampling:
            torch.manual_seed(10_000 + seed)
        recorder = logits.LogitsRecorder(target)
        dcal, draft_skip = self.dcals.get(method.drafter, (None, "target-only: no drafter"))
        drafted = drafter_recorder.DrafterRecorder(draft, target) if judge and draft is not None and draft_skip is None else None
        try:
            with recorder if judge else contextlib.nullcontext(), drafted or contextlib.nullcontext(), coverage.measuring(method):
                new, acceptance, secs = call_generate(
                    method.callable_for(draft), model=draft, target=target, input_ids=prompt, mask_token_id=self.mask_token_id,
                    max_new_tokens=max_new_tokens, block_size=self.block_size, stop_token_ids=self.stop_ids,
                    tree_budget=method.budget, sampling=self.sampling, required=method.required(),
                )
        finally:
            if hook is not None:
                hook.remove()
        run = Decode(new, acceptance, secs, script=script)
        if not judge:
            return run
        final, prompt_len = prompt[0].tolist() + new, prompt.shape[1]
        if not acceptance and method.kind != "target":  # the decoder keeps no statistics: read them off its forwards
            run.acceptance = logits.observed_acceptance(recorder.calls, prompt_len, len(final))
        forced = logits.reference_logits(target, final)  # teacher-forced over the emitted tokens
        run.logits = logits.judge_logits(recorder.calls, final, forced, prompt_len, self.tolerance)
        if not self.sampling:
            run.ties = neartie.judge_ties(reference, new, forced, prompt_len, self.cal.epsilon, self.mask_token_id, self.stops,
                                          max_new_tokens)
        if drafted:
            run.drafter = drafter_verdict.judge_or_skip(drafted, target, draft, final, self.mask_token_id, dcal, self.cfg.get("reviewed"))
        return run

    # ------------------------------------------------------------------ the loop
    def drop_unsampleable(self) -> list[dict]:
        """Under sampling, a decoder that cannot take the requested sampling options is not run (and says so)."""
        if not self.sampling:
            return []
        skipped = [(m, unsupported_sampling(m.callable_for(self.drafts.get(m.drafter)), self.sampling, m.required())) for m in self.methods]
        skipped = [(m, keys) for m, keys in skipped if keys]
        if not skipped:
            return []
        self.methods = [m for m in self.methods if m not in [x for x, _ in skipped]]
        return [Check.of("sampling options", passed=True, evidence="; ".join(
            f"{m.name} ({m.where}) not run: its decoder takes no {', '.join(keys)}" for m, keys in skipped)).to_json()]

    def warm_up(self) -> list[dict]:
        """Every method once on a short prompt; one that fails (its own failing rows) does not stop the others from being
        judged. A failure that only the environment causes (CUDA timing, a missing optional package) is shimmed and the
        method retried, so that the report names the first real failure too."""
        short = self.prompts[0][:, :4]
        short_reference = greedy(self.target, short, self.max_new, self.stops)  # once for every method
        failed = {}
        for method in self.methods:
            try:
                self.decode(method, short, short_reference, seed=-1, judge=False)
            except Exception as exc:  # the patched code failed to run at all
                err = error_summary(exc)
                env = environment_failure(exc)
                if env is not None:
                    err["then"] = retried_without(env, lambda m=method: self.decode(m, short, short_reference, seed=-1, judge=False))
                failed[method.name] = (method, err)
        rows = warm_rows(self.methods, failed)
        self.methods = [m for m in self.methods if m.name not in failed]
        return rows

    def decode_prompts(self) -> None:
        """Per prompt, the speed baseline (on the first ``baseline_prompts``), then one judged decode per method."""
        import torch

        cfg, sampling = self.cfg, self.sampling
        baseline_method = next((m for m in self.methods if m.kind == "chain" and not m.drafter_method and m.drafter == self.loaded.primary), None)
        self.baseline = MethodStats("target greedy (block_size=1)" if not sampling else "target sampling (block_size=1)")
        self.stats = {m.name: MethodStats(m.name) for m in self.methods}
        self.scripts = {m.name: [] for m in self.methods}
        self.total, self.done = len(self.prompts) * (1 + len(self.methods)), 0
        for p_index, prompt in enumerate(self.prompts):
            reference = self.references[p_index]
            seed = cfg["seeds"][p_index % len(cfg["seeds"])] * 1000 + p_index
            if sampling:
                torch.manual_seed(10_000 + seed)
            if p_index < cfg.get("baseline_prompts", BASELINE_PROMPTS):  # the speed baseline needs a few prompts, not all
                self._baseline(baseline_method, p_index, prompt, reference)
            self.done += 1
            self.progress(f"prompt {p_index + 1} baseline")
            for method in self.methods:
                try:
                    run = self.decode(method, prompt, reference, seed)
                except Exception as exc:
                    self.stats[method.name].runs.append({"prompt": p_index, "verdict": compare(reference, []).as_dict(), **error_summary(exc)})
                    continue
                if run.script is not None:
                    self.scripts[method.name].append(run.script)
                self.stats[method.name].add(run, p_index, reference, sampling, self.block_size)
                self.done += 1
                self.progress(f"prompt {p_index + 1} {method.name}")

    def _baseline(self, method, p_index: int, prompt, reference: list[int]) -> None:
        """The target alone: the primary drafter's chain decoder at block size 1, or (no chain decoder) the target's own
        greedy decoding."""
        if method is not None:
            new, _, secs = call_generate(
                method.fn, model=self.drafts[method.drafter], target=self.target, input_ids=prompt, mask_token_id=self.mask_token_id,
                max_new_tokens=self.max_new, block_size=1, stop_token_ids=self.stop_ids, sampling=self.sampling, strict=False,
            )
        else:
            import time

            start = time.perf_counter()
            new = greedy(self.target, prompt, self.max_new, self.stops)
            secs = time.perf_counter() - start
        self.baseline.tokens += len(new)
        self.baseline.seconds += secs
        self.baseline.runs.append({"prompt": p_index, "verdict": compare(reference, new).as_dict() if not self.sampling else {"identical": True}})

    # ------------------------------------------------------------------ the model's result
    def method_row(self, method) -> dict:
        """The method's figures: speed against the baseline, acceptance, its runs, the worst logit difference."""
        st = self.stats[method.name]
        row = st.as_dict(self.baseline)
        row["decoder"] = decoder_of(method)
        judged = [r["logits"] for r in st.runs if "logits" in r]
        if judged:
            worst = max(judged, key=lambda v: v["max_abs"])
            row["max_dlogit"], row["max_dlogit_at"] = worst["max_abs"], worst["at"]
        if st.name in self.distributions:
            row["distribution"] = self.distributions[st.name]
        return row

    def result(self, checks: list[dict]) -> dict:
        """The model's result: its check rows and figures (short when no method got past the warm-up)."""
        cal = self.cal
        if not self.methods:
            logits.forget_plain()
            return {"model": self.label, "checks": checks, "methods": [], "calibration": cal.as_dict(), "logit_tolerance": self.tolerance}
        partial = [a for st in self.stats.values() for a in st.acceptance if 1 < a < self.block_size]
        method_rows = [self.method_row(m) for m in self.methods]
        logits.forget_plain()  # this model's shared forwards: the next model's sequences are others
        return {
            "model": self.label,
            "checks": checks,
            "baseline": self.baseline.as_dict(None),
            "methods": method_rows,
            "partial_acceptances": len(partial),
            "plumbing_figures": self.is_preset,
            "sampling": self.sampling,
            "logit_tolerance": self.tolerance,
            "calibration": cal.as_dict(),
            "mask_token_id": self.mask_token_id,
            "prompts_made": self.cfg.get("prompts_made"),
            "drafter_calibration": {n: c.as_dict() for n, (c, _) in self.dcals.items() if c is not None} or None,
        }
