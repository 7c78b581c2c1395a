#!/usr/bin/env bash
# One GPU session's measurements, in priority order (docs/benchmarks/gpu.md says how to run it with
# the device tool and how to read what comes back):
#   0 the machine: GPU, torch, triton, transformers
#   1 issue 54 items 1-2: the bf16 1B decode step against its graph replay and the copy-bandwidth
#     floor, async scheduling off and on (greedy tokens identical); the kernels per step (1b) run
#     last, with what the budget leaves
#   2 issue 54 item 3: FP8 and INT4 weight-only steps against bf16's at batch 1
#   3 issue 47: PP=2 on one GPU (bench/*pipeline*gpu*.py, when it exists) and a KV block transfer
#     between two processes on one GPU (CUDA IPC against host staging)
#   4 issue 48: MLA and a hybrid linear-attention model in bf16: parity at near-ties, step times
#   5 issue 54 item 4: the MoE kernel against the grouped GEMMs, the decode step with LoRA rows
#     against the base step, verify rows' step cost, the KV tiers' side-stream loads, then the
#     CUDA tests of the MoE / LoRA kernels, verify rows and graphs with collectives
# Each command runs under its own `timeout`, cut to what is left of --budget seconds (480; 1800
# with --cpu-smoke); a command that would start with under 20 s left is skipped. Full logs go to
# $OUT (one per step: 8 files at most come back), with summary.json (every command's status and
# figures) rewritten after each command, so a run cut short still leaves them; the console gets
# one line per command and the figures at the end.
#
#     bash bench/gpu_session.sh [--only 0,1,2,3b,...] [--budget SECONDS]   # default: everything
#     bash bench/gpu_session.sh --cpu-smoke     # here, on CPU: tiny sizes, CUDA-only parts skipped
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
SMOKE=0
ONLY=0,1,2,3,4,5
BUDGET=
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-smoke) SMOKE=1 ;;
        --only) ONLY=$2; shift ;;
        --budget) BUDGET=$2; shift ;;
        *) echo "unknown argument: $1 (--cpu-smoke, --only 1,2,..., --budget SECONDS)"; exit 2 ;;
    esac
    shift
done
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
PY=${PYTHON:-python3}
# The GPU run must end inside one device command (600 s); on a shared CPU the smoke is slower.
[ -z "$BUDGET" ] && { [ "$SMOKE" = 1 ] && BUDGET=1800 || BUDGET=480; }
if [ "$SMOKE" = 1 ]; then
    [ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
    # What the GPU machine lacks (Ray, FastAPI, gguf, pydantic, ...) cannot be imported here either.
    export PYTHONPATH="$ROOT/bench/gpu_session_guard:$PYTHONPATH"
fi
OUT_DIR=${OUT:-/tmp/gpu_session_out}
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/[0-5]-*.log "$OUT_DIR/console.log" "$OUT_DIR/summary.json"  # an earlier run's
WORK=$(mktemp -d /tmp/gpu_session.XXXXXX)  # checkpoints and each script's JSON
mkdir -p "$WORK/json"
STATUS=$WORK/status.tsv
: >"$STATUS"
START=$SECONDS
exec > >(tee -a "$OUT_DIR/console.log") 2>&1

summarize() {
    "$PY" bench/gpu_session_summary.py --status "$STATUS" --json-dir "$WORK/json" \
        --smoke "$SMOKE" --out "$OUT_DIR/summary.json" "$@" || echo "(summary failed)"
}

# run ID STEP_LOG LIMIT_S COMMAND...: one command, its own timeout, output appended to the log.
run() {
    local id=$1 log=$OUT_DIR/$2.log limit=$3
    shift 3
    wanted "$id" || return
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 20 ]; then
        note "$id" skipped "budget spent ($((SECONDS - START)) s of $BUDGET)"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $id (timeout ${limit}s): $*" | tee -a "$log"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    local last
    last=$(tr '\r\t' '\n ' <"$log" | grep -v '^\s*$' | tail -1 | cut -c1-200)
    printf '%s\t%s\t%s\t%s\n' "$id" "$rc" "$((SECONDS - t0))" "$last" >>"$STATUS"
    if [ "$rc" = 0 ]; then
        echo "   ok in $((SECONDS - t0)) s"
    else
        echo "   FAILED rc=$rc in $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (timeout)'); log tail:"
        tail -4 "$log" | sed 's/^/   | /'
    fi
    summarize --quiet
}

# wanted ID: whether --only names the command (1b) or its step (1).
wanted() {
    case ",$ONLY," in *",$1,"* | *",${1%%[a-z]*},"*) return 0 ;; *) return 1 ;; esac
}

# note ID STATUS REASON: a command not run, and why.
note() {
    wanted "$1" || return
    printf '%s\t%s\t0\t%s\n' "$1" "$2" "$3" >>"$STATUS"
    echo "== $1: $2: $3"
}

