#!/usr/bin/env bash
# Issue 31 (end to end through the cache server, docs/engine/benchmarks.md) on one GPU. Tables go
# to stdout, each run's progress log (prefill, modify, decode and job seconds as each ends) to
# stderr and, with the raw output, under $OUT when it is set: a run stopped by a time limit
# still leaves the runs it finished.
#
#   PART=e2e bash benchmarks/gpu_jobs/i31.sh    # the issue's command: 30 prompts of 8-14K, 512
#                                               # decoded, chunk-halving snapkv kvzip (~8 min),
#                                               # each job's timeline per request too
#   PART=long bash benchmarks/gpu_jobs/i31.sh   # the same at 5,120 decoded tokens, snapkv
#   PART=fail bash benchmarks/gpu_jobs/i31.sh   # registration forced to fail, 4 prompts (~1 min)
#   PART=recon bash benchmarks/gpu_jobs/i31.sh  # kvzip's pass against the prefill, by part
#   PART=capture bash benchmarks/gpu_jobs/i31.sh  # prefill with query capture on/off, A/B
#                                                 # on one server (~4 min)
#   DEVICE=cpu PART=... bash benchmarks/gpu_jobs/i31.sh   # the same commands at a tiny shape
#
# PYTHON (default python) runs everything; kvdrop is installed (editable, no dependencies) only
# when it is not importable. POLICIES overrides PART=e2e's policies.
set -euo pipefail
PART=${PART:-e2e}
JOB=i31
source "$(dirname "$0")/job.sh"
if [ "$DEVICE" = cuda ]; then
  SHAPE=(--device cuda --dtype bfloat16 --model-preset qwen3-8b --prompt-tokens 8192 14336
    --max-prefill-tokens 8192 --share-prefill --edit-device cuda)
  N=30
else
  SHAPE=(--model-preset tiny --prompt-tokens 300 600 --max-prefill-tokens 1024 --share-prefill)
  N=4
fi

gain() {  # gain NAME ARGS...: one decode_gain.py run, its log kept beside its table
  local name=$1
  shift
  echo "== decode_gain.py ${SHAPE[*]} $*"
  "$PY" benchmarks/decode_gain.py "${SHAPE[@]}" "$@" 2> >(tee "$RAW/$name.log" >&2) |
    tee "$RAW/$name.txt" || echo "FAILED: decode_gain.py $name (see $RAW/$name.log)"
}

case "$PART" in
  e2e)
    read -r -a pol <<< "${POLICIES:-chunk-halving snapkv kvzip}"
    if [ "$DEVICE" = cuda ]; then tok=512; else tok=16; fi
    gain e2e --num-requests "$N" --max-tokens "$tok" --policy "${pol[@]}" --timeline
    ;;
  long)
    if [ "$DEVICE" = cuda ]; then tok=5120; else tok=64; fi
    gain long --num-requests "$N" --max-tokens "$tok" --policy snapkv
    ;;
  fail)
    KVDROP_CUDA_HOST_REGISTER=fail gain fail --num-requests 4 --max-tokens 32 \
      --policy chunk-halving snapkv
    ;;
  capture)
    # Query capture on/off, engines alternated on one server (issue 31's +20% prefill).
    if [ "$DEVICE" = cuda ]; then
      CC=(--device cuda --dtype bfloat16 --model-preset qwen3-8b --num-requests 30
        --prompt-tokens 8192 14336 --max-prefill-tokens 8192 --kv-budget-tokens 131072)
    else
      CC=(--model-preset tiny --num-requests 8 --prompt-tokens 1500 2500)
    fi
    echo "== capture_cost.py ${CC[*]}"
    "$PY" benchmarks/capture_cost.py "${CC[@]}" --repeats 2 --profile --top 30 |
      tee "$RAW/capture.txt" || echo "FAILED: capture_cost.py"
    ;;
  recon)
    if [ "$DEVICE" = cuda ]; then
      RC=(--device cuda --dtype bfloat16 --model-preset qwen3-8b --prompt-tokens 8192 14336)
    else
      RC=(--model-preset tiny)
    fi
    echo "== reconstruct_cost.py ${RC[*]}"
    "$PY" benchmarks/reconstruct_cost.py "${RC[@]}" | tee "$RAW/recon.txt" ||
      echo "FAILED: reconstruct_cost.py"
    ;;
  *) echo "PART must be e2e, long, fail, capture or recon, got $PART" >&2; exit 2 ;;
esac
date -u
