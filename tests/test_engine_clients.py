"""The serving engines' clients and counters (``patcher/referee/``) on recorded answers.

The answers in tests/data/engines/ are built from each engine's documented formats and sources
(docs/engines.md names them): llama.cpp's ``/completion`` and ``/metrics``, vLLM's ``/v1/completions``
with ``metrics.speculative_decoding`` and its Prometheus text, SGLang's ``/generate`` ``meta_info``
under its three generations of field names. A tiny HTTP server on 127.0.0.1 replays them, so every
client runs its real HTTP path; the server is stopped in every outcome (a ``with`` block).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from patcher.errors import (EngineAnswerError, EngineUnreachable, NoAcceptanceCounters, NotGreedy, PromptTooLong,
                            RefereeError, TokenizerMismatch)
from patcher.referee import counters as c
from patcher.referee import engines
from patcher.referee.http import call

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "engines"
PROMPT = [151644, 872, 198, 3838, 374, 264, 7598, 30]


def recorded(name: str) -> bytes:
    return (DATA / name).read_bytes()


def js(name: str) -> dict:
    return json.loads(recorded(name))


class Replay:
    """An HTTP server on 127.0.0.1 that answers ``(method, path)`` with recorded answers, in turn (the last one
    repeats); ``"hang"`` holds the request until the server stops, ``"drip"`` answers a byte every 0.1 s. It keeps what each request sent."""

    def __init__(self, routes: dict):
        self.routes = {k: list(v) if isinstance(v, list) else [v] for k, v in routes.items()}
        self.requests: list[tuple[str, str, object]] = []
        self.release = threading.Event()

    def __enter__(self) -> Replay:
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method):
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size)) if size else None
                replay.requests.append((method, self.path, body))
                queue = replay.routes.get((method, self.path))
                if not queue:
                    status, data = 404, b'{"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}'
                else:
                    reply = queue.pop(0) if len(queue) > 1 else queue[0]
                    if reply == "hang":
                        replay.release.wait(10)
                        return
                    if reply == "drip":  # headers at once, then a byte every 0.1 s: each read is quick, the whole is not
                        self.send_response(200)
                        self.send_header("Content-Length", "30")
                        self.end_headers()
                        for _ in range(30):
                            if replay.release.wait(0.1):
                                return
                            self.wfile.write(b" ")
                            self.wfile.flush()
                        return
                    status, data = reply if isinstance(reply, tuple) else (200, reply)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that gave up on a held request: its broken pipe is the point of that test

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def sent(self, path: str) -> list:
        return [body for _, p, body in self.requests if p == path]


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text and isinstance(exc, RefereeError) and exc.exit_code == 2
    return text


LLAMA = {("GET", "/v1/models"): recorded("llamacpp/v1_models.json"), ("GET", "/props"): recorded("llamacpp/props.json"),
         ("GET", "/slots"): recorded("llamacpp/slots.json"),
         ("GET", "/metrics"): [recorded("llamacpp/metrics_before.txt"), recorded("llamacpp/metrics_after.txt")],
         ("POST", "/completion"): recorded("llamacpp/completion.json"),
         ("POST", "/v1/completions"): recorded("llamacpp/v1_completions.json"),
         ("POST", "/tokenize"): recorded("llamacpp/tokenize.json")}
VLLM = {("GET", "/v1/models"): recorded("vllm/v1_models.json"), ("GET", "/version"): recorded("vllm/version.json"),
        ("GET", "/metrics"): [recorded("vllm/metrics_before.txt"), recorded("vllm/metrics_after.txt")],
        ("POST", "/v1/completions"): recorded("vllm/completions.json"), ("POST", "/tokenize"): recorded("vllm/tokenize.json")}
SGLANG = {("GET", "/v1/models"): recorded("sglang/v1_models.json"), ("GET", "/get_model_info"): recorded("sglang/get_model_info.json"),
          ("GET", "/get_server_info"): recorded("sglang/get_server_info.json"),
          ("POST", "/generate"): recorded("sglang/generate.json"), ("POST", "/tokenize"): recorded("sglang/tokenize.json")}


# ----------------------------------------------------------------------------- the definition
def test_tokens_per_round_counts_the_bonus_token_once_per_round():
    assert c.tokens_per_round(49, 14) == 4.5  # 49 accepted drafts + 14 target tokens over 14 rounds
    assert c.tokens_per_round(0, 5) == 1.0  # nothing accepted: the target's own token each round
    with pytest.raises(ValueError):
        c.tokens_per_round(3, 0)
    assert c.Acceptance(accepted=3, rounds=0).tokens_per_round is None


def test_the_recorded_answers_keep_each_engines_own_bookkeeping():
    """The fixtures are consistent the way each engine's code makes them: a broken fixture would test nothing."""
    t = js("llamacpp/completion.json")["timings"]
    assert t["predicted_n"] == 1 + t["draft_n_accepted"] + 14  # the prefill's token, then accepted + 1 per round
    before, after = (c.parse_prometheus(recorded(f"llamacpp/metrics_{n}.txt").decode()) for n in ("before", "after"))
    assert sum(c.position_delta(before, after, c.LLAMACPP_PER_POSITION)) == t["draft_n_accepted"]
    sd = js("vllm/completions.json")["metrics"]["speculative_decoding"]
    assert sum(sd["acceptance_histogram"]) == sd["num_spec_steps"]
    assert sum(j * n for j, n in enumerate(sd["acceptance_histogram"])) == sd["num_accepted_draft_tokens"]
    meta = js("sglang/generate.json")["meta_info"]
    assert meta["completion_tokens"] == 1 + meta["spec_num_correct_drafts"] + meta["spec_verify_ct"]
    assert meta["spec_accept_length"] == meta["completion_tokens"] / meta["spec_verify_ct"]  # SGLang's own definition


