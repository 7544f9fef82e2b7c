#!/bin/bash
# The model families on one CUDA GPU (issue #31): their GPU tests, then for each family's 7-9B architecture file
# kiln bench FP8 (FP8 KV cache, 256 prompts at 1000 in / 200 out against transformers, as the Llama-3-8B figures in
# docs/performance.md).
# Each family's cache is removed after its run (a 7-9B family needs about 45 GB: random, quantized, engine).
# Results go to $OUT (default ./gpu-out).
#   bash tools/gpu_families.sh [tests] [FAMILY ...]    # FAMILY: a name under configs/models/, e.g. qwen3-8b
set -u
source "$(dirname "$0")/gpu_env.sh"
export KILN_CACHE=${KILN_CACHE:-/tmp/kiln-families}
if [ "${1:-}" = tests ]; then
  shift
  echo "== tests"
  python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_model_families.py tests/test_triton_attention.py tests/test_triton_fused_ops.py \
      2>&1 | tail -15 | tee "$OUT/tests.log"
fi
df -h / /tmp /dev/shm | tee "$OUT/df.txt"
for family in "$@"; do
  echo "== $family"
  python3 -m kiln bench "configs/models/$family.json" --format fp8 --kv-cache-dtype fp8 --prompts 256 \
      --input-len 1000 --output-len 200 --peer transformers --json > "$OUT/bench_$family.json" 2> "$OUT/bench_$family.err"
  tail -2 "$OUT/bench_$family.err"
  rm -rf "$KILN_CACHE"
done
