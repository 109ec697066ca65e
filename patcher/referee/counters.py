"""Each serving engine's own acceptance counters, converted to one definition.

The definition. A *round* is one verification forward of the target over a draft of at least one
token. It commits the draft tokens the target accepted, then one token of the target's own: the
bonus when the whole draft holds, the correction at the first mismatch. So a decode of ``rounds``
rounds that accepted ``accepted`` draft tokens commits ``accepted + rounds`` tokens in its rounds,
and its mean tokens per round, the bonus included, is ``1 + accepted / rounds``
(:func:`tokens_per_round`): what ddpatch's reference DFlash and DDTree report per round
(``patcher/verify/reference_decode.py``, ``decode``). The token the prefill decides is in no round.

The engines count the same events under their own names and scopes (docs/engines.md has a table
per engine with the source file each definition was read from):

- llama.cpp: per request ``timings.draft_n`` and ``timings.draft_n_accepted``; the rounds only
  server-wide, in ``/metrics`` (``llamacpp:spec_decode_num_drafts_total``, on with ``--metrics``);
- vLLM: per request ``metrics.speculative_decoding`` (on with ``--per-request-spec-decode-metrics``),
  else the server-wide Prometheus counters ``vllm:spec_decode_num_*``;
- SGLang: per request ``meta_info`` (``spec_verify_ct``, the accepted drafts under a name that
  changed across versions); server-wide ``avg_spec_accept_length``, which is not per request.

Server-wide counters are read before and after one request and subtracted: exact only when nothing
else ran on the engine between the two reads, which is checked against a per-request figure where
the engine gives one. Pure functions over parsed JSON and Prometheus text; no I/O here.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any


def tokens_per_round(accepted: int, rounds: int) -> float:
    """Mean tokens committed per verification round, the bonus token included: ``1 + accepted / rounds``.

    ``accepted`` counts the draft tokens the target accepted over the decode (no bonus); ``rounds`` the
    verification forwards that had a draft. Each round adds the target's own token to what it accepted,
    hence the 1. Exact when both counts are."""
    if rounds <= 0:
        raise ValueError(f"no round to average over (rounds={rounds})")
    return 1.0 + accepted / rounds


@dataclass
class Acceptance:
    """One request's acceptance, from the engine's counters, in the one definition above.

    ``drafted``: draft tokens the engine proposed, after its own clamps (llama.cpp shortens the last
    drafts to the tokens left; SGLang's figure is nominal in most versions). ``accepted``: draft tokens
    the target accepted, the bonus excluded. ``rounds``: verification forwards with a draft;
    ``rounds_exact`` (``accepted_exact``) False when they were derived, which ``notes`` then says, and ``rounds_range``
    (``accepted_range``) the values the derivation allows: the referee judges every one of them. ``accepted_per_position``:
    item ``i`` counts the rounds that accepted at least ``i + 1`` draft tokens. ``source``: which of the
    engine's answers the counts came from."""

    drafted: int | None = None
    accepted: int | None = None
    rounds: int | None = None
    rounds_exact: bool = False
    accepted_exact: bool = True
    accepted_per_position: list[int] | None = None
    source: str = ""
    notes: list[str] = field(default_factory=list)
    #: every value a derived count may have, (lowest, highest); None where the count is exact (or absent)
    rounds_range: tuple[int, int] | None = None
    accepted_range: tuple[int, int] | None = None

    @property
    def tokens_per_round(self) -> float | None:
        if self.accepted is None or not self.rounds:
            return None
        return tokens_per_round(self.accepted, self.rounds)

    @property
    def span(self) -> tuple[int, int, int, int] | None:
        """(accepted low, accepted high, rounds low, rounds high): every value the counts may have; None without both."""
        if self.accepted is None or not self.rounds:
            return None
        a = self.accepted_range or (self.accepted, self.accepted)
        r = self.rounds_range or (self.rounds, self.rounds)
        return a[0], a[1], max(r[0], 1), max(r[1], 1)

    @property
    def exact(self) -> bool:
        """Counted, not derived: the accepted tokens and the rounds both came from the engine's counters."""
        return self.rounds_exact and self.accepted_exact and self.accepted is not None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_per_round"] = self.tokens_per_round
        out["exact"] = self.exact
        return out


@dataclass
class EngineAnswer:
    """What one greedy request to an engine gave: its tokens (``output_ids`` None when the engine gave text
    only, which ``notes`` says), why it stopped, its raw counters under the engine's own names, and the
    acceptance they convert to."""

    engine: str
    api: str
    output_ids: list[int] | None
    text: str
    finish: str | None
    prompt_tokens: int | None
    counters: dict[str, Any]
    acceptance: Acceptance
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["acceptance"] = self.acceptance.as_dict()
        return out


def per_position_from_histogram(histogram: list[int]) -> list[int]:
    """``histogram[j]`` rounds accepted exactly ``j`` drafts -> rounds that accepted at least ``i + 1``."""
    return [sum(histogram[i + 1:]) for i in range(max(len(histogram) - 1, 0))]


# ----------------------------------------------------------------------------- Prometheus text
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    text: str  # the value as printed: whether it is an exact integer depends on how it was printed

    @property
    def value(self) -> float:
        return float(self.text)


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments and blank lines skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out.append(Sample(m.group(1), labels, m.group(3)))
    return out


def exact_count(text: str) -> int | None:
    """The integer a counter printed as ``text`` holds, or None when the printing lost digits.

    llama.cpp streams its counters as C++ doubles at the default 6 significant digits: 1234567 prints
    as ``1.23457e+06``. prometheus_client (vLLM) prints every digit (``1.2345678e+07``)."""
    try:
        value = float(text)
    except ValueError:
        return None
    if value != value or value in (float("inf"), float("-inf")) or value != int(value):
        return None
    m = re.fullmatch(r"[+-]?(\d*)\.?(\d*)[eE][+-]?\d+", text)
    if m and len((m.group(1) + m.group(2)).lstrip("0")) < len(str(abs(int(value)))):
        return None  # fewer significant digits written than the integer has: the rest were rounded away
    return int(value)


def counter(samples: list[Sample], name: str, **labels: str) -> tuple[int | None, bool]:
    """(sum of the samples of counter ``name`` whose labels include ``labels``, found). The sum runs over the
    other labels (vLLM's ``engine`` per data-parallel rank); ``name`` matches with or without ``_total``."""
    names = {name, name + "_total"} if not name.endswith("_total") else {name, name[:-6]}
    total, found = 0, False
    for s in samples:
        if s.name in names and all((k, v) in s.labels for k, v in labels.items()):
            found = True
            count = exact_count(s.text)
            if count is None:
                return None, True
            total += count
    return (total if found else None), found


def per_position(samples: list[Sample], name: str) -> dict[int, int | None]:
    """A per-position counter (label ``position``), summed over its other labels."""
    positions = sorted({int(v) for s in samples if s.name in (name, name + "_total") for k, v in s.labels if k == "position"})
    return {p: counter(samples, name, position=str(p))[0] for p in positions}


def delta(before: list[Sample], after: list[Sample], name: str) -> int | None:
    """``after - before`` of one counter; None when either is missing or lost digits, or it went down (a restart)."""
    a, _ = counter(before, name)
    b, _ = counter(after, name)
    if a is None or b is None or b < a:
        return None
    return b - a


def position_delta(before: list[Sample], after: list[Sample], name: str) -> list[int] | None:
    a, b = per_position(before, name), per_position(after, name)
    if not b:
        return None
    out = []
    for p in range(max(b) + 1):
        lo, hi = a.get(p, 0), b.get(p)
        if lo is None or hi is None or hi < lo:
            return None
        out.append(hi - lo)
    return out


# ----------------------------------------------------------------------------- llama.cpp
#: llama.cpp's ``/metrics`` (tools/server/server-task.cpp, ``to_metrics``), summed over finished requests.
LLAMACPP_DRAFTS = "llamacpp:spec_decode_num_drafts_total"  # verification steps (n_draft_verif_steps)
LLAMACPP_DRAFT_TOKENS = "llamacpp:spec_decode_num_draft_tokens_total"
LLAMACPP_ACCEPTED = "llamacpp:spec_decode_num_accepted_tokens_total"
LLAMACPP_PER_POSITION = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"


def llamacpp_acceptance(timings: dict, before: list[Sample] | None = None,
                        after: list[Sample] | None = None, stopped: bool = False) -> Acceptance | None:
    """One ``/completion`` answer's ``timings`` (and ``/metrics`` read around it, if the server has ``--metrics``)
    -> its acceptance; None when ``timings`` has no ``draft_n`` (the server leaves it out when nothing was drafted).

    ``draft_n`` and ``draft_n_accepted`` are per request. The rounds are not: they are the change of
    ``llamacpp:spec_decode_num_drafts_total`` over the request, taken when the other two counters changed by
    exactly this request's ``draft_n`` and ``draft_n_accepted`` (so nothing else ran between the reads).
    Without it they are derived from ``predicted_n`` (see the note the result carries), with the range of values that
    derivation allows (``stopped``: the request ended at a stop token, which may have cut its last round short).

    Why the range. After the prefill's token each round commits its accepted drafts and one token of the target's, and a
    step with one token left has no draft (``get_n_draft_max``): ``predicted_n = 1 + accepted + rounds + plain`` with
    ``plain`` 0 or 1, so the rounds are ``predicted_n - 1 - accepted`` or one fewer. ``draft_n_accepted`` counts a
    round's accepted drafts before its tokens meet a stop token, and ``predicted_n`` stops at it: a stop may hide up to
    the last round's accepted drafts, so the rounds may then be more, by at most the accepted drafts."""
    if "draft_n" not in timings:
        return None
    drafted, accepted = int(timings["draft_n"]), int(timings.get("draft_n_accepted", 0))
    acc = Acceptance(drafted=drafted, accepted=accepted, source="timings")
    if before is not None and after is not None:
        found = counter(after, LLAMACPP_DRAFTS)[1]
        rounds = delta(before, after, LLAMACPP_DRAFTS)
        moved = (delta(before, after, LLAMACPP_DRAFT_TOKENS), delta(before, after, LLAMACPP_ACCEPTED))
        if rounds is not None and moved == (drafted, accepted):
            acc.rounds, acc.rounds_exact, acc.source = rounds, True, "timings + /metrics"
            acc.accepted_per_position = position_delta(before, after, LLAMACPP_PER_POSITION)
            return acc
        if not found:
            acc.notes.append(f"/metrics has no {LLAMACPP_DRAFTS} (a llama.cpp older than that counter)")
        elif rounds is None or None in moved:
            acc.notes.append("a /metrics counter could not be read exactly (llama.cpp prints 6 significant digits, so a"
                             " count over 999999 loses digits; or the server restarted): restart llama-server to read it")
        else:
            acc.notes.append(f"/metrics moved by {moved[0]} drafted and {moved[1]} accepted over this request, not its own"
                             f" {drafted} and {accepted}: another request ran on the server between the two reads")
    predicted = timings.get("predicted_n")
    if predicted is not None:
        acc.rounds = max(int(predicted) - 1 - accepted, 0)
        acc.rounds_range = (max(acc.rounds - 1, 0), acc.rounds + (accepted if stopped else 0))
        acc.notes.append("rounds derived as predicted_n - 1 - draft_n_accepted, not counted: one too many when the last"
                         " token came from a step without a draft (llama.cpp drafts nothing with one token left), and off"
                         " when a stop token cut the last round short; llama-server --metrics gives the count")
    return acc


# ----------------------------------------------------------------------------- vLLM
#: vLLM's Prometheus counters (vllm/v1/spec_decode/metrics.py, ``SpecDecodingProm``), labelled per engine.
VLLM_DRAFTS = "vllm:spec_decode_num_drafts"  # verification steps that had a draft
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_acceptance(response: dict, before: list[Sample] | None = None,
                    after: list[Sample] | None = None) -> Acceptance | None:
    """One ``/v1/completions`` answer (and ``/metrics`` read around it) -> its acceptance; None when neither has
    speculative-decoding counters. The answer's own ``metrics.speculative_decoding`` (vLLM started with
    ``--per-request-spec-decode-metrics``) counts this request alone; else the Prometheus deltas are taken."""
    prom = None
    if before is not None and after is not None and counter(after, VLLM_DRAFTS)[1]:
        prom = (delta(before, after, VLLM_DRAFTS), delta(before, after, VLLM_DRAFT_TOKENS),
                delta(before, after, VLLM_ACCEPTED))
    metrics = response.get("metrics")
    own = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if isinstance(own, dict) and "num_spec_steps" in own:
        acc = Acceptance(drafted=own.get("num_draft_tokens"), accepted=int(own.get("num_accepted_draft_tokens", 0)),
                         rounds=int(own["num_spec_steps"]), rounds_exact=True, source="metrics.speculative_decoding")
        if isinstance(own.get("acceptance_histogram"), list):
            acc.accepted_per_position = per_position_from_histogram([int(x) for x in own["acceptance_histogram"]])
        if prom is not None and prom != (acc.rounds, acc.drafted, acc.accepted):
            acc.notes.append(f"the server-wide /metrics moved by {prom[0]} rounds, {prom[1]} drafted, {prom[2]} accepted"
                             " over this request: another request ran on the engine meanwhile")
        return acc
    if prom is None:
        return None
    rounds, drafted, accepted = prom
    if rounds is None or accepted is None:
        return Acceptance(source="/metrics", notes=["vLLM's /metrics counters went down between the two reads (a restart)"])
    return Acceptance(drafted=drafted, accepted=accepted, rounds=rounds, rounds_exact=True, source="/metrics",
                      accepted_per_position=position_delta(before or [], after or [], VLLM_PER_POSITION),
                      notes=["server-wide counters read before and after this request: exact when it ran alone on the"
                             " engine (vllm serve --per-request-spec-decode-metrics summary counts it per request)"])


# ----------------------------------------------------------------------------- SGLang
#: The accepted draft tokens of one request in ``meta_info``, newest name first (SGLang renamed it twice).
SGLANG_ACCEPTED = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num", "spec_accepted_tokens")
SGLANG_DRAFTED = ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
SGLANG_HISTOGRAM = ("spec_correct_drafts_histogram", "spec_accept_histogram")


def sglang_acceptance(meta: dict) -> Acceptance | None:
    """One ``/generate`` answer's ``meta_info`` -> its acceptance; None without ``spec_verify_ct`` (SGLang adds the
    ``spec_*`` fields only when it runs a speculative algorithm). ``spec_verify_ct`` counts this request's
    verification forwards: the rounds, exactly."""
    if "spec_verify_ct" not in meta:
        return None
    rounds = int(meta["spec_verify_ct"])
    acc = Acceptance(rounds=rounds, rounds_exact=True, source="meta_info")
    name = next((n for n in SGLANG_ACCEPTED if n in meta), None)
    if name is not None:
        acc.accepted = int(meta[name])
    elif "completion_tokens" in meta and rounds:
        acc.accepted, acc.accepted_exact = max(int(meta["completion_tokens"]) - 1 - rounds, 0), False
        acc.notes.append("accepted derived as completion_tokens - 1 - spec_verify_ct (this SGLang reports no accepted"
                         " count): every token after the prefill's first from a round")
    drafted = next((n for n in SGLANG_DRAFTED if n in meta), None)
    if drafted is not None:
        acc.drafted = int(meta[drafted])
        acc.notes.append(f"{drafted} is spec_verify_ct x (speculative_num_draft_tokens - 1) in most SGLang versions:"
                         " the drafts' nominal size, not a count")
    hist = next((meta[n] for n in SGLANG_HISTOGRAM if isinstance(meta.get(n), list)), None)
    if hist is not None:
        acc.accepted_per_position = per_position_from_histogram([int(x) for x in hist])
    return acc


def sglang_server_accept_length(server_info: dict) -> list[float]:
    """``avg_spec_accept_length`` of each scheduler in ``/get_server_info`` (``internal_states``; older versions
    put it at the top level): accepted plus one per round over all requests since the server started, folded in
    at each decode log interval. Server-wide and not per request: reported, never converted."""
    states = server_info.get("internal_states")
    found = [s.get("avg_spec_accept_length") for s in states if isinstance(s, dict)] if isinstance(states, list) else []
    found.append(server_info.get("avg_spec_accept_length"))
    return [float(x) for x in found if isinstance(x, (int, float))]
