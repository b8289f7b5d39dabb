#!/bin/bash
# One device call (after setup.sh: $REPO, $OUT set, cwd /tmp): the zero-fold checks and timings, each step
# bounded so the whole ends inside LIMIT seconds and $OUT comes back.
T0=$SECONDS; LIMIT=${LIMIT:-318}
left() { echo $(( LIMIT - (SECONDS - T0) )); }
cap() { local t; t=$(left); echo $(( t < $1 ? t : $1 )); }
D=$REPO/.scratch/zfold/dev  # (as run; this copy: bench/results/w4a16_zfold_h200_20261202)
S=$OUT/steps.txt
{ date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,utilization.gpu --format=csv;
  git -C $REPO log --oneline -1 2>/dev/null; echo "EDGEVLM_W4A16_PDL=${EDGEVLM_W4A16_PDL-unset}"; } > $S 2>&1
(timeout 200 python3 $D/ab.py --build-old > $OUT/oldbuild.log 2>&1; echo "old build rc $? at $((SECONDS-T0)) s" >> $S) &
timeout $(cap 150) python3 -m pytest -q -p no:cacheprovider -rfE $REPO/tests/gpu_perf/test_w4a16_marlin.py > $OUT/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS-T0)) s" >> $S
mkdir -p /tmp/chainout
OUT=/tmp/chainout timeout $(cap 70) python3 $D/bench_wrap.py --skip layers,prefill,model,numerics,sm87 --lean > $OUT/chain.log 2>&1
echo "chain rc $? at $((SECONDS-T0)) s" >> $S
wait
timeout $(cap 100) python3 $D/ab.py --out $OUT > $OUT/ab.log 2>&1
echo "ab rc $? at $((SECONDS-T0)) s" >> $S
if [ "$(left)" -gt 70 ]; then
  mkdir -p $OUT/model
  OUT=$OUT/model timeout $(( $(left) - 3 )) python3 $D/bench_wrap.py --skip layers,prefill,numerics,sm87 --batch-sizes 1,8 --lean --model-variants edgevlm-w4 > $OUT/model.log 2>&1
  echo "model rc $? at $((SECONDS-T0)) s" >> $S
else
  echo "model not run: $(left) s left" >> $S
fi
cat $S
