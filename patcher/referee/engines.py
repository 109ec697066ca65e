"""Clients for the serving engines' own APIs: one greedy request at a time, its tokens and its acceptance counters.

``connect(url)`` finds out which engine answers (:func:`detect_kind`) and returns its client;
``client.generate(prompt, max_new_tokens)`` sends one prompt, as token ids or as text, with greedy
settings (temperature 0, top-k 1, every penalty off) and returns an :class:`~.counters.EngineAnswer`;
``client.tokenize(text)`` is the engine's own tokenizer, for the caller to compare with the target's
(:func:`first_difference`). Every exchange is bounded in time and size (``http.call``). Failures are
the one-line errors of ``patcher.errors`` (``RefereeError`` and its kinds).

- llama.cpp (``llama-server``): ``/completion`` (``api="completion"``, token ids in ``tokens``) or
  ``/v1/completions`` (``api="v1"``, token ids in ``__verbose``); counters in ``timings``, rounds in
  ``/metrics`` when the server runs with ``--metrics``.
- vLLM: ``/v1/completions`` with ``return_token_ids``; counters per request in ``metrics`` (with
  ``--per-request-spec-decode-metrics``), else ``/metrics`` read before and after the request.
- SGLang: ``/generate`` with ``input_ids``; counters in ``meta_info``.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import EngineAnswerError, NoAcceptanceCounters, NotGreedy, PromptTooLong, TokenizerMismatch
from . import counters as c
from .http import GENERATE_TIMEOUT_S, MAX_ANSWER_BYTES, PROBE_TIMEOUT_S, Answer, base_url, call

LLAMACPP, VLLM, SGLANG = "llama.cpp", "vllm", "sglang"
KINDS = (LLAMACPP, VLLM, SGLANG)
#: ``/v1/models``' ``owned_by`` of each engine (llama.cpp: server-context.cpp; vLLM and SGLang: their ``ModelCard``).
OWNED_BY = {"llamacpp": LLAMACPP, "vllm": VLLM, "sglang": SGLANG}
#: How to turn speculative decoding (and its counters) on, per engine, for the error that finds it off.
TURN_ON = {
    LLAMACPP: "start llama-server with -md DRAFT.gguf --spec-type draft-dflash (and --metrics for the exact rounds)",
    VLLM: "start vllm serve with --speculative-config '{\"method\": \"dflash\", \"model\": \"DRAFT\", \"num_speculative_tokens\": K}'"
          " and without --disable-log-stats (--per-request-spec-decode-metrics summary counts per request)",
    SGLANG: "start sglang.launch_server with --speculative-algorithm DFLASH --speculative-draft-model-path DRAFT",
}
_CONTEXT = re.compile(r"context (?:length|size|window)|exceed_context_size|maximum context", re.I)


@dataclass
class EngineInfo:
    """What the engine says about itself: its model, its context length, whether it speculates (as it words it)."""

    kind: str
    url: str
    model: str | None = None
    context_length: int | None = None
    speculative: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None  # the dtype it computes in, where it says (``ties.ENGINE_DTYPES``)
    dtype_source: str | None = None  # where it said it
    quantized: str | None = None  # its weights' quantized type (a GGUF's Q4_K_M...): its greedy tokens are not the target's

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: a GGUF's file type (llama.cpp's ``/props`` ``model_ftype``, ``llama_ftype_name``) -> the dtype it computes in
GGUF_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
#: the dtype names an engine may print (vLLM's ``torch.bfloat16``, SGLang's ``bfloat16``, ``half``...)
DTYPE_NAMES = {"float32": "float32", "float": "float32", "fp32": "float32", "float16": "float16", "half": "float16",
               "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def dtype_name(value: Any) -> str | None:
    """``torch.bfloat16``, ``bf16``, ``half``... -> one of float32, float16, bfloat16; None for anything else (``auto``)."""
    if not isinstance(value, str):
        return None
    return DTYPE_NAMES.get(value.strip().lower().removeprefix("torch."))


def metrics_dtype(samples: list[c.Sample]) -> str | None:
    """A dtype some ``*_info`` gauge of ``/metrics`` carries in a ``dtype`` label (vLLM's config info gauges), if any."""
    for sample in samples:
        if sample.name.endswith("_info"):
            found = dtype_name(dict(sample.labels).get("dtype"))
            if found:
                return found
    return None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length when one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class EngineClient:
    """One engine at one address. ``timeout_s`` bounds a generation, ``probe_timeout_s`` every other request."""

    kind = ""

    def __init__(self, url: str, *, timeout_s: float = GENERATE_TIMEOUT_S, probe_timeout_s: float = PROBE_TIMEOUT_S,
                 max_bytes: int = MAX_ANSWER_BYTES, settle_s: float = 2.0):
        self.url = base_url(url)
        self.timeout_s, self.probe_timeout_s, self.max_bytes, self.settle_s = timeout_s, probe_timeout_s, max_bytes, settle_s

    # -- plumbing
    def _call(self, path: str, body: Any = None, *, generate: bool = False) -> Answer:
        return call(self.url, path, body, timeout_s=self.timeout_s if generate else self.probe_timeout_s,
                    max_bytes=self.max_bytes)

    def _ok(self, answer: Answer, what: str) -> Any:
        """The answer's JSON, or the one-line error its status means."""
        if answer.status == 200:
            return answer.json()
        message = answer.error_message()
        if answer.status in (400, 413, 422) and _CONTEXT.search(message + answer.text()[:2000]):
            raise PromptTooLong(f"{self.kind} at {self.url} refused {what}: {message}")
        if answer.status == 404:
            raise EngineAnswerError(f"{answer.where} does not exist (HTTP 404): is a {self.kind} server at {self.url}?")
        raise EngineAnswerError(f"{answer.where} answered HTTP {answer.status}: {message}")

    def _metrics(self) -> list[c.Sample] | None:
        answer = self._call("/metrics")
        return c.parse_prometheus(answer.text()) if answer.status == 200 else None

    def _settled_metrics(self, name: str, before: list[c.Sample] | None) -> list[c.Sample] | None:
        """``/metrics`` after a request, once ``name`` stops moving: an engine may publish the last step's counts
        just after it answers (vLLM records them after handing the output over)."""
        after = self._metrics()
        if after is None or before is None:
            return after
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
            again = self._metrics()
            if again is None or c.counter(again, name)[0] == c.counter(after, name)[0]:
                return after if again is None else again
            after = again
        return after

    def check_tokenizer(self, text: str, target_ids: list[int]) -> None:
        """Raise :class:`TokenizerMismatch` when the engine splits ``text`` differently from ``target_ids``
        (the target's tokenizer on the same text, no special tokens added)."""
        engine_ids = self.tokenize(text)
        at = first_difference(engine_ids, list(target_ids))
        if at is not None:
            mine = engine_ids[at] if at < len(engine_ids) else "(end)"
            theirs = target_ids[at] if at < len(target_ids) else "(end)"
            raise TokenizerMismatch(f"{self.kind} at {self.url} tokenizes the probe text differently from the target's"
                                    f" tokenizer at token {at} ({mine} against {theirs}): is it serving this --target?")

    def info(self) -> EngineInfo:
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def generate(self, prompt: list[int] | str, max_new_tokens: int, *, ignore_eos: bool = False) -> c.EngineAnswer:
        raise NotImplementedError


def _ids(value: Any) -> list[int] | None:
    return [int(t) for t in value] if isinstance(value, list) and all(isinstance(t, int) for t in value) else None


def _no_counters(kind: str, url: str, why: str) -> NoAcceptanceCounters:
    return NoAcceptanceCounters(f"{kind} at {url} reported no acceptance counters ({why}): {TURN_ON[kind]}")


# ----------------------------------------------------------------------------- llama.cpp
def llamacpp_sampling_problems(settings: dict) -> list[str]:
    """What, in a ``generation_settings`` echo, keeps llama.cpp from the target's greedy choice."""
    problems = []
    temp, top_k = settings.get("temperature"), settings.get("top_k")
    if isinstance(temp, (int, float)) and temp > 0 and top_k != 1:
        problems.append(f"temperature {temp:g} with top_k {top_k}")
    if settings.get("repeat_penalty", 1.0) != 1.0 and settings.get("repeat_last_n", 0) != 0:
        problems.append(f"repeat_penalty {settings['repeat_penalty']:g}")
    for name in ("presence_penalty", "frequency_penalty", "dry_multiplier", "mirostat"):
        if settings.get(name, 0) not in (0, 0.0):
            problems.append(f"{name} {settings[name]}")
    if settings.get("grammar"):
        problems.append("a grammar")
    return problems


class LlamaCppClient(EngineClient):
    kind = LLAMACPP

    def __init__(self, url: str, *, api: str = "completion", **kwargs):
        super().__init__(url, **kwargs)
        if api not in ("completion", "v1"):
            raise ValueError(f"llama.cpp api is 'completion' or 'v1', not {api!r}")
        self.api = api
        self._has_metrics: bool | None = None

    def info(self) -> EngineInfo:
        """``/props`` (its ``speculative.types`` is the sampling defaults', "none" even on a speculating server), and
        ``/slots``, whose ``speculative`` says whether a slot has a drafter (llama-server --no-slots turns it off)."""
        props = self._ok(self._call("/props"), "/props")
        settings = props.get("default_generation_settings") or {}
        self._has_metrics = props.get("endpoint_metrics")
        slots = self._call("/slots")
        listed = slots.json() if slots.status == 200 else None
        speculating = [s.get("speculative") for s in listed if isinstance(s, dict)] if isinstance(listed, list) else []
        ftype = str(props.get("model_ftype") or "")
        dtype = GGUF_DTYPES.get(ftype.upper().split(" ")[0]) if ftype else None
        return EngineInfo(LLAMACPP, self.url, model=props.get("model_alias") or props.get("model_path"),
                          context_length=settings.get("n_ctx"),
                          speculative=("on" if any(speculating) else "off") if speculating else None,
                          details={"build_info": props.get("build_info"), "endpoint_metrics": props.get("endpoint_metrics"),
                                   "model_ftype": ftype or None},
                          dtype=dtype, dtype_source="/props model_ftype" if dtype else None,
                          quantized=ftype if ftype and dtype is None else None)

    def tokenize(self, text: str) -> list[int]:
        data = self._ok(self._call("/tokenize", {"content": text, "add_special": False}), "/tokenize")
        ids = _ids(data.get("tokens"))
        if ids is None:
            raise EngineAnswerError(f"{self.url}/tokenize answered without a list of token ids")
        return ids

    def generate(self, prompt: list[int] | str, max_new_tokens: int, *, ignore_eos: bool = False) -> c.EngineAnswer:
        greedy = {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "repeat_last_n": 0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "mirostat": 0,
                  "cache_prompt": False, "return_tokens": True, "stream": False, "ignore_eos": ignore_eos}
        before = self._metrics() if self._has_metrics is not False else None
        self._has_metrics = before is not None
        if self.api == "completion":
            path, body = "/completion", {"prompt": prompt, "n_predict": max_new_tokens, **greedy}
        else:
            path, body = "/v1/completions", {"prompt": prompt, "max_tokens": max_new_tokens, "verbose": True, **greedy}
        data = self._ok(self._call(path, body, generate=True), "the prompt")
        after = self._metrics() if before is not None else None
        full = data if self.api == "completion" else (data.get("__verbose") or {})
        settings = full.get("generation_settings") or {}
        problems = llamacpp_sampling_problems(settings)
        if problems:
            raise NotGreedy(f"llama.cpp at {self.url} decoded with {', '.join(problems)}: not greedy")
        timings = data.get("timings") or full.get("timings")
        if not isinstance(timings, dict):
            raise EngineAnswerError(f"{self.url}{path} answered without timings")
        stopped = (data.get("stop_type") if self.api == "completion" else (data.get("choices") or [{}])[0].get("finish_reason")) \
            not in ("limit", "length", None)
        acceptance = c.llamacpp_acceptance(timings, before, after, stopped=stopped)
        if acceptance is None:
            types = settings.get("speculative.types")
            why = (f"speculative decoding is off (speculative.types {types!r})" if types in ("none", "", None)
                   else "timings has no draft_n: nothing was drafted for this prompt")
            raise _no_counters(LLAMACPP, self.url, why)
        notes = [] if self._has_metrics else ["llama-server runs without --metrics: the rounds are derived"]
        ids = _ids(full.get("tokens"))
        if self.api == "completion":
            text, finish = data.get("content", ""), data.get("stop_type")
        else:
            choice = (data.get("choices") or [{}])[0]
            text, finish = choice.get("text", ""), choice.get("finish_reason")
        if not ids:
            ids = None
            notes.append("this llama.cpp returned no token ids (return_tokens): text only")
        raw = {k: timings[k] for k in ("draft_n", "draft_n_accepted", "predicted_n", "prompt_n", "cache_n") if k in timings}
        if after is not None:
            raw.update({name: c.counter(after, name)[0] for name in (c.LLAMACPP_DRAFTS, c.LLAMACPP_DRAFT_TOKENS, c.LLAMACPP_ACCEPTED)})
        return c.EngineAnswer(LLAMACPP, path, ids, text, finish, full.get("tokens_evaluated"), raw, acceptance, notes)


# ----------------------------------------------------------------------------- vLLM
class VllmClient(EngineClient):
    kind = VLLM

    def __init__(self, url: str, **kwargs):
        super().__init__(url, **kwargs)
        self._model: str | None = None

    def _models(self) -> list[dict]:
        data = self._ok(self._call("/v1/models"), "/v1/models").get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict):
            raise EngineAnswerError(f"{self.url}/v1/models lists no model")
        return data

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = str(self._models()[0].get("id"))
        return self._model

    def info(self) -> EngineInfo:
        card = self._models()[0]
        self._model = str(card.get("id"))
        version = self._call("/version")
        metrics = self._metrics()
        dtype = metrics_dtype(metrics) if metrics else None
        return EngineInfo(VLLM, self.url, model=self._model, context_length=card.get("max_model_len"),
                          details={"version": version.json().get("version") if version.status == 200 else None},
                          dtype=dtype, dtype_source="/metrics" if dtype else None)

    def tokenize(self, text: str) -> list[int]:
        data = self._ok(self._call("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False}), "/tokenize")
        ids = _ids(data.get("tokens"))
        if ids is None:
            raise EngineAnswerError(f"{self.url}/tokenize answered without a list of token ids")
        return ids

    def generate(self, prompt: list[int] | str, max_new_tokens: int, *, ignore_eos: bool = False) -> c.EngineAnswer:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.0, "top_p": 1.0,
                "top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "n": 1, "stream": False, "ignore_eos": ignore_eos, "return_token_ids": True}
        before = self._metrics()
        data = self._ok(self._call("/v1/completions", body, generate=True), "the prompt")
        per_request = isinstance(data.get("metrics"), dict) and isinstance(data["metrics"].get("speculative_decoding"), dict)
        after = self._metrics() if per_request else self._settled_metrics(c.VLLM_DRAFTS, before)
        acceptance = c.vllm_acceptance(data, before, after)
        if acceptance is None:
            raise _no_counters(VLLM, self.url, "no metrics.speculative_decoding in the answer, no vllm:spec_decode_num_drafts in /metrics")
        choice = (data.get("choices") or [{}])[0]
        ids = _ids(choice.get("token_ids"))
        notes = [] if ids is not None else ["this vLLM returned no token ids (return_token_ids): text only"]
        usage = data.get("usage") or {}
        raw: dict[str, Any] = dict(data["metrics"]["speculative_decoding"]) if per_request else {}
        if after is not None:
            raw.update({name: c.counter(after, name)[0] for name in (c.VLLM_DRAFTS, c.VLLM_DRAFT_TOKENS, c.VLLM_ACCEPTED)})
        return c.EngineAnswer(VLLM, "/v1/completions", ids, choice.get("text", ""), choice.get("finish_reason"),
                              usage.get("prompt_tokens"), raw, acceptance, notes)


# ----------------------------------------------------------------------------- SGLang
class SglangClient(EngineClient):
    kind = SGLANG

    def info(self) -> EngineInfo:
        server = self._ok(self._call("/get_server_info"), "/get_server_info")
        model = self._call("/get_model_info")
        model_info = model.json() if model.status == 200 else {}
        dtype = dtype_name(server.get("dtype"))
        return EngineInfo(SGLANG, self.url, model=model_info.get("model_path") or server.get("model_path"),
                          dtype=dtype, dtype_source="/get_server_info dtype" if dtype else None,
                          context_length=server.get("context_length"), speculative=server.get("speculative_algorithm"),
                          details={"version": server.get("version"),
                                   "speculative_num_draft_tokens": server.get("speculative_num_draft_tokens"),
                                   "avg_spec_accept_length": c.sglang_server_accept_length(server)})

    def tokenize(self, text: str) -> list[int]:
        data = self._ok(self._call("/tokenize", {"prompt": text, "add_special_tokens": False}), "/tokenize")
        ids = _ids(data.get("tokens"))
        if ids is None:
            raise EngineAnswerError(f"{self.url}/tokenize answered without a list of token ids")
        return ids

    def generate(self, prompt: list[int] | str, max_new_tokens: int, *, ignore_eos: bool = False) -> c.EngineAnswer:
        sampling = {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "max_new_tokens": max_new_tokens,
                    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": ignore_eos}
        body = {("input_ids" if isinstance(prompt, list) else "text"): prompt, "sampling_params": sampling, "stream": False}
        data = self._ok(self._call("/generate", body, generate=True), "the prompt")
        if isinstance(data, list):  # a batch of one
            data = data[0] if data else {}
        meta = data.get("meta_info") if isinstance(data, dict) else None
        if not isinstance(meta, dict):
            raise EngineAnswerError(f"{self.url}/generate answered without meta_info")
        acceptance = c.sglang_acceptance(meta)
        if acceptance is None:
            raise _no_counters(SGLANG, self.url, "meta_info has no spec_verify_ct")
        ids = _ids(data.get("output_ids"))
        notes = [] if ids is not None else ["this SGLang returned no output_ids: text only"]
        finish = meta.get("finish_reason")
        raw = {k: v for k, v in meta.items() if k.startswith("spec_") or k in ("completion_tokens", "prompt_tokens")}
        return c.EngineAnswer(SGLANG, "/generate", ids, data.get("text") or "",
                              finish.get("type") if isinstance(finish, dict) else finish,
                              meta.get("prompt_tokens"), raw, acceptance, notes)


CLIENTS = {LLAMACPP: LlamaCppClient, VLLM: VllmClient, SGLANG: SglangClient}


def detect_kind(url: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Which engine answers at ``url``: ``/v1/models``' ``owned_by`` (all three serve it), else llama.cpp's
    ``/props`` or SGLang's ``/get_model_info``. An address with nothing listening raises ``EngineUnreachable``."""
    base = base_url(url)
    seen = []
    models = call(base, "/v1/models", timeout_s=timeout_s)
    if models.status == 200:
        try:
            data = models.json().get("data") or []
        except (EngineAnswerError, AttributeError):
            data = []
        owners = {str(m.get("owned_by")) for m in data if isinstance(m, dict)}
        for owner, kind in OWNED_BY.items():
            if owner in owners:
                return kind
        seen.append(f"/v1/models owned_by {sorted(owners)}")
    props = call(base, "/props", timeout_s=timeout_s)
    if props.status == 200 and b"default_generation_settings" in props.body:
        return LLAMACPP
    info = call(base, "/get_model_info", timeout_s=timeout_s)
    if info.status == 200 and b"model_path" in info.body:
        return SGLANG
    seen.append(f"/props HTTP {props.status}, /get_model_info HTTP {info.status}")
    raise EngineAnswerError(f"cannot tell which engine answers at {base} ({'; '.join(seen)}): name its kind"
                            f" ({', '.join(KINDS)})")


def connect(url: str, kind: str | None = None, **kwargs) -> EngineClient:
    """The client for the engine at ``url``: of ``kind`` if given (llama.cpp's ``api`` goes in ``kwargs``), else the
    kind :func:`detect_kind` finds."""
    if kind is None:
        kind = detect_kind(url, timeout_s=kwargs.get("probe_timeout_s", PROBE_TIMEOUT_S))
    key = {"llamacpp": LLAMACPP, "llama-cpp": LLAMACPP}.get(kind.lower(), kind.lower())
    if key not in CLIENTS:
        raise EngineAnswerError(f"unknown engine kind {kind!r}: one of {', '.join(KINDS)}")
    if key != LLAMACPP:
        kwargs.pop("api", None)
    return CLIENTS[key](url, **kwargs)
