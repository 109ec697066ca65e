#!/usr/bin/env bash
# The GPU check of the lossless verify/commit (patcher/runtime/), as one prepared script.
#
#   benchmarks/gpu_check.sh --prepare   # here, with a package index: fills wheelhouse/ (git-ignored)
#   benchmarks/gpu_check.sh             # on the GPU machine, from the repository root, wheelhouse/ carried
#
# The GPU machine reaches no package index: transformers 5.23, fla-core (flash-linear-attention),
# libcst, regex and this project travel as wheels in wheelhouse/. It installs them under
# /tmp/ddpatch-site (fla-core apart, under /tmp/ddpatch-fla, so that both kernel paths can be
# timed), then, each step under its own timeout so that the whole ends inside 8 minutes:
#   1. the environment (GPU, torch, transformers, whether fla imports);
#   2. bench_rollback.py on CUDA, bf16: one Qwen3.6-27B-sized Gated DeltaNet layer + one
#      attention layer (random weights) and mid-qwen3_5; chain replay "closed" and "kernel";
#      once with transformers' torch kernels and once with fla's;
#   3. rounds per second of a chain and a tree round, with and without the fast path (bf16, mid-qwen3_5);
#   4. `ddpatch verify` of the patched vendored DDTree on the tiny presets, on CUDA.
# Figures go to $OUT (or ./out): gpu_check.txt (the log) and one JSON file per step.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=$ROOT/wheelhouse

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p "$WHEELS"
    rm -f "$WHEELS"/*.whl
    py="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps $py -d "$WHEELS" transformers==5.23.0 fla-core==0.6.0 libcst==1.9.0 \
        "regex>=2025.10.22" || exit 1
    had_build=0
    [ -d "$ROOT/build" ] && had_build=1
    python3 -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$ROOT" || exit 1
    [ "$had_build" = 0 ] && rm -rf "$ROOT/build"  # setuptools' leftovers
    ls -la "$WHEELS"
    du -sh "$WHEELS"
    exit 0
fi

OUTDIR=${OUT:-$ROOT/out}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu_check.txt
START=$SECONDS
log() { echo "[$((SECONDS - START))s] $*" | tee -a "$LOG"; }
left() { echo $((420 - (SECONDS - START))); }  # 7 minutes for the steps: the whole ends inside 8
step() {  # step NAME SECONDS COMMAND...: run with a timeout capped by what is left
    local name=$1 limit=$2
    shift 2
    local budget
    budget=$(left)
    if [ "$budget" -lt 20 ]; then log "skip $name: out of time"; return 1; fi
    [ "$limit" -gt "$budget" ] && limit=$budget
    log "start $name (limit ${limit}s)"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    log "end $name: rc=$rc"
    return $rc
}

: >"$LOG"
log "gpu_check in $ROOT, output in $OUTDIR"
ls "$WHEELS"/*.whl >/dev/null 2>&1 || { log "no wheels in $WHEELS: run benchmarks/gpu_check.sh --prepare first"; exit 1; }
SITE=/tmp/ddpatch-site
FLA=/tmp/ddpatch-fla
rm -rf "$SITE" "$FLA"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    $(ls "$WHEELS"/*.whl | grep -v fla_core) >>"$LOG" 2>&1 || { log "install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$FLA" \
    "$WHEELS"/fla_core-*.whl >>"$LOG" 2>&1 || log "fla-core install failed (torch path only)"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
TORCH_PATH=$SITE
FLA_PATH=$FLA:$SITE

step env 60 env PYTHONPATH="$FLA_PATH" python3 - <<'PY'
import torch, transformers, importlib
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("transformers", transformers.__version__)
try:
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    print("fla", getattr(fla, "__version__", "?"), "imports")
except Exception as e:  # noqa: BLE001
    print("fla does not import:", type(e).__name__, e)
from transformers.models.qwen3_5 import modeling_qwen3_5 as m
print("qwen3_5 chunk kernel:", m.torch_chunk_gated_delta_rule.__closure__ and
      [c.cell_contents for c in m.torch_chunk_gated_delta_rule.__closure__ if callable(c.cell_contents)][:2])
PY

BENCH="python3 benchmarks/bench_rollback.py --device cuda --dtype bfloat16 --clock wall --repeats 9 --json"
BENCH_PRESETS=qwen3_6-27b-slice,mid-qwen3_5
step bench-fla 150 env PYTHONPATH="$FLA_PATH" bash -c \
    "$BENCH --presets $BENCH_PRESETS --chain-replay auto,closed,kernel > '$OUTDIR/bench_cuda_fla.json'"
step bench-torch 120 env PYTHONPATH="$TORCH_PATH" bash -c \
    "$BENCH --presets $BENCH_PRESETS --chain-replay auto,closed,kernel > '$OUTDIR/bench_cuda_torch.json'"

# Rounds per second of the lossless round (verify + commit), with and without the Gated DeltaNet
# fast path, bf16, on mid-qwen3_5: a chain round (16 tokens verified, 8 kept) and a tree round
# (a 16-node tree, a 5-node path kept).
step rounds 90 env PYTHONPATH="$FLA_PATH" python3 - cuda bfloat16 "$OUTDIR/rounds_per_second.json" <<'PY' || true
import json, sys, time
import torch
sys.path.insert(0, ".")
from patcher import runtime as rt
from patcher.verify.presets import build_target
from transformers import DynamicCache

device, dtype, out = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3]
m = build_target("mid-qwen3_5", seed=0).to(device=device, dtype=dtype)
parents = [-1] + [(i - 1) // 2 for i in range(1, 16)]  # a binary tree of 16 nodes
depth = [0] * 16
for i in range(1, 16):
    depth[i] = depth[parents[i]] + 1
path = [0, 1, 3, 7, 15]
mask = torch.full((1, 1, 16, 64 + 16), torch.finfo(dtype).min, dtype=dtype, device=device)
mask[..., :64] = 0
for i in range(16):
    j = i
    while j >= 0:
        mask[0, 0, i, 64 + j] = 0
        j = parents[j]
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

def rounds(kind, fast, n=20):
    rt.GDN_FAST_PATH = fast
    ids = torch.arange(64, device=device)[None] % 50
    block = torch.arange(16, device=device)[None] % 50 + 1
    per = []
    with torch.inference_mode():
        for r in range(n + 3):
            cache = DynamicCache(config=m.config)
            m(ids, past_key_values=cache, use_cache=True)
            sync()
            t = time.perf_counter()
            if kind == "chain":
                rt.verify_forward(m, block, position_ids=torch.arange(64, 80, device=device)[None],
                                  past_key_values=cache, use_cache=True)
                cache.crop(-8)
            else:
                rt.verify_forward(m, block, position_ids=(64 + torch.tensor(depth, device=device))[None],
                                  attention_mask=mask, past_key_values=cache, use_cache=True)
                rt.compact_cache(cache, 64, path)
            sync()
            if r >= 3:  # warm-up rounds dropped
                per.append(time.perf_counter() - t)
    per.sort()
    return round(1.0 / per[len(per) // 2], 1)

table = {kind: {"fast path": rounds(kind, True), "generic": rounds(kind, False)} for kind in ("chain", "tree")}
rt.GDN_FAST_PATH = True
print("rounds per second (median of 20), mid-qwen3_5,", sys.argv[2], device, json.dumps(table))
json.dump({"preset": "mid-qwen3_5", "dtype": sys.argv[2], "device": device, "rounds_per_second": table}, open(out, "w"))
PY

PATCHED=/tmp/ddpatch-patched
rm -rf "$PATCHED"
step patch 60 env PYTHONPATH="$FLA_PATH" python3 -m patcher.cli apply vendored/ddtree --recipe qwen3_6-gdn --out "$PATCHED"
step verify 150 env PYTHONPATH="$FLA_PATH" bash -c \
    "python3 -m patcher.cli verify '$PATCHED' --preset tiny-qwen3_5 --preset tiny-qwen3-next --seeds 0 --timeout 140 \
     --format json > '$OUTDIR/verify_cuda.json'"

step summary 20 python3 - "$OUTDIR" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in ("bench_cuda_fla.json", "bench_cuda_torch.json"):
    try:
        d = json.loads((out / name).read_text())
    except Exception as e:  # noqa: BLE001
        print(name, "missing:", e)
        continue
    print(name, "fla" if d["environment"]["fla"] else "torch kernels")
    for key in ("chain_ratio", "chain_ratio_by_replay", "tree_ratio", "commit_share"):
        print(" ", key, json.dumps(d[key]))
try:
    print("rounds per second:", json.loads((out / "rounds_per_second.json").read_text())["rounds_per_second"])
except Exception as e:  # noqa: BLE001
    print("rounds_per_second.json missing:", e)
try:
    v = json.loads((out / "verify_cuda.json").read_text())
    print("verify passed:", v.get("passed"), "exit", v.get("exit_code"))
    for m in v.get("models", []):
        base = m.get("baseline", {})
        print(" ", m.get("model"), "target greedy", base.get("tokens_per_s"), "tok/s")
        for meth in m.get("methods", []):
            print("   ", meth.get("method"), "speedup", meth.get("speedup"), "acceptance", meth.get("acceptance_mean"),
                  "identical", meth.get("identical_runs"), "/", len(meth.get("runs", [])))
except Exception as e:  # noqa: BLE001
    print("verify_cuda.json:", e)
PY
log "done in $((SECONDS - START))s"
