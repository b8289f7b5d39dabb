#!/usr/bin/env bash
# Train the demo model's exit heads on the GPU and write them to $OUT (see bench/calibrate_gpu.py).
# Usage, from the repo root:  bash bench/calibrate_gpu.sh            (carry .whl: pydantic wheels)
#                             bash bench/calibrate_gpu.sh --tiny     (CPU dry run, a few steps)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then PY=.venv/bin/python; fi
if ! "$PY" -c 'import pydantic' 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "calibrate_gpu.sh: pydantic is missing and there is no .whl/ folder to install it from" >&2
    exit 2
  fi
fi
export PYTHONUNBUFFERED=1
exec "$PY" bench/calibrate_gpu.py "$@"
