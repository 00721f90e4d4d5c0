#!/bin/bash
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:$PWD/.peers:/tmp/site
R=/tmp/res2; mkdir -p $R
save() { tar czf $OUT/res2.tgz -C /tmp res2 2>/dev/null; }
SECONDS=0
ADDNORM_TEST_DEVICE=cuda timeout 40 python3 -m pytest -q -n 4 -p no:cacheprovider -p no:benchmark -rf --tb=short \
  tests/test_compat_flash_attn.py -k layer_norm_linear_fn > $R/tests.txt 2>&1
echo "tests $SECONDS" | tee -a $R/times.txt; tail -3 $R/tests.txt; save
timeout 45 python3 benchmarks/triton_tune.py --profile --shapes 8x768 --dtype bfloat16 > $R/profile.txt 2>&1
echo "profile $SECONDS" | tee -a $R/times.txt; save
timeout 110 python3 benchmarks/gpu_checklist.py --budget-minutes 60 --out $R/wall-16384x4096 --only wallclock --wall-shapes 16384x4096 > $R/wall.txt 2>&1
echo "wall $SECONDS" | tee -a $R/times.txt; cat $R/wall-16384x4096/10-wallclock.md; save
