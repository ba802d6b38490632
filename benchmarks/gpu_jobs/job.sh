# The start every GPU job script shares, sourced after it sets JOB (its name) and PART:
# PY (PYTHON, default python) with kvdrop importable (installed editable, no dependencies, only
# when it is not), the checkout as the working directory, RAW (OUT, else a fresh folder) for the
# raw output, DEVICE (default cuda), and a header: the job, its part, the time, the GPU.
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if ! "$PY" -c "import kvdrop, kvdrop_engine" 2>/dev/null; then
  "$PY" -m pip install --no-deps --no-build-isolation -e . >/dev/null
fi
RAW=${OUT:-$(mktemp -d)}
mkdir -p "$RAW"
echo "$JOB PART=$PART DEVICE=$DEVICE, raw output in $RAW"
date -u
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
fi
