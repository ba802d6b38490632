#!/usr/bin/env bash
# Issue 34's serving burst on one GPU (docs/engine/dropping.md's all-at-once command): 30 prompts
# of 8-14K tokens sent at once, 2,048 tokens out, baseline and snapkv 0.5 side by side in one run
# (about 4 minutes on an H200). Raw output under $OUT when set.
#   source benchmarks/gpu_jobs/setup.sh && bash benchmarks/gpu_jobs/burst.sh
# CPU dry run at a tiny shape: DEVICE=cpu bash benchmarks/gpu_jobs/burst.sh
set -euo pipefail
out=${OUT:-/tmp}
if [ "${DEVICE:-cuda}" = cpu ]; then
    args=(--device cpu --model-preset tiny --num-prompts 4 --prompt-tokens 256 512 --max-tokens 16)
else
    args=(--device cuda --dtype bfloat16 --model-preset qwen3-8b --max-prefill-tokens 8192
          --num-prompts 30 --prompt-tokens 8192 14336 --max-tokens 2048)
fi
python3 benchmarks/serve.py "${args[@]}" 2>&1 | tee "$out/burst.log"
