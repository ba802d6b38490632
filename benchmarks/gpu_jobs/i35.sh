#!/usr/bin/env bash
# Issue 35 (docs/quality.md) on one GPU: `kvdrop eval` on SmolLM2-135M-Instruct (Q4_1, float32),
# two calls of at most 540 s each, back to back. Raw records under $OUT/i35/ (one JSONL a
# process, `--results`: cells are appended as they finish, and a rerun with the same file skips
# them), the tables in $OUT/i35/tables.md (part A's per seed in tables-seeds.md), nvidia-smi and
# free samples and every process's log tail in $OUT/i35/logs.txt.
#
#   export CALL_T0=$(date +%s); source benchmarks/gpu_jobs/setup.sh &&
#     JOIN=1 PART=A bash benchmarks/gpu_jobs/i35.sh
#   export CALL_T0=$(date +%s); source benchmarks/gpu_jobs/setup.sh &&
#     PART=B bash benchmarks/gpu_jobs/i35.sh
#   DEVICE=cpu SMOKE=1 OUT=/tmp/i35smoke PART=A bash benchmarks/gpu_jobs/i35.sh   # the check
#
# PART=A: the keep-0.25 lever and its confirmation. A_POLICIES (below) at keep 0.5 and 0.25,
#   1024 and 4096 tokens, the four tasks, both settings, 16 prompts a task a seed, on fresh seeds
#   61 and 62 (never run by anyone) and development seeds 1 and 2. The kvzip variants share one
#   reconstruction pass per prompt inside a process.
# PART=B: issue 35 item 4's tables. Every built-in policy (B_TOP, B_FULLQ, B_MID, B_REST;
#   kvzip comes from part A on the same seeds and prompts) at 1024 tokens on seeds 1 and 2, then
#   at 4096, then the top five at 8192 (kv and multikey, 8 prompts a task).
# PART=C: part B's 4096 and 8192 units only (a third call, if device time is left).
#
# Each part is a queue of units (a unit: one process, one seed, one length, some tasks, a policy
# group), started in the queue's order (= priority) whenever fewer than NPROC run, host memory
# has MIN_FREE_GB available and the GPU has MIN_GPU_GB free. Every process runs under `timeout`
# to one DEADLINE: CALL_S = 500 s after CALL_T0 (the call's start, before the set-up) when set,
# else LIM = 440 s after this script's start; with the 15 s kill grace and the tables the call
# ends by about 525 s. A unit not started by DEADLINE - MIN_LEFT (60 s) is listed as not started.
# Every JSONL is also kept in PREV (/tmp/i35-prev) on the machine: a later call there (PART=A
# again, or PART=C after B) resumes a unit from its file, and PART=B's tables pool part A's kvzip
# rows on seeds 1 and 2 from it. JOIN=1 first joins the model from its two halves
# (/tmp/mstore/part00, carried .m2/part01) into /tmp/smol.gguf and checks its sha256.
#
# Memory (per process, BT = --batch-tokens = 16384 at every length): eval's rule, about 0.4 MB
# a token (float32, with queries), gives 6.5 GB of GPU memory, x 6 processes = 39 GB (H100: 80);
# the server's pool (host shared memory) is 1.2 x (1.2 x (KV + queries) + 2 x KV) = 276 KB a
# batch token = 4.5 GB, plus about 3 GB of process memory: about 45 GB of host memory for 6
# (128 GB). The last run that died (CUBLAS_STATUS_ALLOC_FAILED, host memory 125 of 125 GB) had
# 8 kvpress shards beside eval processes at --batch-tokens 65536 (18 GB of pool each).
#
# Time estimate (from the `seconds` of docs/data/*.jsonl: the issue 26 run, seven processes at
# once on an H200; cost of one prompt in one setting, prefill + modify + decode + score):
#   1K: full KV 0.38 s, kvzip's reconstruction pass 0.14 s, one policy at one keep 0.13-0.5 s
#       (kvzip-like 0.14, h2o 0.54, non-causal-attn 0.49, compactor 0.39, cap 0.39);
#   4K: full KV 0.87 s, the pass 0.94 s, one policy at one keep 0.29-0.5 s (kvzip-like 0.35);
#   8K (extrapolated, x2.2 of 4K): full KV 2 s, the pass 2.5 s, one policy at one keep 0.8 s.
#   A process needs about 20 s to start (model load, server). With LIM 440 and 6 processes a
#   call has about 6 x 420 = 2,500 process-seconds.
# PART=A, 128 prompt-settings a seed and length, 4 variants x 2 keeps: a seed at 1K 128 x (0.38
#   + 0.14 + 8 x 0.14) = 210 s, at 4K 128 x (0.87 + 0.94 + 8 x 0.35) = 590 s. Fresh seeds (1K and
#   4K) 1,630 s + development seeds at 1K 420 s = 2,050 s: expected to finish; the development
#   seeds at 4K (1,180 s, the last 8 units) are expected to be cut: 2 of their 8 units start
#   and stop at the deadline a little over half-way (the queue simulated on these costs: fresh
#   4K units 167 s each, 1K halves 125 s). Were everything 1.5x slower, the fresh seeds' last
#   two 4K units would stop at about 80% and the development seeds would not start.
# PART=B at 1K, a unit = one seed, two tasks (64 prompt-settings), one group, full KV in each:
#   B_TOP 205 s, B_FULLQ 160 s, B_MID 230 s, B_REST 235 s (10 s a prompt-setting for the 20
#   policies x 2 keeps): 1,660 s a seed, 3,320 s for both. Expected (simulated): B_TOP, B_FULLQ
#   and B_MID on both seeds, B_REST half of seed 1 (1.5x slower: B_MID a third); 4K (about
#   18 s a prompt-setting, 4,600 s for both seeds) and 8K (12.5 s a prompt-setting for the top
#   five, 32 a seed) are not expected to start (PART=C runs them). These figures are +-50%:
#   the queue's order decides what is cut.
set -euo pipefail
PART=${PART:-A}
JOB=i35
source "$(dirname "$0")/job.sh"
T0=$(date +%s)

