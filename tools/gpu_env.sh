# Sourced by the tools/gpu_*.sh scripts: $OUT for the results (default ./gpu-out), the checkout importable as the
# package `kiln` without an install (a link named kiln on PYTHONPATH), unbuffered Python, and NCCL's NVLink
# multicast off (it can take the shared GPU hosts down).
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
KILN_PATH=${TMPDIR:-/tmp}/kiln-path
mkdir -p "$KILN_PATH" && ln -sfn "$PWD" "$KILN_PATH/kiln"
export PYTHONPATH=${PYTHONPATH:-}:$KILN_PATH:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
