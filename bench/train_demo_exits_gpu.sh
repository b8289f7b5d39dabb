#!/usr/bin/env bash
# Early-exit training of the demo model on one CUDA GPU (issue 4), then its confidence/classifier heads.
#
#   OUT=/some/dir [INIT=stage2] bash bench/train_demo_exits_gpu.sh          (carry .whl: pydantic wheels)
#
# INIT: the model (with exits.json heads) to start from, default runtime/demo/model. The shipped weights are
# this script's output; to redo that run, start from the previous (stage-2) weights and heads:
#   mkdir -p stage2 && git archive f316842 runtime/demo/model | tar -x -C stage2 --strip-components=3
#   INIT=stage2 STEPS=2410 bash bench/train_demo_exits_gpu.sh
#
# 1. edgevlm.runtime.demo.train with --exit-blocks 2 3 (edgevlm.runtime.demo.train_exits: LayerSkip-style
#    exit losses through the shared projector + decoder), starting from INIT's weights and exit heads,
#    steps fitted to TRAIN_MINUTES (printed as "fitted --steps N"; rerun with STEPS=N to reproduce)
#    -> $OUT/model (model + jointly trained adapters, final accuracy of the full model and of every exit).
# 2. edgevlm calibrate $OUT/model --init $OUT/model --keep-adapters: closed-set classifiers, agreement pairs,
#    question-conditioned confidence heads and the certified threshold, float32 (the CPU runtime's answers)
#    -> $OUT/model/exits.{json,safetensors}.
# Then copy $OUT/model/* into runtime/demo/model/ and remeasure on the serving CPU (bench/early_exit.py,
# the frontier).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/train_demo_exits_out}
mkdir -p "$OUT"
if ! python3 -c 'import pydantic' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c 'import edgevlm.runtime' 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e .
export PYTHONUNBUFFERED=1
WORKERS=$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))
STEPS=${STEPS:-0}
INIT=${INIT:-runtime/demo/model}
python3 -m edgevlm.runtime.demo.train --out "$OUT/model" --init "$INIT" --exit-init "$INIT" \
  --exit-blocks 2 3 --exit-weight "${EXIT_WEIGHT:-1.0}" --seed 2 --device cuda --batch-size 128 --lr 4e-4 \
  --warmup 100 --steps "$STEPS" --max-minutes "${TRAIN_MINUTES:-5}" --workers "$WORKERS" --eval-every 1000 \
  --eval-n 900 --checkpoint-every 0 2>&1 | tee "$OUT/train.log"
chmod 644 "$OUT"/model/*
timeout "${CALIBRATE_TIMEOUT_S:-200}" python3 -m edgevlm.quantize.calibrate "$OUT/model" --init "$OUT/model" \
  --keep-adapters --steps 1000 --batch-size 64 --agreement-images 6000 --questions-per-image 4 \
  --rungs 384 384 256 192 128 --max-answer-change 0.01 --dtype float32 --device cuda --workers "$WORKERS" \
  --time-budget-s 170 --no-frontier 2>&1 | tee "$OUT/calibrate.log"
