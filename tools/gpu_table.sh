#!/bin/bash
# Issue #34 on one H200 (or H100): rows of TensorRT-LLM's table (`kiln bench --suite trtllm-h200`, trtllm-h100 on an
# H100) and how fast the cached 8B
# FP8 engine is ready (tools/load_time.py). The cache lives in /dev/shm (the 8B checkpoints and engines outgrow the
# disk). Results go to $OUT (default ./gpu-out), one JSON per step and a line each on stdout.
#   bash tools/gpu_table.sh [direct] [batch=N] [KILN_X=V] rows=128/128[,1000/1000] [batch1] [load] ...
# Each step applies from then on: direct makes the FP8 weights directly (--random-quantized: no bf16 checkpoint, no
# modelopt, minutes less on a fresh machine), batch=N passes --max-batch-size N, KILN_X=V sets a runtime option
# (KILN_SCHEDULER_POLICY=guaranteed_no_evict, KILN_GPU_MEMORY_UTILIZATION=0.95), batch1 measures batch-1 decode
# and time to first token (1000 in, 128 out), load times the engine of the step before it from a copy on the
# disk (LOAD_DISK, default /tmp/kiln-load: a cold page cache needs a disk's), and busy traces how busy the GPU is
# during the offline run of the rows step before it (tools/gpu_busy.py: its first row).
set -u
source "$(dirname "$0")/gpu_env.sh"
export KILN_CACHE=${KILN_CACHE:-/dev/shm/kiln-table}
BENCH="python3 -m kiln bench configs/models/llama3-8b.json --format fp8 --kv-cache-dtype fp8"
# the table of this GPU: TensorRT-LLM's H100 figures on an H100, else its H200 ones
SUITE=${SUITE:-$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -qw H100 && echo trtllm-h100 || echo trtllm-h200)}
BATCH=""
LAST=""
for step in "$@"; do
  case $step in
    direct) BENCH="$BENCH --random-quantized" ;;
    batch=*) BATCH=${step#batch=} ;;
    KILN_*=*) export "${step?}"; TAG="${TAG:-}_${step#KILN_}"; TAG=${TAG//=/-} ;;
    rows=*)
      rows=${step#rows=}
      LAST="$OUT/suite_${rows//\//-}${BATCH:+_b$BATCH}${TAG:-}.json"
      $BENCH --suite "$SUITE" --rows "$rows" ${BATCH:+--max-batch-size $BATCH} --json > "$LAST" 2> "${LAST%.json}.err"
      python3 - "$LAST" <<'PY' || tail -5 "${LAST%.json}.err"
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    e, p = r["offline_engine"], r["kv_pool"]
    print(f"{r['row']} x{r['prompts']} batch {r['max_batch_size']}: {r['kiln_tokens_per_s']:,.0f} tok/s "
          f"{r['ratio']:.3f}x, {r['offline_s']:.1f} s, preempt {e['preemptions']}, last batch "
          f"{e['last_steps_batch_size_p50']}, pool {p['tokens']:,} tok {p['bytes']/2**30:.1f} GiB, free "
          f"{p['device_free_bytes']/2**30:.1f} GiB, by kind {e['by_kind']}, load {r['load_ms']/1000:.2f} s "
          f"{r['load_phases_s']}")
PY
      ;;
    batch1)
      LAST="$OUT/batch1${TAG:-}.json"
      $BENCH --batch-1 --input-len 1000 --output-len 128 --json > "$LAST" 2> "${LAST%.json}.err" || tail -5 "${LAST%.json}.err"
      python3 -c "import json,sys; r = json.load(open(sys.argv[1])); k = r['kiln']; print({n: k.get(n) for n in ('decode_tokens_per_s_batch1', 'ttft_ms', 'load_ms', 'load_phases_s')}, r.get('floor_fraction_batch1'))" "$LAST" ;;
    load)
      engine=$(python3 -c "import json,sys; r = json.load(open(sys.argv[1])); print(r['rows'][0]['engine_dir'] if 'rows' in r else r['kiln']['engine_dir'])" "$LAST")
      mkdir -p "${LOAD_DISK:-/tmp/kiln-load}"
      python3 tools/load_time.py "$engine" --json --profile "$OUT/load_profile.txt" --disk "${LOAD_DISK:-/tmp/kiln-load}" \
        > "$OUT/load.json" 2> "$OUT/load.err" || tail -5 "$OUT/load.err"
      cat "$OUT/load.json" ;;
    busy)
      python3 - "$LAST" > "$OUT/busy.args" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["rows"][0]
print(r["engine_dir"], "--prompts", r["prompts"], "--input-len", r["input_len"], "--output-len", r["output_len"])
PY
      # shellcheck disable=SC2046
      python3 tools/gpu_busy.py $(cat "$OUT/busy.args") > "$OUT/busy.json" 2> "$OUT/busy.err" || tail -5 "$OUT/busy.err"
      python3 -c "import json,sys; [print({k: w[k] for k in w if k != 'heaviest_kernels_ms'}, w['heaviest_kernels_ms']) for w in json.load(open(sys.argv[1]))['windows']]" "$OUT/busy.json" ;;
    *) echo "unknown step $step: direct, batch=N, KILN_X=V, rows=IN/OUT[,...], batch1, load or busy" >&2; exit 2 ;;
  esac
done
