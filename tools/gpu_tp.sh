#!/bin/bash
# Tensor parallelism on a two-GPU machine (issue #32): the two-GPU tests, then Llama-3-8B FP8 at TP1 and TP2
# (batch-1 decode against the floor, offline at 1000 in / 1000 out), and Llama-3-70B FP8 at TP2 from random FP8
# weights made directly (--random-quantized: its bf16 weights would be 141 GB). The 70B checkpoint (72 GB) and
# engine (72 GB) exist at once while it builds, more than the 128 GiB disk holds: the checkpoint goes to a cache in
# /dev/shm (CHECKPOINT_CACHE), the engine to KILN_CACHE on the disk. NVLink multicast
# stays off (NCCL_NVLS_ENABLE=0). Results go to $OUT (default ./gpu-out).
#   bash tools/gpu_tp.sh [tests] [8b] [70b]
set -u
source "$(dirname "$0")/gpu_env.sh"
export KILN_CACHE=${KILN_CACHE:-/tmp/kiln-tp}
BENCH="python3 -m kiln bench --format fp8 --kv-cache-dtype fp8"
for step in "$@"; do
  case $step in
    tests)
      python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_tensor_parallel.py 2>&1 | tail -15 \
        | tee "$OUT/tests.log" ;;
    8b)
      for tp in 1 2; do
        echo "== llama3-8b tp$tp"
        $BENCH configs/models/llama3-8b.json --tp-size $tp --batch-1 --input-len 1000 --output-len 200 --json \
          > "$OUT/batch1_tp$tp.json" 2> "$OUT/batch1_tp$tp.err"; tail -1 "$OUT/batch1_tp$tp.err"
        $BENCH configs/models/llama3-8b.json --tp-size $tp --prompts 1000 --input-len 1000 --output-len 1000 --json \
          > "$OUT/offline_tp$tp.json" 2> "$OUT/offline_tp$tp.err"; tail -1 "$OUT/offline_tp$tp.err"
      done ;;
    70b)
      echo "== llama3-70b tp2"
      df -h /dev/shm /tmp | tee "$OUT/disk_70b.txt"
      BIG="--random-quantized --checkpoint-cache ${CHECKPOINT_CACHE:-/dev/shm/kiln-checkpoints} --tp-size 2"
      $BENCH configs/models/llama3-70b.json $BIG --batch-1 --input-len 1000 \
        --output-len 200 --json > "$OUT/batch1_70b_tp2.json" 2> "$OUT/batch1_70b_tp2.err"; tail -1 "$OUT/batch1_70b_tp2.err"
      $BENCH configs/models/llama3-70b.json $BIG --prompts 1000 --input-len 1000 \
        --output-len 1000 --json > "$OUT/offline_70b_tp2.json" 2> "$OUT/offline_70b_tp2.err"
      tail -1 "$OUT/offline_70b_tp2.err" ;;
    *) echo "unknown step $step: tests, 8b or 70b" >&2; exit 2 ;;
  esac
done