def test_prometheus_counts_are_exact_only_as_printed():
    assert c.exact_count("690") == 690 and c.exact_count("52.0") == 52
    assert c.exact_count("1.2345678e+07") == 12345678  # prometheus_client (vLLM) prints every digit
    assert c.exact_count("1.23457e+06") is None  # llama.cpp's C++ stream: 6 significant digits
    assert c.exact_count("1e+06") is None and c.exact_count("3.5") is None and c.exact_count("NaN") is None
    samples = c.parse_prometheus(recorded("vllm/metrics_after.txt").decode())
    assert c.counter(samples, c.VLLM_DRAFTS) == (52, True)  # the _total sample, not the _created gauge
    assert c.counter(samples, "vllm:no_such_counter") == (None, False)


# ----------------------------------------------------------------------------- llama.cpp
def test_llamacpp_completion_gives_its_tokens_and_exact_rounds_from_metrics():
    with Replay(LLAMA) as r:
        client = engines.connect(r.url)
        assert isinstance(client, engines.LlamaCppClient)
        answer = client.generate(PROMPT, 64)
    assert answer.engine == "llama.cpp" and answer.api == "/completion" and answer.finish == "limit"
    assert answer.output_ids == js("llamacpp/completion.json")["tokens"]
    acc = answer.acceptance
    assert (acc.drafted, acc.accepted, acc.rounds, acc.exact) == (88, 49, 14, True)
    assert acc.tokens_per_round == 4.5 and acc.source == "timings + /metrics"
    assert acc.accepted_per_position == [13, 10, 8, 6, 5, 4, 3]
    assert answer.counters["draft_n"] == 88 and answer.counters[c.LLAMACPP_DRAFTS] == 114
    plain = json.loads(json.dumps(answer.as_dict()))  # what --format json prints
    assert plain["acceptance"]["tokens_per_round"] == 4.5 and plain["acceptance"]["exact"] is True
    sent = r.sent("/completion")[0]
    assert sent["prompt"] == PROMPT and sent["n_predict"] == 64 and sent["temperature"] == 0.0 and sent["top_k"] == 1
    assert sent["cache_prompt"] is False and sent["return_tokens"] is True and sent["repeat_penalty"] == 1.0