A_POLICIES=(kvzip 'kvzip+snapkv' 'kvzip(window=64)' 'kvzip(kernel=3,window=64)')  # select=vote: rejected on CPU (docs/quality.md)
B_TOP=(cap leverage snapkv expected-attention)
B_FULLQ=(compactor non-causal-attn)  # read every token's query: the engine captures them all
B_MID=(finch tova h2o rkv cur)
B_REST=(knorm keydiff lagkv streaming random chunk-halving value-norm 'block(policy=keydiff)'
  'chunkkv(policy=snapkv)')
B_8K=(kvzip leverage cap compactor snapkv)

NPROC=${NPROC:-6}
BT=${BT:-16384}
MIN_FREE_GB=${MIN_FREE_GB:-12}
MIN_GPU_GB=${MIN_GPU_GB:-10}
MIN_LEFT=${MIN_LEFT:-60}  # seconds: a process starts in about 20, and one batch takes 10-40
shopt -s nullglob
if [ -n "${SMOKE:-}" ]; then
  L1=512 L4=768 L8=1024 N=1 N8=1 LIM=${LIM:-420} NPROC=${NPROC_SMOKE:-2}
else
  L1=1024 L4=4096 L8=8192 N=16 N8=8 LIM=${LIM:-440}
fi
if [ -n "${CALL_T0:-}" ]; then  # the call's own start (before set-up): its end, less 40 s
  DEADLINE=$((CALL_T0 + ${CALL_S:-500}))
else
  DEADLINE=$((T0 + LIM))
