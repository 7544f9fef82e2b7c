#!/usr/bin/env bash
# The soak of docs/performance.md on one GPU: build the Llama-3-8B-shaped FP8 engine (FP8 KV) with `kiln bench`, then
# 1,000 requests of random lengths from 64 clients, a third of them disconnecting mid-stream, against the engine
# served on loopback (engine process). Writes soak.json and log.txt to $OUT.
#   bash tools/gpu_soak.sh        (PYTHONPATH, KILN_CACHE and the serve extra set up by the caller)
set -euo pipefail
OUT=${OUT:-.}
T0=$SECONDS
log() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$OUT/log.txt"; }
log "build"
python -m kiln bench configs/models/llama3-8b.json --format fp8 --kv-cache-dtype fp8 --batch-1 --prompts 256 \
  --input-len 1024 --output-len 256 --json > /tmp/bench.json 2> /tmp/bench.err
ENGINE=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['kiln']['engine_dir'])" /tmp/bench.json)
log "soak"
python -m kiln loadtest "$ENGINE" --clients 64 --requests 1000 --warmup 200 --input-len 256 --output-len 128 \
  --spread 0.5 --disconnect 0.33 --no-offline --json > "$OUT/soak.json" 2>> "$OUT/log.txt"
python - "$OUT/soak.json" <<'PY' | tee -a "$OUT/log.txt"
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r[k] for k in ("requests", "succeeded", "disconnected", "failed", "statuses", "output_tokens_per_s")})
print(r["server"])
PY
log "done"