def test_llamacpp_openai_api_reads_the_tokens_from_its_verbose_answer():
    with Replay(LLAMA) as r:
        answer = engines.connect(r.url, "llama.cpp", api="v1").generate(PROMPT, 64)
    assert answer.api == "/v1/completions" and answer.finish == "length"
    assert answer.output_ids == js("llamacpp/completion.json")["tokens"]
    assert answer.acceptance.tokens_per_round == 4.5 and answer.acceptance.exact
    assert r.sent("/v1/completions")[0]["max_tokens"] == 64 and r.sent("/v1/completions")[0]["verbose"] is True


def test_llamacpp_recorded_from_a_real_server_agrees_with_its_own_log():
    """tests/data/engines/llamacpp/live/: one exchange with llama-server (built from llama-cpp-python 0.3.36's
    vendor/llama.cpp, the shipped trained pair converted, llama-server --metrics, drafts of 7) as it answered.
    Its own log line for the request says "mean len = 6.30", which is 1 + accepted / verification steps."""
    live = {("GET", "/v1/models"): recorded("llamacpp/live/v1_models.json"), ("GET", "/props"): recorded("llamacpp/live/props.json"),
            ("GET", "/slots"): recorded("llamacpp/live/slots.json"),
            ("GET", "/metrics"): [recorded("llamacpp/live/metrics_before.txt"), recorded("llamacpp/live/metrics_after.txt")],
            ("POST", "/completion"): recorded("llamacpp/live/completion.json")}
    prompt = js("llamacpp/live/prompt.json")["prompt"]
    with Replay(live) as r:
        client = engines.connect(r.url)
        info = client.info()
        answer = client.generate(prompt, 64)
    assert (info.speculative, info.context_length) == ("on", 1024)  # /props alone says speculative.types "none"
    acc = answer.acceptance
    assert (acc.drafted, acc.accepted, acc.rounds, acc.exact) == (67, 53, 10, True)
    assert acc.drafted < 7 * acc.rounds  # the last drafts were cut to the tokens left
    logged = [float(line.rsplit("mean len =", 1)[1]) for line in recorded("llamacpp/live/server_log.txt").decode().splitlines()]
    assert logged and all(round(acc.tokens_per_round, 2) == value for value in logged)
    assert answer.counters["predicted_n"] == 1 + acc.accepted + acc.rounds  # so the derived count agrees here
    assert len(answer.output_ids) == 64 and acc.accepted_per_position == [10, 9, 9, 8, 6, 6, 5]


@pytest.mark.parametrize("before, after, why", [
    (None, "llamacpp/metrics_disabled.json", "without --metrics"),
    ("llamacpp/metrics_before.txt", "llamacpp/metrics_after_busy.txt", "another request ran"),
    ("llamacpp/metrics_big_before.txt", "llamacpp/metrics_big_after.txt", "6 significant digits"),
], ids=["no-metrics", "busy", "over-a-million"])
def test_llamacpp_rounds_are_derived_and_say_so_when_metrics_cannot_count_them(before, after, why):
    metrics = (501, recorded(after)) if before is None else [recorded(before), recorded(after)]
    with Replay({**LLAMA, ("GET", "/metrics"): metrics}) as r:
        answer = engines.connect(r.url).generate(PROMPT, 64)
    acc = answer.acceptance
    assert acc.rounds == 64 - 1 - 49 and not acc.rounds_exact and not acc.exact
    assert any(why in note for note in acc.notes + answer.notes), acc.notes + answer.notes
    assert any("derived" in note for note in acc.notes)
    assert acc.rounds_range == (13, 14) and acc.span == (49, 49, 13, 14)  # a plain last step: one round fewer


def test_llamacpp_rounds_derived_after_a_stop_token_may_be_more_by_the_accepted_drafts():
    from patcher.referee.counters import llamacpp_acceptance

    acc = llamacpp_acceptance({"draft_n": 30, "draft_n_accepted": 20, "predicted_n": 25}, stopped=True)
    assert acc.rounds == 4 and acc.rounds_range == (3, 24)  # a stop may hide up to the last round's accepted drafts