fi
D=$RAW/i35
if [ -n "${SMOKE:-}" ]; then PREV=${PREV:-$RAW/prev}; else PREV=${PREV:-/tmp/i35-prev}; fi
LOGS=/tmp/i35logs-$PART
mkdir -p "$D" "$LOGS" "$PREV"
rm -f "$LOGS"/*

# The model: JOIN=1 builds it from its halves; on cuda /tmp/smol.gguf unless MODEL_PATH says.
if [ -n "${JOIN:-}" ]; then
  cat /tmp/mstore/part00 .m2/part01 > /tmp/smol.gguf
  sum=$(sha256sum /tmp/smol.gguf | cut -c1-8)
  if [ "$sum" != b179c952 ]; then
    echo "JOIN: /tmp/smol.gguf has sha256 $sum..., expected b179c952" >&2
    exit 3
  fi
  echo "JOIN: /tmp/smol.gguf sha256 b179c952... ok"
fi
if [ "$DEVICE" = cuda ]; then MODEL_PATH=${MODEL_PATH:-/tmp/smol.gguf}; fi
MODEL=()
if [ -n "${MODEL_PATH:-}" ]; then
  [ -f "$MODEL_PATH" ] || { echo "no model at $MODEL_PATH (JOIN=1 builds it)" >&2; exit 3; }
  MODEL=(--model "$MODEL_PATH")
fi

# Every policy must build before anything runs (a spec main does not have yet is named, loudly,
# and left out: the rest of the queue is still worth the call).
check() {  # check ARRAY...: drop from each named array the specs that do not build
  local name bad
  for name in "$@"; do
    local -n arr=$name
    bad=$("$PY" - "${arr[@]}" <<'EOF'
import sys
from kvdrop.experiments.eval import EvalConfig, build_policies
for spec in sys.argv[1:]:
    try:
        config = EvalConfig(policies=(spec,), keep_ratios=(0.5, 0.25), rerotate=False)
        build_policies(config, 64, None)
    except Exception as exc:  # noqa: BLE001 - reported, the spec left out
        print(spec)
        print(f"MISSING POLICY {spec!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
EOF
    )
    if [ -n "$bad" ]; then
      local keep=() p
      for p in "${arr[@]}"; do grep -qxF -- "$p" <<< "$bad" || keep+=("$p"); done
      arr=("${keep[@]}")
    fi
  done
}

# The queue: "name;seed;length;samples;tasks;policy-array" lines, in priority order.
QUEUE=()
add() {  # add NAME SEED LENGTH SAMPLES TASKS POLICY-ARRAY (none when the array is empty)
  local -n pols=$6
  if [ "${#pols[@]}" -gt 0 ]; then QUEUE+=("$1;$2;$3;$4;$5;$6"); fi
}
HALVES=("passkey kv" "multikey story")
part_a() {
  check A_POLICIES
  local s t h
  for s in 61 62; do for t in kv multikey passkey story; do
    add "A-s$s-$L4-$t" "$s" "$L4" "$N" "$t" A_POLICIES
  done; done
  for s in 61 62; do for h in 0 1; do
    add "A-s$s-$L1-h$h" "$s" "$L1" "$N" "${HALVES[$h]}" A_POLICIES
  done; done
  for s in 1 2; do for h in 0 1; do
    add "A-s$s-$L1-h$h" "$s" "$L1" "$N" "${HALVES[$h]}" A_POLICIES
  done; done
  for t in kv multikey passkey story; do for s in 1 2; do
    add "A-s$s-$L4-$t" "$s" "$L4" "$N" "$t" A_POLICIES
  done; done
}
part_b_long() {
  local g s t
  for g in B_TOP B_FULLQ B_MID B_REST; do for s in 1 2; do for t in kv multikey passkey story; do
    add "B-s$s-$L4-$g-$t" "$s" "$L4" "$N" "$t" "$g"
  done; done; done
  for s in 1 2; do for t in kv multikey; do
    add "B-s$s-$L8-8K-$t" "$s" "$L8" "$N8" "$t" B_8K
  done; done
}
part_b() {
  check B_TOP B_FULLQ B_MID B_REST B_8K
  local g s h
  for g in B_TOP B_FULLQ B_MID B_REST; do for s in 1 2; do for h in 0 1; do
    add "B-s$s-$L1-$g-h$h" "$s" "$L1" "$N" "${HALVES[$h]}" "$g"
  done; done; done
  part_b_long
}
case "$PART" in
  A) part_a ;;
  B) part_b ;;
  C) check B_TOP B_FULLQ B_MID B_REST B_8K; part_b_long ;;
  *) echo "PART must be A, B or C, got $PART" >&2; exit 2 ;;
esac
if [ -n "${SMOKE:-}" ]; then  # the CPU check: the first unit of each length and policy group
  declare -A seen=()
  kept=()
  for u in "${QUEUE[@]}"; do
    IFS=';' read -r _ _ len _ _ grp <<< "$u"
    if [ -z "${seen[$len$grp]:-}" ]; then seen[$len$grp]=1; kept+=("$u"); fi
  done
  QUEUE=("${kept[@]}")
fi

unit() {  # unit NAME SEED LENGTH SAMPLES TASKS POLICY-ARRAY: one eval process under the deadline
  local name=$1 seed=$2 len=$3 n=$4 tasks=$5
  local -n pols=$6
  local left=$((DEADLINE - $(date +%s))) t1 rc=0 dev=()
  read -r -a tk <<< "$tasks"
  if [ "$DEVICE" = cuda ]; then dev=(--device cuda); fi
  if [ -s "$PREV/$name.jsonl" ] && [ ! -e "$D/$name.jsonl" ]; then
    cp "$PREV/$name.jsonl" "$D/$name.jsonl"  # resumed: its finished cells are skipped
  fi
  t1=$(date +%s)
  timeout -k 15 "$left" "$PY" -m kvdrop eval "${MODEL[@]}" "${dev[@]}" --no-progress --threads 2 \
    --policies "${pols[@]}" --keep-ratios 0.5 0.25 --lengths "$len" --tasks "${tk[@]}" \
    --num-samples "$n" --seed "$seed" --batch-tokens "$BT" --results "$D/$name.jsonl" \
    > "$LOGS/$name.log" 2>&1 || rc=$?
  local lines=0
  if [ -f "$D/$name.jsonl" ]; then lines=$(wc -l < "$D/$name.jsonl"); fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$((t1 - T0))" "$(($(date +%s) - T0))" "$rc" "$lines" \
    >> "$D/units.tsv"
}

sample() {  # GPU and host memory every 10 s, until killed
  while :; do
    echo "t=$(($(date +%s) - T0))s $(free -m | awk '/^Mem/ {print "host MB used", $3, "free", $7}')"
    if [ "$DEVICE" = cuda ]; then
      nvidia-smi --query-gpu=utilization.gpu,memory.used,memory.total --format=csv,noheader || true
      nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader || true
    fi
    sleep 10
  done
}

roomy() {  # enough host memory (and GPU memory on cuda) for one more process
  local avail gpu
  avail=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo)
  [ "$avail" -ge "$MIN_FREE_GB" ] || return 1
  if [ "$DEVICE" = cuda ]; then
    gpu=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
    [ "$((gpu / 1024))" -ge "$MIN_GPU_GB" ] || return 1
  fi
}

echo "PART=$PART: ${#QUEUE[@]} units, $NPROC at once, --batch-tokens $BT," \
  "deadline in $((DEADLINE - T0)) s"
printf 'unit\tstart_s\tend_s\trc\trecords\n' > "$D/units.tsv"
sample > "$D/smi.txt" 2>&1 &
SAMPLER=$!
disown "$SAMPLER"  # not one of the units `wait -n` waits for
running=0
not_started=()
for u in "${QUEUE[@]}"; do
  IFS=';' read -r name seed len n tasks grp <<< "$u"
  while [ "$running" -ge "$NPROC" ] || { [ "$running" -gt 0 ] && ! roomy; }; do
    wait -n || true
    running=$((running - 1))
  done
  if [ $((DEADLINE - $(date +%s))) -lt "$MIN_LEFT" ]; then not_started+=("$name"); continue; fi
  unit "$name" "$seed" "$len" "$n" "$tasks" "$grp" &
  running=$((running + 1))
  sleep 2  # the processes' model loads a little apart
done
while [ "$running" -gt 0 ]; do wait -n || true; running=$((running - 1)); done
kill "$SAMPLER" 2>/dev/null || true

{
  echo "== units (rc 124/137: stopped at the deadline; records: JSONL lines)"
  column -t -s $'\t' "$D/units.tsv" 2>/dev/null || cat "$D/units.tsv"
  echo "not started: ${not_started[*]:-none}"
} | tee "$D/summary.txt"
{
  cat "$D/summary.txt"
  echo "== memory samples"
  cat "$D/smi.txt"
  for f in "$LOGS"/*.log; do echo "=== $f"; tail -c 3000 "$f"; done
} > "$D/logs.txt"

tables() {  # tables MD TITLE FILE...: quality_tables.py over the non-empty files, into MD
  local md=$1 title=$2 files=() f
  shift 2
  for f in "$@"; do if [ -s "$f" ]; then files+=("$f"); fi; done
  if [ "${#files[@]}" -eq 0 ]; then return 0; fi
  { echo; echo "### $title (${#files[@]} files)"
    "$PY" benchmarks/quality_tables.py "${files[@]}"; } >> "$md" ||
    echo "FAILED: quality_tables.py for $title" >> "$md"
}
: > "$D/tables.md"
if [ "$PART" = A ]; then  # per seed in tables-seeds.md (stdout keeps to the pooled ones)
  tables "$D/tables.md" "Fresh seeds 61 and 62" "$D"/A-s61-*.jsonl "$D"/A-s62-*.jsonl
  tables "$D/tables.md" "Development seeds 1 and 2" "$D"/A-s1-*.jsonl "$D"/A-s2-*.jsonl
  : > "$D/tables-seeds.md"
  for s in 61 62 1 2; do tables "$D/tables-seeds.md" "Seed $s" "$D"/A-s$s-*.jsonl; done
else  # part A's kvzip rows on the same seeds and prompts, when this machine ran it
  tables "$D/tables.md" "Every policy, seeds 1 and 2 (with part A's kvzip rows when present)" \
    "$D"/B-*.jsonl "$PREV"/A-s1-*.jsonl "$PREV"/A-s2-*.jsonl
fi
for f in "$D"/*.jsonl; do cp "$f" "$PREV/"; done
cat "$D/tables.md"
date -u
