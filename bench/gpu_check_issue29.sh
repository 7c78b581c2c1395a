#!/usr/bin/env bash
# Issue 29's GPU checks of the rotary kernel and of CUDA graphs with NCCL collectives, in one call
# (about 3 minutes on an H200; `--parity` adds the bf16 HF parity tests, about 1.5 minutes more).
# Full logs go to $OUT (or /tmp); the console gets each step's summary.
#
#     bash bench/gpu_check_issue29.sh [--parity]
#
# Success: "rotary bit-exact ... True (0 differing)" at 256 and 1 tokens; the pytest lines end in
# "passed" with no "failed"; tp_graphs_gpu.py ends in "RESULT: PASS".
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
logs="${OUT:-/tmp}"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(0), torch.__version__, 'triton', triton.__version__)"

echo "== 1. fused ops against the torch path, bf16, 256 tokens then 1 (rotary: both launches)"
timeout 150 python3 bench/triton_rounding.py 2>&1 | tee "$logs/triton_rounding.log" | grep -v "^    torch path"
echo "-- at 1 token:"
timeout 90 python3 bench/triton_rounding.py --tokens 1 2>&1 | tee "$logs/triton_rounding_1.log" \
    | grep -E "bit-exact|Error"

echo "== 2. CUDA tests: graphs with NCCL collectives captured; the rotary kernel bit for bit"
timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short \
    tests/workers/test_tp_graphs.py tests/workers/test_triton_rotary.py 2>&1 \
    | tee "$logs/pytest_tp_graphs.log" | tail -15

echo "== 3. decode step at batch 1/8/64: TP=1 and an NCCL group of one, graphs and eager"
timeout 300 python3 bench/tp_graphs_gpu.py --json "$logs/tp_graphs.json" 2>&1 \
    | tee "$logs/tp_graphs_gpu.log" | grep -v "^  " | tail -30

if [ "${1:-}" = "--parity" ]; then
    echo "== 4. bf16 HF parity and graphs = eager with rotary on by default"
    timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=line -k bfloat16 \
        tests/workers/test_cuda.py::test_greedy_matches_hf_with_chunked_prefill_and_prefix_hits \
        tests/workers/test_cuda.py::test_decode_graphs_give_the_tokens_of_eager_decode 2>&1 \
        | tee "$logs/pytest_parity.log" | tail -12
fi
