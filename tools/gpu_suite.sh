#!/bin/bash
# Everything docs/performance.md reports for one CUDA GPU, in one go: the whole test suite, the tiny model against
# transformers, the linears, attention and fused-op micro-benchmarks, the 8B model's steps with kernel profiles and
# its decode steps at 1-16 sequences, and
# kiln bench on Llama-3-8B FP8 (1000 prompts at 1000/1000 with an FP8 KV cache, with and without FP8 p @ v in decode
# attention and overlapped steps,
# then 256 prompts against transformers at 1000/200 and at 1000/1000, and bf16 batch-1 decode).
# Results go to $OUT (default ./gpu-out).
#   bash tools/gpu_suite.sh [quick]     # quick: tests, tiny end-to-end and the step benchmark only
set -u
source "$(dirname "$0")/gpu_env.sh"
run() { echo "== $1"; shift; "$@" 2>&1 | tee -a "$OUT/suite.log"; }
run "tests" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/   # all of them; the kernels' on CUDA
run "tiny model vs transformers" python3 tools/gpu_check.py --tokens 32 --out "$OUT/gpu_check.json"
run "8B steps" python3 tools/bench_step.py --formats fp8,none,int4_awq --batch 1,8,64,256 --profile \
    --kv-cache-dtype float8_e4m3fn --json "$OUT/step.json"
[ "${1:-}" = quick ] && exit 0
run "8B small-batch decode" python3 tools/bench_step.py --formats fp8,int4_awq --batch 1,2,4,8,16 --context 1024 \
    --kv-cache-dtype float8_e4m3fn --fill-kv --prefill 0 --steps 300 --json "$OUT/step_small.json"
run "linears" python3 tools/bench_linears.py --m 1,8,16,32,64
run "attention" python3 tools/bench_kernels.py
run "attention tiles" python3 tools/tune_attention.py --json "$OUT/tune_attention.json"
run "attention, FP8 p @ v against float16" python3 tools/attention_fp8_pv.py
run "fused ops" python3 tools/tune_fused_ops.py --json "$OUT/tune_fused_ops.json"
BENCH="python3 -m kiln bench configs/models/llama3-8b.json --format fp8 --input-len 1000"
# SM clock, power and temperature once a second through the long run (an H200 holds its 700 W cap there, at an SM
# clock of 1,815-1,890 MHz against 1,980).
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -l 1 > "$OUT/clocks.csv" 2>&1 & CLOCKS=$!
echo "== kiln bench 1000/1000"; $BENCH --prompts 1000 --output-len 1000 --kv-cache-dtype fp8 --json > "$OUT/bench.json"
kill $CLOCKS
echo "== kiln bench 1000/1000, decode's p @ v in float16 (FP8 p @ v's share)"
KILN_ATTENTION_FP8_PV=0 $BENCH --prompts 1000 --output-len 1000 --kv-cache-dtype fp8 --json > "$OUT/bench_fp16_pv.json"
echo "== kiln bench 1000/1000, each step run to completion first (the overlap's share)"
KILN_OVERLAP_STEPS=0 $BENCH --prompts 1000 --output-len 1000 --kv-cache-dtype fp8 --json > "$OUT/bench_no_overlap.json"
sync  # the checkpoint written above is flushed, so that no writeback slows the host-bound peer
echo "== kiln bench 1000/200 vs transformers"
$BENCH --prompts 256 --output-len 200 --kv-cache-dtype fp8 --peer transformers --json > "$OUT/bench_peer.json"
echo "== kiln bench 1000/1000 vs transformers"
$BENCH --prompts 256 --output-len 1000 --kv-cache-dtype fp8 --peer transformers --json > "$OUT/bench_peer_1000.json"
echo "== kiln bench, bf16 batch-1"
python3 -m kiln bench configs/models/llama3-8b.json --format none --batch-1 --input-len 1000 --output-len 128 \
    --json > "$OUT/bench_bf16.json"