@pytest.mark.parametrize("ftype, dtype, quantized", [("F32", "float32", None), ("BF16", "bfloat16", None),
                                                      ("F16", "float16", None), ("Q4_K - Medium", None, "Q4_K - Medium")])
def test_the_engines_dtype_is_read_where_it_says(ftype, dtype, quantized):
    props = js("llamacpp/props.json")
    props["model_ftype"] = ftype
    with Replay({**LLAMA, ("GET", "/props"): json.dumps(props).encode()}) as r:
        info = engines.connect(r.url).info()
    assert (info.dtype, info.quantized) == (dtype, quantized)
    assert info.dtype_source == ("/props model_ftype" if dtype else None)
    labelled = recorded("vllm/metrics_after.txt") + b'vllm:model_config_info{dtype="torch.bfloat16",engine="0"} 1.0\n'
    with Replay({**VLLM, ("GET", "/metrics"): labelled}) as r:
        assert engines.connect(r.url).info().dtype == "bfloat16"
    with Replay(VLLM) as r:
        assert engines.connect(r.url).info().dtype is None  # it does not say: --engine-dtype does
    assert engines.dtype_name("torch.float16") == "float16" and engines.dtype_name("auto") is None


def test_llamacpp_without_speculative_decoding_says_how_to_turn_it_on():
    with Replay({**LLAMA, ("POST", "/completion"): recorded("llamacpp/completion_no_spec.json")}) as r:
        with pytest.raises(NoAcceptanceCounters) as exc:
            engines.connect(r.url).generate(PROMPT, 64)
    text = one_line(exc.value)
    assert "speculative decoding is off" in text and "--spec-type draft-dflash" in text and r.url in text


def test_llamacpp_non_greedy_answer_is_refused():
    with Replay({**LLAMA, ("POST", "/completion"): recorded("llamacpp/completion_hot.json")}) as r:
        with pytest.raises(NotGreedy) as exc:
            engines.connect(r.url).generate(PROMPT, 64)
    assert "temperature 0.8 with top_k 40" in one_line(exc.value) and "repeat_penalty 1.1" in str(exc.value)


def test_a_prompt_over_the_context_is_one_line():
    cases = [(LLAMA, ("POST", "/completion"), "llamacpp/error_context.json"),
             (VLLM, ("POST", "/v1/completions"), "vllm/error_context.json"),
             (SGLANG, ("POST", "/generate"), "sglang/error_context.json")]
    for routes, key, fixture in cases:
        with Replay({**routes, key: (400, recorded(fixture))}) as r:
            with pytest.raises(PromptTooLong) as exc:
                engines.connect(r.url).generate(PROMPT * 700, 64)
        assert "context" in one_line(exc.value), exc.value


# ----------------------------------------------------------------------------- vLLM
def test_vllm_counts_per_request_when_the_answer_carries_its_metrics():
    with Replay(VLLM) as r:
        client = engines.connect(r.url)
        assert isinstance(client, engines.VllmClient)
        answer = client.generate(PROMPT, 64)
        info = client.info()
    acc = answer.acceptance
    assert (acc.rounds, acc.accepted, acc.drafted, acc.exact) == (12, 51, 84, True)
    assert acc.tokens_per_round == 5.25 and acc.source == "metrics.speculative_decoding" and not acc.notes
    assert acc.accepted_per_position == [11, 10, 10, 8, 6, 4, 2]
    assert answer.output_ids == js("vllm/completions.json")["choices"][0]["token_ids"] and answer.prompt_tokens == 8
    sent = r.sent("/v1/completions")[0]
    assert sent["model"] == "/models/target" and sent["prompt"] == PROMPT and sent["temperature"] == 0.0
    assert sent["return_token_ids"] is True and sent["max_tokens"] == 64 and sent["repetition_penalty"] == 1.0
    assert (info.model, info.context_length, info.details["version"]) == ("/models/target", 4096, "0.32.0")


