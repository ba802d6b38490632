#!/bin/bash
# issue 35 items 1-2 on one GPU (docs/quality.md): benchmarks/kvpress_side.py in 8 interleaved shards
# (kvpress's presses against kvdrop's, seeds 1 and 2, 8 prompts a task and seed at 1K) and, beside
# them, kvdrop eval of kvzip variants at keep 0.25 on development seeds 1, 2 and fresh seeds 31, 32.
# Needs: the model at /tmp/smol.gguf; KVW, a folder of wheels of kvpress 0.5.5 and what it imports
# beyond the device image (transformers 5.2.0, tokenizers 0.22.2, datasets, dill, multiprocess, fire,
# termcolor, cachetools, typer-slim), installed into /tmp/kvsite ahead of the image's transformers.
# LIM: seconds each process may run; what a process finished by then is kept (records are appended).
set -u
LIM=${LIM:-170}
KVW=${KVW:-../kvw}
python3 -m pip install -q --no-index --no-deps --target /tmp/kvsite "$KVW"/*.whl || exit 1
export PYTHONPATH=/tmp/kvsite:${PYTHONPATH:-}:$PWD/src:$PWD/benchmarks
python3 -c "import kvpress, transformers; print('kvpress', kvpress.__file__, 'transformers', transformers.__version__)" || exit 1
mkdir -p /tmp/logs /tmp/side
date -u
for i in 0 1 2 3 4 5 6 7; do
  timeout "$LIM" python3 benchmarks/kvpress_side.py --model /tmp/smol.gguf --device cuda --seeds 1 2 \
    --num-samples 8 --shard $i 8 --results /tmp/side/side-$i.jsonl > /tmp/logs/side-$i.log 2>&1 &
done
VAR=(kvzip 'kvzip+snapkv' 'kvzip(layer_agg=max)')
for s in 1 2 31 32; do
  timeout "$LIM" env PYTHONPATH=/tmp/site:$PWD/src kvdrop eval --model /tmp/smol.gguf --device cuda \
    --no-progress --threads 2 --policies "${VAR[@]}" --keep-ratios 0.25 --lengths 1024 --num-samples 8 \
    --seed $s --batch-tokens 32768 --results "$OUT/eval-s$s.jsonl" > /tmp/logs/eval-s$s.log 2>&1 &
done
sleep 40; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv > /tmp/logs/smi.txt
wait
date -u
cat /tmp/side/side-*.jsonl > "$OUT/side.jsonl"
for f in /tmp/logs/*; do echo "=== $f"; grep -v Warning "$f" | tail -c 3000; done > "$OUT/logs.txt"
wc -l "$OUT"/*.jsonl
