#!/bin/bash
# issue 26 items 3-5 (docs/quality.md): kvdrop eval on one GPU, seven processes at once (each its own
# JSONL under $OUT; the model at /tmp/smol.gguf). LIM: seconds each process may run.
set -u
LIM=${LIM:-290}
COMMON=(--model /tmp/smol.gguf --device cuda --no-progress --keep-ratios 0.5 0.25 --threads 2)
KZ=(kvzip 'kvzip(window=32)' 'kvzip(layer_agg=max)' 'kvzip(kernel=5)' 'kvzip(kernel=5,window=32)' 'kvzip(head_agg=mean)')
NEW=(expected-attention snapkv compactor leverage cur lagkv non-causal-attn knorm keydiff)
OLD=(finch cap tova h2o rkv streaming random chunk-halving)
P4K=(kvzip 'kvzip(window=32)' 'kvzip(kernel=5)' snapkv expected-attention knorm)
PHO=(kvzip 'kvzip(window=32)' 'kvzip(kernel=5)' 'kvzip(kernel=5,window=32)' expected-attention snapkv)
mkdir -p /tmp/logs
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
date -u
for s in 1 2; do
  timeout $LIM kvdrop eval "${COMMON[@]}" --policies "${KZ[@]}" "${OLD[@]}" --lengths 1024 --num-samples 8 \
    --seed $s --batch-tokens 32768 --results $OUT/dev-s$s-1024-a.jsonl > /tmp/logs/s$s-1k-a.log 2>&1 &
  timeout $LIM kvdrop eval "${COMMON[@]}" --policies "${NEW[@]}" --lengths 1024 --num-samples 8 \
    --seed $s --batch-tokens 32768 --results $OUT/dev-s$s-1024-b.jsonl > /tmp/logs/s$s-1k-b.log 2>&1 &
  timeout $LIM kvdrop eval "${COMMON[@]}" --policies "${P4K[@]}" --lengths 4096 --num-samples 4 \
    --seed $s --batch-tokens 65536 --results $OUT/dev-s$s-4096.jsonl > /tmp/logs/s$s-4k.log 2>&1 &
done
timeout $LIM kvdrop eval "${COMMON[@]}" --policies "${PHO[@]}" --lengths 1024 --num-samples 8 --seed 11 \
  --batch-tokens 32768 --results $OUT/heldout-s11-1024.jsonl > /tmp/logs/s11-1k.log 2>&1 &
sleep 45; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv > /tmp/logs/smi.txt
wait
date -u
for f in /tmp/logs/*; do echo "=== $f"; tail -c 4000 $f; done > $OUT/logs.txt
wc -l $OUT/*.jsonl
