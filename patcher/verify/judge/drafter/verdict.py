"""The drafter oracle's verdict: every recorded drafter call (``recorder.DrafterRecorder``) against its
from-scratch reference on the final committed sequence, field by field (``FIELDS``), with the exact difference and
what to look at (``HINTS``). A field the user reviewed as a deliberate difference of the tree (``--reviewed``) is
reported, and the reference takes the tree's own value for it.

``calibrated`` measures the oracle's tolerances on the run's target (or says why it cannot judge this drafter),
``judge_or_skip`` is the verdict on one decode, ``method_check`` the ``drafter: METHOD`` row over a method's runs, and
``class_row`` the ``drafter class NAME`` row of a drafter class the verifier could not build."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import recorder as oracle
from .. import routers
from ...check import Check
from ...plumbing.events import error_summary
from .recorder import DrafterCalibration, DrafterRecorder, Reference, embedding_scale, reference_output

#: what to look at when a field differs (the recipe step, or the upstream line)
HINTS = {
    "cache": "the draft cache must be cut back to the committed length after each drafter call "
             "(upstream: past_key_values_draft.crop(start); recipe step crop-compat)",
    "positions": "position_ids[:, draft_cache_length : start + block_size] (upstream's draft call)",
    "features": "target_hidden = extract_context_feature(verify.hidden_states, target_layer_ids) of the committed "
                "positions only (upstream: layers_out[:, :committed] / layers_out[:, path, :]), "
                "hidden_states[layer_id + 1]",
    "noise": "noise_embedding = target.get_input_embeddings()(block) with block = [committed token, mask_token_id, ...] "
             "(recipe step input-embeddings)",
    "output": "the inputs agree but the output does not: the draft cache holds other context than the committed features "
              "(a crop to another length), or the drafter's windowing (recipe step draft-sliding-window)",
    "selector": "the drafter's proposal method (DFlash2's propose, compute_logits) must get the drafter's output rows for the "
                "block's positions 1.. (upstream: model(...)[:, 1 - block_size:, :])",
    "anchor": "the proposal method's anchor ids must be the block's first, committed token (upstream: block_output_ids[:, 0])",
    "seeded": "the tree fills block positions with other ids than the mask id: a design of its own? If so, record it as "
              "reviewed (--reviewed noise, or reviewed = [\"noise\"] in [tool.ddpatch]); no recipe step writes these ids",
}




# ----------------------------------------------------------------------------- the verdict
#: the fields judged per round, in the order a failure names them
FIELDS = ("cache", "features", "positions", "noise", "output", "selector", "anchor")
#: the drafter inputs a tree may set differently on purpose (``--reviewed``): reported, and the reference then takes
#: the tree's own value, so that the rest of the round is still judged
REVIEWABLE = ("noise", "positions", "features")


@dataclass
class DrafterVerdict:
    rounds: int = 0  # drafter calls judged
    unjudged: int = 0  # drafter calls past the final sequence (or not read)
    failures: list = field(default_factory=list)  # (round, field, detail), in order
    worst: dict = field(default_factory=dict)  # field -> largest |Δ| on any round
    top1: list = field(default_factory=lambda: [0, 0])  # proposals equal / compared
    skipped: str | None = None
    hints: dict = field(default_factory=dict)  # field -> HINTS key, where the first failure calls for another hint
    reviewed: list = field(default_factory=list)  # (round, field, detail) of reviewed deliberate differences

    @property
    def passed(self) -> bool:
        return self.skipped is None and self.rounds > 0 and not self.failures

    def describe(self) -> str:
        if self.skipped:
            return f"drafter oracle: skipped ({self.skipped})"
        if not self.rounds:
            return "no drafter call was judged (the drafter was not called during the decode)"
        if self.failures:
            first = self.failures[0][0]
            here = [(f, d) for r, f, d in self.failures if r == first]
            later = len({r for r, _, _ in self.failures} - {first})
            return (f"round {first}: " + "; ".join(f"{f} differs: {d}" for f, d in here)
                    + (f"; {later} later rounds differ too" if later else "")
                    + f" - hint: {HINTS[self.hints.get(here[0][0], here[0][0])]}")
        worst = ", ".join(f"{k} {v:.1e}" for k, v in self.worst.items())
        text = f"{self.rounds} rounds from scratch, max |Δ| {worst}, top-1 {self.top1[0]}/{self.top1[1]}"
        if self.reviewed:
            fields = sorted({f for _, f, _ in self.reviewed})
            text += (f"; reviewed deliberate difference ({', '.join(fields)}) in {len({r for r, _, _ in self.reviewed})} rounds, "
                     f"e.g. round {self.reviewed[0][0]}: {self.reviewed[0][2]}")
        return text

    def as_dict(self) -> dict:
        return {"passed": self.passed, "rounds": self.rounds, "unjudged": self.unjudged, "skipped": self.skipped,
                "failures": [{"round": r, "field": f, "detail": d} for r, f, d in self.failures],
                "reviewed": [{"round": r, "field": f, "detail": d} for r, f, d in self.reviewed],
                "worst": self.worst, "top1": list(self.top1)}


def _span(values: list[int]) -> str:
    if len(values) > 1 and values == list(range(values[0], values[0] + len(values))):
        return f"{values[0]}..{values[-1]}"
    return ",".join(map(str, values)) or "none"


def _nearest(rows, table, chunk: int = 8192) -> list[int]:
    """For each row, the index of the nearest row of ``table`` (which position, which token id); the table is read in
    chunks (a real vocabulary's embeddings do not fit twice in memory as float32)."""
    import torch

    if not rows.shape[0] or not table.shape[0]:
        return []
    rows = rows.float().cpu()
    best_d, best_i = None, None
    for lo in range(0, table.shape[0], chunk):
        d = torch.cdist(rows, table[lo:lo + chunk].detach().float().cpu())
        v, i = d.min(dim=1)
        if best_d is None:
            best_d, best_i = v, i
        else:
            better = v < best_d
            best_d, best_i = torch.where(better, v, best_d), torch.where(better, i + lo, best_i)
    return best_i.tolist()


def _features(ref, feats, rows, c: int, s: int, tol: float, worst, projected: int | None = None) -> str | None:
    """(a): the rows must be the reference features of positions c..s-1; what they are instead. Rows as wide as the
    drafter's own input projection's output (``projected``: a fork that projects the features first, as
    ``model.project_target_hidden(...)`` does, and hands the drafter the result) are not compared here: the drafter's
    output, which they feed, is compared with its from-scratch output on the reference's raw features."""
    if projected and rows.shape[-1] == projected != feats.shape[-1] and rows.shape[0] == s - c:
        return None
    span = _span(list(range(c, s)))
    near = _nearest(rows, feats) if rows.shape[-1] == feats.shape[-1] else []
    if rows.shape != feats[c:s].shape:
        return f"{rows.shape[0]} rows given for positions {span} ({s - c} expected)" + (f", nearest to positions {_span(near)}" if near else "")
    if not rows.numel():
        return None
    diff = worst("features", float((rows - feats[c:s]).abs().max()))
    if diff <= tol:
        return None
    ids = ref.layer_ids
    for label, (layer_ids, offset) in {"the layers in reverse order": (ids[::-1], 1), "hidden_states[layer_id] (the +1 offset dropped)": (ids, 0),
                                       "reversed and without the +1 offset": (ids[::-1], 0)}.items():
        alt = ref.pick(layer_ids, offset).float().cpu()[c:s]
        if (layer_ids, offset) != (ids, 1) and float((alt - rows).abs().max()) <= tol:
            return f"max |Δ| {diff:.2e} over positions {span} (tolerance {tol:.0e}): they are {label}, target_layer_ids {ids}"
    stale = f", the rows are nearest to positions {_span(near)} (stale context?)" if near and near != list(range(c, s)) else ""
    return f"max |Δ| {diff:.2e} over positions {span} (tolerance {tol:.0e})" + stale


def _noise(ref, given, expect, token: int, mask_id: int, worst, verdict=None) -> str | None:
    """(b): the block's embedding must be the committed token's, then the mask id's; which ids it holds instead. Rows
    that are other rows of the target's own embeddings (times the drafter's scale) are the tree's own choice of ids
    (seeded mask positions), not a wrong table: that failure hints at a review, not at a recipe step."""
    if given.shape != expect.shape:
        return f"shape {tuple(given.shape)} given, {tuple(expect.shape)} expected"
    exact = 1e-6 * (float(expect.abs().max()) + 1e-6)
    diff = worst("noise", float((given - expect).abs().max()))
    if diff <= exact:
        return None
    bad = [i for i in range(given.shape[0]) if float((given[i] - expect[i]).abs().max()) > exact]
    table = getattr(ref.embed, "weight", None)
    what = ""
    if table is not None:
        scale = embedding_scale(ref.draft)
        ids = _nearest(given[bad] / scale, table)
        rows = table[torch_index(ids, table.device)].detach().float().cpu() * scale
        off = max(float((given[i] - row).abs().max()) for i, row in zip(bad, rows))
        if off <= exact:
            what = f": they embed ids {_span(ids)} of the target's own table (not the mask id)"
            if verdict is not None and 0 not in bad:
                verdict.hints.setdefault("noise", "seeded")
        else:
            what = f": they are no rows of the target's input embeddings (nearest ids {_span(ids)}, Δ {off:.1e})"
    return f"max |Δ| {diff:.2e} at block rows {_span(bad)} (committed token {token}, mask id {mask_id}){what}"


def torch_index(ids: list[int], device):
    import torch

    return torch.tensor(ids, device=device, dtype=torch.long)


def _proposals(call: dict, token: int, tol: float, worst) -> dict:
    """(e) DFlash2's proposal path (``propose``, ``compute_logits``): the hidden rows it is given must be the drafter's
    output rows for the block's positions 1.. (aligned to the end), its anchor ids the block's committed token."""
    found = {"selector": None, "anchor": None}
    out = call.get("delivered", call["output"])[0].float().cpu()
    for rec in call.get("proposals", []):
        hidden = rec["hidden"]
        if hidden is not None and found["selector"] is None:
            rows = hidden[0].float().cpu()
            n = rows.shape[0]
            if n > out.shape[0] or rows.shape[-1] != out.shape[-1]:
                found["selector"] = f"{rec['method']} got {tuple(rows.shape)} rows, the drafter output has {tuple(out.shape)}"
            else:
                diff = worst("selector", float((rows - out[-n:]).abs().max()))
                if diff > tol:
                    found["selector"] = (f"{rec['method']} got rows {max(diff, 0):.2e} away from the drafter output's last {n} rows "
                                         f"(tolerance {tol:.0e})")
        anchor = rec["anchor"]
        if anchor is not None and found["anchor"] is None:
            got = anchor.reshape(-1).tolist()
            if got and got != [token] * len(got):
                found["anchor"] = f"{rec['method']} got anchor ids {got}, the block's committed token is {token}"
    return found


def _output(head, out, scratch, tol: float, verdict, worst) -> str | None:
    """(d): the drafter's raw output against the from-scratch forward, and its proposals (argmax), off near-ties."""
    import torch

    if out.shape != scratch.shape:
        return f"shape {tuple(out.shape)} given, {tuple(scratch.shape)} from scratch"
    if out.shape[0] < 2:
        return None
    diff = worst("output", float((out[1:] - scratch[1:]).abs().max()))
    if diff == 0.0:  # bit-equal outputs make bit-equal logits: every proposal is the from-scratch one, no head forward
        verdict.top1[0] += out.shape[0] - 1
        verdict.top1[1] += out.shape[0] - 1
        return None
    with torch.inference_mode():
        w = head.weight
        got, ref = (head(x[1:].to(w.device, w.dtype)).float().cpu() for x in (out, scratch))
    top2 = ref.topk(2, dim=-1).values
    same = got.argmax(-1) == ref.argmax(-1)
    verdict.top1[0] += int(same.sum())
    verdict.top1[1] += int(same.numel())
    flips = (~same) & ((top2[:, 0] - top2[:, 1]) > 2 * (got - ref).abs().amax(dim=-1))
    if diff <= tol and not bool(flips.any()):
        return None
    return (f"max |Δ| {diff:.2e} against a from-scratch drafter forward (tolerance {tol:.0e}); "
            f"proposals equal at {int(same.sum())}/{same.numel()} block positions")


def judge(recorder: DrafterRecorder, target, draft, final, mask_id: int, cal: DrafterCalibration,
          reviewed: tuple[str, ...] = ()) -> DrafterVerdict:
    """Every recorded drafter call against its from-scratch reference on ``final`` (prompt + new tokens). A field in
    ``reviewed`` (a deliberate difference of the tree's, ``REVIEWABLE``) is reported, not failed, and the reference
    takes the tree's own value for it."""
    import torch

    verdict = DrafterVerdict()
    ref = Reference(target, draft, final)
    feats = ref.features.float().cpu()
    head, dtype = target.get_output_embeddings(), next(draft.parameters()).dtype

    def worst(name, value):
        verdict.worst[name] = max(verdict.worst.get(name, 0.0), value)
        return value

    prev_start = 0
    for r, call in enumerate(recorder.calls):
        s, c = recorder.start_of(call), call["cache_len"]
        if s is None or s >= len(final) or any(call.get(k) is None for k in ("noise", "positions", "features", "output")):
            verdict.unjudged += 1
            continue
        verdict.rounds += 1
        q = call["noise"].shape[1]
        got, want = call["positions"].reshape(-1, call["positions"].shape[-1])[0].tolist(), list(range(c, s + q))
        shift = {g - w for g, w in zip(got, want)} if len(got) == len(want) else set()
        feats_in = ref.features[None, :s].to(dtype)
        if "features" in reviewed and call["features"].shape[1] == s - c and c == 0:
            feats_in = call["features"].to(ref.device, dtype)
        noise_in = call["noise"].to(ref.device, dtype) if "noise" in reviewed else ref.block(s, q, mask_id).to(dtype)
        scratch = reference_output(draft, recorder.roles, feats_in, noise_in, torch.arange(s + q, device=ref.device)[None])
        found = {
            # the draft cache may hold committed context only: nothing past the previous round's committed length
            "cache": None if c <= prev_start else (f"the draft cache held {c} positions before this call, the previous round "
                                                   f"had committed only {prev_start} (it keeps {c - prev_start} block position(s))"),
            "features": _features(ref, feats, call["features"][0].float().cpu(), c, s, cal.tolerances["features"], worst,
                                  getattr(getattr(draft, "fc", None), "out_features", None)),
            "positions": None if got == want else (f"{_span(got)} given, {_span(want)} expected (draft cache {c}, committed {s})"
                                                   + (f": shifted by {shift.pop():+d}" if len(shift) == 1 else "")),
            "noise": _noise(ref, call["noise"][0].float().cpu(), ref.block(s, q, mask_id)[0].float().cpu(), final[s], mask_id, worst,
                            verdict),
            "output": _output(head, call["output"][0].float().cpu(), scratch, cal.tolerances["output"], verdict, worst),
            **_proposals(call, final[s], cal.tolerances["output"], worst),
        }
        for name in FIELDS:
            if found[name]:
                (verdict.reviewed if name in reviewed else verdict.failures).append((r, name, found[name]))
        prev_start = s
    return verdict


# ----------------------------------------------------------------------------- the rows
def calibrated(target, draft, prompt, reference, mask_token_id, block_size, stepped_hidden=None):
    """(the drafter oracle's tolerances, None) or (None, why it cannot judge this drafter)."""
    try:
        return oracle.calibrate(target, draft, prompt, reference, mask_token_id, block_size, stepped_hidden), None
    except oracle.Unbindable as exc:
        return None, str(exc)
    except Exception as exc:  # a drafter the reference forward cannot drive
        return None, f"its from-scratch forward failed: {error_summary(exc)['error']}"


def judge_or_skip(drafted, target, draft, final, mask_token_id, dcal, reviewed=()):
    """The drafter oracle's verdict on one decode; a reference it cannot compute is a skip, not a pass."""
    try:
        return judge(drafted, target, draft, final, mask_token_id, dcal, tuple(reviewed or ()))
    except Exception as exc:
        return DrafterVerdict(skipped=f"its from-scratch reference failed: {error_summary(exc)['error']}")


def method_check(name: str, runs: list[dict], skipped: str | None = None) -> dict:
    """The ``drafter: METHOD`` check over a method's runs (each may hold a ``drafter`` verdict): a drafter the oracle
    cannot bind, or a reference it cannot compute, is a visible ``skip``, never a pass."""
    judged = [r for r in runs if "drafter" in r]
    skips = [r["drafter_description"] for r in judged if r["drafter"].get("skipped")]
    if skipped or (judged and len(skips) == len(judged)):
        return Check.of(f"drafter: {name}", passed=True, skipped=True,
                        evidence=f"drafter oracle: skipped ({skipped})" if skipped else skips[0]).to_json()
    errors = [r for r in runs if "error" in r]
    over = [r for r in judged if not r["drafter"]["passed"]]
    failures = {}
    if errors and not judged:
        evidence = errors[0].get("error", "failed")
    elif over:
        evidence = f"{len(over)}/{len(judged)} runs differ; prompt {over[0]['prompt']}: {over[0]['drafter_description']}"
        failures = {"failures": over[0]["drafter"]["failures"][:8]}
    elif judged:
        worst = {k: max(r["drafter"]["worst"].get(k, 0.0) for r in judged) for k in judged[0]["drafter"]["worst"]}
        top = [sum(r["drafter"]["top1"][i] for r in judged) for i in (0, 1)]
        evidence = (f"{len(judged)}/{len(judged)} runs, {sum(r['drafter']['rounds'] for r in judged)} drafter calls equal a "
                    "from-scratch drafter forward; max |Δ| " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
                    + f"; proposals {top[0]}/{top[1]}")
        reviewed = [e for r in judged for e in r["drafter"].get("reviewed") or ()]
        if reviewed:
            fields = ", ".join(sorted({e["field"] for e in reviewed}))
            evidence += (f"; reviewed deliberate difference ({fields}) in {len(reviewed)} rounds, e.g. round {reviewed[0]['round']}: "
                         f"{reviewed[0]['detail']}")
    else:
        evidence = "no run"
    return Check.of(f"drafter: {name}", **failures, passed=bool(judged) and not over and not errors, evidence=evidence).to_json()


def method_rows(loop, method, earlier: list) -> list[dict]:
    """``drafter: METHOD`` for a method with a drafter."""
    if method.kind == "target":
        return []
    runs = loop.stats[method.name].runs
    _, draft_skip = loop.dcals.get(method.drafter, (None, None))
    return [routers.inconclusive(method_check(method.name, runs, draft_skip), runs, loop.dtype, loop.f32)]


def class_row(name: str, why: str, built_here: bool) -> dict:
    """``drafter class NAME``: a class the verifier had to build (a random preset's drafter) and could not is a failure
    naming what it lacked, since the decoders' paths through that class go unverified; one a ``--draft`` folder is
    not is reported (the user chose the folder)."""
    import re

    if not built_here:
        return Check.of(f"drafter class {name}", passed=True, info=True, evidence=f"not run on this model: {why}").to_json()
    field = re.search(r"has no attribute '(\w+)'", why)
    what = (f"its code reads config.{field.group(1)}, which the verifier cannot make up for a scaled-down drafter"
            if field else why)
    return Check.of(f"drafter class {name}", passed=False, evidence=(
        f"cannot build it from a scaled-down config: {what} ({why}); the decoders are not run with it: verify it on a "
        "checkpoint whose config.json has it (--target DIR --draft DIR)")).to_json()