J=$WORK/json
if [ "$SMOKE" = 1 ]; then S=(--smoke); else S=(); fi

run 0 0-machine 60 "$PY" bench/gpu_session_summary.py --machine "$J/machine.json"
wanted 0 && [ "$SMOKE" = 0 ] && command -v nvidia-smi >/dev/null && nvidia-smi >>"$OUT_DIR/0-machine.log" 2>&1

# 1. The bf16 step at the floor, async off and on; then where a step's time goes (kernels).
if [ "$SMOKE" = 1 ]; then B=(--batches 1); else B=(--batches 1 8 64); fi
run 1a 1-step-floor 180 "$PY" bench/step_floor_gpu.py "${S[@]}" "${B[@]}" --formats bf16 \
    --async-modes off on --models "$WORK/llama3-1b" --json "$J/step_floor.json"

# 2. Weight-only FP8 and INT4 against bf16, batch 1 (bf16 re-timed in the same process).
run 2 2-quantized 180 "$PY" bench/step_floor_gpu.py "${S[@]}" --models "$WORK/llama3-1b" \
    --formats bf16 fp8 int4 --async-modes off on --batches 1 --json "$J/quantized.json"

# 3. Pipeline stages on one GPU: the other engineer's script, when it exists; KV between processes.
# Its KV transfer covers NCCL and CUDA IPC; without it, CUDA IPC against host staging at least.
PIPE=$(ls bench/*pipeline*gpu*.py 2>/dev/null | head -1)
if [ -n "$PIPE" ]; then
    run 3a 3-pipeline 180 "$PY" "$PIPE" "${S[@]}" --json "$J/pipeline.json"
else
    note 3a "SLOT EMPTY" "no bench/*pipeline*gpu*.py yet: PP=2 on one GPU not measured"
    if [ "$SMOKE" = 1 ]; then D=(--smoke); else D=(--device cuda --iters 10); fi
    run 3b 3-pipeline 90 "$PY" bench/disagg_bench.py "${D[@]}"
fi

# 4. MLA and hybrid linear attention in bf16: parity at near-ties against HF fp32, step times.
run 4 4-families 180 "$PY" bench/families_gpu.py "${S[@]}" --json "$J/families.json"

# 5. Issue 54 item 4. Figures never taken first; the CUDA tests (checked on 2026-11-26) last.
run 5a 5-item4 90 "$PY" bench/moe_kernel_gpu.py "${S[@]}" --json "$J/moe_kernel.json"
run 5b 5-item4 90 "$PY" bench/lora_gpu.py "${S[@]}" --model "$WORK/llama3-1b/bf16" \
    --json "$J/lora.json"
if [ "$SMOKE" = 1 ]; then V=(--smoke --batches 1 --max-tokens 16); else
    V=(--device cuda --batches 1,8,64 --max-tokens 64); fi
run 5c 5-item4 150 "$PY" bench/spec_bench.py "${V[@]}" --repeats 1 --json "$J/spec.json"
if [ "$SMOKE" = 1 ]; then W='TINY_FAMILIES["llama"], device="cpu"'; else
    W='SHAPES["smollm2-135m"], device="cuda"'; fi
run 5d 5-item4 60 "$PY" -c "from tests.random_checkpoint import SHAPES, TINY_FAMILIES, \
write_random_checkpoint as w; w($W, path='$WORK/kv-model')"
if [ "$SMOKE" = 1 ]; then K=(--device cpu --users 4 --turns 2 --concurrency 2); else
    K=(--device cuda --users 32 --turns 3); fi
run 5e 5-item4 120 "$PY" bench/kv_tier_bench.py --model "$WORK/kv-model" "${K[@]}"
TESTS=(tests/workers/test_triton_moe.py tests/workers/test_triton_lora.py
    tests/workers/test_verify_rows.py tests/workers/test_tp_graphs.py)
if [ "$SMOKE" = 1 ]; then
    # On CPU these run under Triton's interpreter in the normal suite: only check they collect.
    run 5f 5-item4 120 "$PY" -m pytest -q -p no:cacheprovider --collect-only "${TESTS[@]}"
else
    run 5f 5-item4 150 "$PY" -m pytest -q -p no:cacheprovider --tb=short "${TESTS[@]}"
fi

# Last, with what is left: where the step goes, kernel by kernel (1a's figures say how much).
if [ "$SMOKE" = 1 ]; then P=(--modes eager); else P=(--modes graphs); fi
run 1b 1-step-floor 90 "$PY" bench/gpu_step_profile.py "${S[@]}" "${P[@]}" --formats bf16 \
    --batches 1 --top 15

echo "== done in $((SECONDS - START)) s; logs and summary.json in $OUT_DIR"
summarize
rm -rf "$WORK"
