#!/usr/bin/env bash
# The serving figures of docs/performance.md on one GPU: build the Llama-3-8B-shaped FP8 engine (FP8 KV) with
# `kiln bench`; `kiln loadtest` it at 64 clients with the engine on a thread of the server and in a process of its
# own, and on TensorRT-LLM's online workload (each with the engine offline and in-process in the same run); then the
# latency workloads against one `kiln serve`. Writes results.json, table.md and log.txt to $OUT.
#   bash tools/gpu_serving.sh        (PYTHONPATH, KILN_CACHE and the serve extra set up by the caller)
# MODES="process" or "thread" runs one engine placement only; C256=0 leaves out the 256-client run (to split the
# script over calls of a limited length: the engine's directory is kept in $KILN_CACHE/serving-engine).
set -euo pipefail
OUT=${OUT:-.}
RUNS=$(mktemp -d)
T0=$SECONDS
log() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$OUT/log.txt"; }
kiln() { python -m kiln "$@"; }
loadtest() {  # NAME ARGS...: one run, its JSON kept, its stderr's tail logged if it fails
  local name=$1; shift
  log "$name"
  kiln loadtest "$@" --json > "$RUNS/$name.json" 2> "$RUNS/$name.err" || { tail -20 "$RUNS/$name.err" >> "$OUT/log.txt"; rm -f "$RUNS/$name.json"; }
}

KEPT=${KILN_CACHE:?}/serving-engine
if [ -f "$KEPT" ] && [ -d "$(cat "$KEPT")" ]; then
  ENGINE=$(cat "$KEPT")
else
  log "build"
  kiln bench configs/models/llama3-8b.json --format fp8 --kv-cache-dtype fp8 --batch-1 --prompts 256 \
    --input-len 1024 --output-len 256 --json > "$RUNS/bench.json" 2> "$RUNS/bench.err"
  ENGINE=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['kiln']['engine_dir'])" "$RUNS/bench.json")
  echo "$ENGINE" > "$KEPT"
fi
C64=(--clients 64 --requests 1024 --warmup 64 --input-len 16 --output-len 128 --in-process)
C1=(--clients 1 --requests 24 --warmup 4 --input-len 16 --output-len 128 --in-process)
ONLINE=(--clients 500 --requests 500 --warmup 8 --request-rate 32 --input-len 467 --output-len 256 --in-process)
for mode in ${MODES:-thread process}; do
  flag=--engine-process; [ $mode = thread ] && flag=--no-engine-process
  loadtest c64-$mode "$ENGINE" "${C64[@]}" $flag
  loadtest c1-$mode "$ENGINE" "${C1[@]}" $flag
  loadtest trtllm-online-$mode "$ENGINE" "${ONLINE[@]}" $flag
done

if [ "${C256:-1}" != 0 ]; then
  log "kiln serve"
  python -m kiln serve "$ENGINE" --port 8123 2> "$RUNS/serve.err" &
  SERVER=$!
  URL=http://127.0.0.1:8123
  until curl -sf $URL/health > /dev/null; do sleep 1; done
  loadtest c256 $URL --clients 256 --requests 512 --warmup 16 --input-len 1000 --output-len 128
  sleep 1
  curl -s $URL/metrics | grep -E "^kiln_(kv_blocks|running|queue)" | tee -a "$OUT/log.txt"
  kill -TERM $SERVER
  wait $SERVER && log "serve drained and exited 0"
fi

python - "$RUNS" "$OUT" <<'PY'
import json, sys
from pathlib import Path
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
results = {path.stem: json.loads(path.read_text()) for path in sorted(runs.glob("*.json"))}
(out / "results.json").write_text(json.dumps(results, indent=1))
rows = ["| run | tok/s | offline tok/s | efficiency | TTFT p50 / p99 ms | ITL p50 / p99 ms | mean TTFT / ITL ms "
        "| CPU µs/token | ok/failed |", "|---|---:|---:|---:|---|---|---|---|---|"]
def row(name, r, offline="", efficiency="", cpu="", ok=""):
    rows.append(f"| {name} | {r['output_tokens_per_s']:,.0f} | {offline} | {efficiency} | {r['ttft_ms']['p50']} / "
                f"{r['ttft_ms']['p99']} | {r['itl_ms']['p50']} / {r['itl_ms']['p99']} | {r['ttft_ms']['mean']:.1f} / "
                f"{r['itl_ms']['mean']:.2f} | {cpu} | {ok} |")
for name, r in results.items():
    if name == "bench":
        continue
    off = r.get("offline", {}).get("output_tokens_per_s")
    row(name, r, f"{off:,.0f}" if off else "", r.get("efficiency", ""), json.dumps(r.get("cpu_us_per_token", "")),
        f"{r['succeeded']}/{r['failed']}")
    if "in_process" in r:
        row(f"{name} in-process", r["in_process"])
(out / "table.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
log "done"
