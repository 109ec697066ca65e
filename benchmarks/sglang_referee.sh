#!/usr/bin/env bash
# `ddpatch referee` against a real SGLang serving the shipped trained pair with DFlash, on a CUDA GPU.
# SGLang does not run DFlash on CPU (docs/engines.md, "SGLang: why CI does not run it"), so this is the
# script for a machine with an NVIDIA GPU and a package index; it is not part of CI.
#
#   benchmarks/sglang_referee.sh            # from the repository root; figures and logs in $OUT (or ./out)
#
# 1. SGLang $VERSION into a venv of its own ($SGLANG_VENV, default /tmp/ddpatch-sglang; about 11 GB,
#    13 min on a CPU machine's network): it pins its own torch and transformers, which ddpatch's do not
#    match, so ddpatch runs from the interpreter that runs this script (python3, with ddpatch installed);
# 2. the target as SGLang reads it: a copy of the shipped target whose config also says
#    `full_attention_interval` (SGLang's Qwen3.5 config reader wants it; transformers ignores it), and,
#    if the server does not come up with head dim 32, the same copy with its linear-attention heads
#    zero-padded to 64 (tools/pad_linear_heads.py, as vLLM's CPU kernel needs; which one served is in
#    the log): whether SGLang's GPU kernels take head dim 32 has not been measured;
# 3. the server (--speculative-algorithm DFLASH, bf16, one request at a time), healthy within
#    $START_TIMEOUT s, stopped on every way out;
# 4. the referee (4 prompts, 64 new tokens, --engine-dtype bfloat16): its text and JSON verdicts.
# Exit: the referee's (0 PASS, 1 a finding, 2 bad input), or 3 when SGLang could not be installed or served.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION=${SGLANG_VERSION:-0.5.23}
VENV=${SGLANG_VENV:-/tmp/ddpatch-sglang}
OUTDIR=${OUT:-$ROOT/out}
PORT=${SGLANG_PORT:-30123}
START_TIMEOUT=${START_TIMEOUT:-900}
PAIR=$ROOT/patcher/data/trained_pair
WORK=$OUTDIR/sglang-models
mkdir -p "$OUTDIR" "$WORK"
LOG=$OUTDIR/sglang_referee.txt
exec > >(tee -a "$LOG") 2>&1
start=$(date +%s)
minutes() { awk -v s="$(( $(date +%s) - start ))" 'BEGIN { printf "%.1f", s / 60 }'; }
say() { echo "sglang-referee: $*"; }
give_up() { say "FAILED: $* ($(minutes) min)"; exit 3; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader \
    || give_up "no NVIDIA GPU: SGLang runs DFlash on CUDA only"
python3 -c "import patcher" 2>/dev/null || give_up "ddpatch is not importable by python3 (pip install -e . first)"

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import sglang" 2>/dev/null; then
    say "installing sglang $VERSION into $VENV"
    python3 -m venv "$VENV" || give_up "python3 -m venv $VENV"
    "$VENV/bin/python" -m pip install -q "sglang[all]==$VERSION" >"$OUTDIR/sglang-install.log" 2>&1 \
        || give_up "pip install sglang[all]==$VERSION (see $OUTDIR/sglang-install.log)"
fi
say "sglang $("$VENV/bin/python" -c 'import sglang; print(sglang.__version__)') ready ($(minutes) min)"

# The target copies: the config's layer types say where the full-attention layers are; SGLang wants the
# interval between them instead.
with_interval() {  # src dst
    rm -rf "$2" && cp -r "$1" "$2" || return 1
    python3 - "$2/config.json" <<'EOF'
import json, sys
path = sys.argv[1]
config = json.load(open(path))
full = [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
interval = full[0] + 1
assert full == list(range(interval - 1, len(config["layer_types"]), interval)), f"full attention at {full}: no single interval"
config["full_attention_interval"] = interval
json.dump(config, open(path, "w"), indent=2)
EOF
}
with_interval "$PAIR/target" "$WORK/target-hd32" || give_up "the target copy with full_attention_interval"
python3 tools/pad_linear_heads.py "$PAIR/target" "$WORK/padded" --head-dim 64 >/dev/null || give_up "padding the target"
with_interval "$WORK/padded" "$WORK/target-hd64" || give_up "the padded copy with full_attention_interval"

server_pid=
stop() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM -- "-$server_pid" 2>/dev/null
        for _ in $(seq 30); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$server_pid" 2>/dev/null
    fi
    server_pid=
}
trap stop EXIT INT TERM

serve() {  # target: starts the server in its own process group, waits for /health
    setsid "$VENV/bin/python" -m sglang.launch_server --model-path "$1" --served-model-name target \
        --speculative-algorithm DFLASH --speculative-draft-model-path "$PAIR/draft" \
        --dtype bfloat16 --max-running-requests 1 --mem-fraction-static 0.5 --context-length 1024 \
        --host 127.0.0.1 --port "$PORT" >"$OUTDIR/sglang-server-$(basename "$1").log" 2>&1 &
    server_pid=$!
    local deadline=$(( $(date +%s) + START_TIMEOUT ))
    while [ "$(date +%s)" -lt "$deadline" ]; do
        kill -0 "$server_pid" 2>/dev/null || return 1
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
        sleep 2
    done
    return 1
}

target=
for candidate in "$WORK/target-hd32" "$WORK/target-hd64"; do
    if serve "$candidate"; then
        target=$candidate
        break
    fi
    say "$(basename "$candidate") did not serve; the tail of its log:"
    tail -n 15 "$OUTDIR/sglang-server-$(basename "$candidate").log"
    stop
done
[ -n "$target" ] || give_up "SGLang served neither target"
say "serving $(basename "$target") with DFlash ($(minutes) min)"

python3 -m patcher referee --engine "http://127.0.0.1:$PORT" --target "$target" --draft "$PAIR/draft" \
    --max-new-tokens 64 --engine-dtype bfloat16 --format json >"$OUTDIR/sglang_referee.json"
code=$?
python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(r.get('verdict', r))" "$OUTDIR/sglang_referee.json"
say "the referee exited $code ($(minutes) min); the JSON is $OUTDIR/sglang_referee.json"
exit $code
