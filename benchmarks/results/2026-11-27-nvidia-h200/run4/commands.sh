#!/bin/bash
# Native bf16 rounding on the GPU: kernels before (.peers/base, HEAD) and after, side by side;
# the device tests of the x1 forward, rounding and parallel blocks; the launch sweep; parallel.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
R=/tmp/res; mkdir -p $R
save() { tar czf $OUT/res.tgz -C /tmp res 2>/dev/null; }
NEW=$PWD/src:$PWD/.peers; BASE=$PWD/.peers/base/src:$PWD/.peers
SECONDS=0
PYTHONPATH=$BASE timeout 70 python3 benchmarks/gpu_checklist.py --budget-minutes 2 --out $R/base --only env,kernels > $R/base.txt 2>&1
echo "base $SECONDS" | tee -a $R/times.txt; save
PYTHONPATH=$NEW timeout 70 python3 benchmarks/gpu_checklist.py --budget-minutes 2 --out $R/new --only env,kernels > $R/new.txt 2>&1
echo "new $SECONDS" | tee -a $R/times.txt; paste -d' ' <(cut -c1-60 $R/base/06-kernels.md) <(cut -d'|' -f5- $R/new/06-kernels.md); save
PYTHONPATH=$NEW timeout 130 python3 benchmarks/triton_tune.py --no-overhead --shapes 65536x768,16384x2048 --dtype bfloat16 --tiles 1024,2048,4096 > $R/tune.txt 2>&1
echo "tune $SECONDS" | tee -a $R/times.txt; cat $R/tune.txt; save
PYTHONPATH=$NEW ADDNORM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short \
  tests/test_triton.py tests/test_parallel_blocks.py tests/test_compat_flash_attn.py tests/test_dropout.py > $R/tests.txt 2>&1
echo "tests $SECONDS" | tee -a $R/times.txt; grep -E "FAILED|ERROR|passed|failed" $R/tests.txt | tail -15; tail -c 300 $R/tests.txt; save
PYTHONPATH=$NEW timeout 70 python3 benchmarks/gpu_checklist.py --budget-minutes 1.2 --out $R/ck --only env,parallel > $R/checklist.txt 2>&1
echo "parallel $SECONDS" | tee -a $R/times.txt; cat $R/ck/09-parallel.md; save