def test_vllm_without_per_request_metrics_takes_the_prometheus_deltas():
    routes = {**VLLM, ("POST", "/v1/completions"): recorded("vllm/completions_plain.json")}
    with Replay(routes) as r:
        answer = engines.VllmClient(r.url, settle_s=0.3).generate(PROMPT, 64)
    acc = answer.acceptance
    assert (acc.rounds, acc.accepted, acc.drafted, acc.source) == (12, 51, 84, "/metrics")
    assert acc.tokens_per_round == 5.25 and acc.accepted_per_position == [11, 10, 10, 8, 6, 4, 2]
    assert any("ran alone" in note for note in acc.notes)
    assert len([p for _, p, _ in r.requests if p == "/metrics"]) >= 3  # before, after, and once more to see it settled


def test_vllm_without_spec_decode_counters_says_how_to_turn_them_on():
    routes = {**VLLM, ("POST", "/v1/completions"): recorded("vllm/completions_plain.json"),
              ("GET", "/metrics"): recorded("vllm/metrics_no_spec.txt")}
    with Replay(routes) as r:
        with pytest.raises(NoAcceptanceCounters) as exc:
            engines.VllmClient(r.url, settle_s=0.2).generate(PROMPT, 64)
    assert "--speculative-config" in one_line(exc.value) and "--disable-log-stats" in str(exc.value)


def test_a_tokenizer_that_splits_the_probe_differently_is_named_at_its_first_token():
    with Replay(VLLM) as r:
        client = engines.connect(r.url)
        assert client.tokenize("What is a drafter?") == [3838, 374, 264, 7598, 30]
        client.check_tokenizer("What is a drafter?", [3838, 374, 264, 7598, 30])  # the same split: no error
        with pytest.raises(TokenizerMismatch) as exc:
            client.check_tokenizer("What is a drafter?", [3838, 374, 264, 75, 98, 30])
    assert "at token 3 (7598 against 75)" in one_line(exc.value)
    assert r.sent("/tokenize")[0] == {"model": "/models/target", "prompt": "What is a drafter?", "add_special_tokens": False}
    assert engines.first_difference([1, 2], [1, 2, 3]) == 2 and engines.first_difference([1], [1]) is None


# ----------------------------------------------------------------------------- SGLang
@pytest.mark.parametrize("fixture, exact", [("generate", True), ("generate_old", True), ("generate_verify_only", False)])
def test_sglang_meta_info_under_each_generation_of_names(fixture, exact):
    with Replay({**SGLANG, ("POST", "/generate"): recorded(f"sglang/{fixture}.json")}) as r:
        client = engines.connect(r.url)
        assert isinstance(client, engines.SglangClient)
        answer = client.generate(PROMPT, 64)
    acc = answer.acceptance
    assert (acc.rounds, acc.accepted, acc.rounds_exact, acc.exact) == (14, 49, True, exact)
    # ours: 1 + 49/14; SGLang's own spec_accept_length, completion_tokens / spec_verify_ct, counts the prefill's token too
    assert acc.tokens_per_round == 4.5 and answer.counters.get("spec_accept_length", 64 / 14) == pytest.approx(4.5714, abs=1e-4)
    assert answer.output_ids == js(f"sglang/{fixture}.json")["output_ids"] and answer.finish == "length"
    sent = r.sent("/generate")[0]
    assert sent["input_ids"] == PROMPT and sent["sampling_params"]["temperature"] == 0.0
    assert sent["sampling_params"]["max_new_tokens"] == 64 and sent["sampling_params"]["top_k"] == 1


def test_sglang_without_a_speculative_algorithm_says_how_to_turn_it_on():
    with Replay({**SGLANG, ("POST", "/generate"): recorded("sglang/generate_no_spec.json")}) as r:
        with pytest.raises(NoAcceptanceCounters) as exc:
            engines.connect(r.url).generate("What is a drafter?", 64)
        assert r.sent("/generate")[0]["text"] == "What is a drafter?"  # text where no token ids are given
    assert "--speculative-algorithm DFLASH" in one_line(exc.value)


def test_sglang_server_wide_accept_length_is_reported_not_converted():
    with Replay(SGLANG) as r:
        info = engines.connect(r.url).info()
    assert info.speculative == "DFLASH" and info.context_length == 4096
    assert info.details["avg_spec_accept_length"] == [4.61] and info.details["speculative_num_draft_tokens"] == 8


