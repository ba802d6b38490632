#!/usr/bin/env bash
# The device machine's set-up, sourced at the start of every GPU job: it starts bare, with
# torch+CUDA but without kvdrop's other dependencies and with no network. The wheels travel in the
# git-ignored folder .whl/ (downloaded here for Python 3.12 / manylinux x86-64:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pyzmq importlib-metadata zipp lazy_importer prometheus-client einops gguf sybil \
#     hypothesis sortedcontainers pytest-timeout
# ), are installed into /tmp/site, and kvdrop itself is installed editable without dependencies.
#   source benchmarks/gpu_jobs/setup.sh
# On a machine where kvdrop already imports (a CPU dry run here) it does nothing.
if python3 -c "import kvdrop, zmq, gguf" 2>/dev/null; then
    return 0 2>/dev/null || exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "setup: the wheels in .whl/ did not install" >&2; return 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null \
    || { echo "setup: pip install -e . failed" >&2; return 1; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
