#!/usr/bin/env bash
# Issue 33 (reliability, docs/reliability.md): the soak's round-4 phase on the device machine's
# host cores (no GPU use: the engine is `kvdrop engine --random-preset tiny` on CPU, as on the
# 2-core VM). The VM cannot give the clients cores of their own; here the engine gets its own
# CPUs and the soak's good and hostile clients the others, as clients on other machines would.
# Three runs of `--round4-s 24` (about a minute each), tables to stdout and $RAW/soak-*.md:
#   1. engine on CPUs 0-1 (2 torch threads: the VM's engine), clients on 2-15;
#   2. engine on CPUs 0-3 (4 threads), clients on 4-15;
#   3. no pinning (every process on every CPU), for comparison.
#   bash benchmarks/gpu_jobs/i33.sh              # DEVICE=cpu SECONDS_EACH=4 for a short check
#   PART=gpu bash benchmarks/gpu_jobs/i33.sh     # the engine on the GPU (--device cuda), twice
set -euo pipefail
PART=${PART:-soak}
JOB=i33
source "$(dirname "$0")/job.sh"
S=${SECONDS_EACH:-24}
NCPU=$(nproc)
run() {  # name, soak flags...
  local name=$1
  shift
  echo "== soak round4: $name"
  (cd benchmarks && "$PY" soak.py --phases round4 --round4-s "$S" --markdown "$@") \
    2>&1 | tee "$RAW/soak-$name.md" | grep -E "round 4 hostile" || echo "($name: a check did not pass; see $RAW/soak-$name.md)"
}
if [ "$PART" = gpu ]; then
  # The engine as it serves on a GPU (--device cuda): a decode row there costs next to nothing,
  # where each costs the CPU engine 0.1 ms (engine_probe.py's fit); two runs, engine on CPUs 0-1.
  run gpu-1 --engine-cpus 0-1 --engine-args "--device cuda --threads 2"
  run gpu-2 --engine-cpus 0-1 --engine-args "--device cuda --threads 2"
elif [ "$NCPU" -ge 8 ]; then
  run pinned-2 --engine-cpus 0-1 --engine-args "--threads 2"
  run pinned-4 --engine-cpus 0-3 --engine-args "--threads 4"
  run shared
else
  run pinned-1 --engine-cpus 0 --engine-args "--threads 1"
  run shared
fi
date -u