# ----------------------------------------------------------------------------- detection and failures
def test_the_engine_kind_is_found_from_its_own_answers():
    props_only = {("GET", "/props"): recorded("llamacpp/props.json")}
    model_info_only = {("GET", "/get_model_info"): recorded("sglang/get_model_info.json")}
    for routes, kind in [(LLAMA, "llama.cpp"), (VLLM, "vllm"), (SGLANG, "sglang"), (props_only, "llama.cpp"),
                         (model_info_only, "sglang")]:
        with Replay(routes) as r:
            assert engines.detect_kind(r.url + "/v1/") == kind
    with Replay({("GET", "/v1/models"): b'{"data": [{"id": "m", "owned_by": "someone"}]}'}) as r:
        with pytest.raises(EngineAnswerError) as exc:
            engines.detect_kind(r.url)
    assert "cannot tell which engine" in one_line(exc.value) and "someone" in str(exc.value)
    with pytest.raises(EngineAnswerError):
        engines.connect("http://127.0.0.1:1", "tgi")


def test_an_engine_that_does_not_answer_is_one_line_and_nothing_is_left_running():
    with Replay(LLAMA) as r:
        url = r.url
        thread = r.thread
    assert not thread.is_alive()  # stopped on the way out of the with block
    with pytest.raises(EngineUnreachable) as exc:
        engines.detect_kind(url)
    assert "connection refused" in one_line(exc.value)
    with Replay({**LLAMA, ("POST", "/completion"): "hang"}) as r:
        client = engines.LlamaCppClient(r.url, timeout_s=0.5)
        with pytest.raises(EngineUnreachable) as exc:
            client.generate(PROMPT, 64)
    assert "did not answer within 0.5 s" in one_line(exc.value)
    with Replay({("GET", "/props"): "drip"}) as r:
        started = time.monotonic()
        with pytest.raises(EngineUnreachable) as exc:
            call(r.url, "/props", timeout_s=0.5)
        assert time.monotonic() - started < 2.0  # the deadline bounds the whole answer, not each read
    assert "did not answer within 0.5 s" in one_line(exc.value)
    with pytest.raises(EngineUnreachable) as exc:
        call("http://no-such-host.invalid:8080", "/health", timeout_s=2)
    one_line(exc.value)


def test_an_answer_out_of_bounds_or_out_of_shape_is_one_line():
    big = b'{"pad": "' + b"x" * 5000 + b'"}'
    with Replay({("GET", "/props"): big, ("GET", "/v1/models"): b"<html>not json</html>"}) as r:
        with pytest.raises(EngineAnswerError) as exc:
            call(r.url, "/props", max_bytes=1000)
        assert "over the 1000-byte bound" in one_line(exc.value)
        with pytest.raises(EngineAnswerError) as exc:
            engines.VllmClient(r.url).info()
        assert "no JSON" in one_line(exc.value)
        with pytest.raises(EngineAnswerError) as exc:
            engines.SglangClient(r.url).generate(PROMPT, 4)
        assert "HTTP 404" in one_line(exc.value)


# ----------------------------------------------------------------------------- layering
def test_importing_the_referee_loads_no_torch():
    code = "import sys, patcher.referee.engines, patcher.referee.counters; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_the_graph_check_refuses_torch_at_the_referees_module_level(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddpatch_import_graph_referee", ROOT / "tools" / "import_graph.py")
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "patcher", root / "patcher", ignore=shutil.ignore_patterns("__pycache__"))
    engines_py = root / "patcher" / "referee" / "engines.py"
    engines_py.write_text(engines_py.read_text() + "\nimport torch\n\n\ndef _lazy():\n    import numpy\n\n\nfrom ..engine import pipeline\n")
    found = "\n".join(graph.analyse(root)["violations"])
    assert "patcher.referee.engines imports torch at module level" in found
    assert "patcher.referee.engines imports numpy anywhere" in found
    assert "patcher.referee.engines imports patcher.engine.pipeline: referee may import only" in found
