#!/bin/bash
# The device tests (verbose: a cut run still names its failures), kernels before/after native
# rounding, the backward's warps in flight below 32 per SM and one-row tiles, then parallel blocks.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
R=/tmp/res; mkdir -p $R
save() { tar czf $OUT/res.tgz -C /tmp res 2>/dev/null; }
NEW=$PWD/src:$PWD/.peers; BASE=$PWD/.peers/base/src:$PWD/.peers
SECONDS=0
PYTHONPATH=$NEW ADDNORM_TEST_DEVICE=cuda timeout 140 python3 -m pytest -v -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short \
  tests/test_triton.py tests/test_parallel_blocks.py tests/test_compat_flash_attn.py tests/test_dropout.py > $R/tests.txt 2>&1
echo "tests $SECONDS" | tee -a $R/times.txt; grep -E "FAILED|ERROR| passed| failed" $R/tests.txt | tail -15; save
PYTHONPATH=$BASE timeout 60 python3 benchmarks/gpu_checklist.py --budget-minutes 9 --out $R/base --only env,kernels > $R/base.txt 2>&1
echo "base $SECONDS" | tee -a $R/times.txt; save
PYTHONPATH=$NEW timeout 60 python3 benchmarks/gpu_checklist.py --budget-minutes 9 --out $R/new --only env,kernels > $R/new.txt 2>&1
echo "new $SECONDS" | tee -a $R/times.txt; paste -d' ' <(cut -d'|' -f2-4,7 $R/base/06-kernels.md) <(cut -d'|' -f7 $R/new/06-kernels.md); save
PYTHONPATH=$NEW timeout 110 python3 benchmarks/triton_tune.py --no-overhead --backward-only --per-sm 8,16,32 --tiles 1024,4096 \
  --shapes 65536x768,16384x1024,32768x4096,8192x8192 --dtype bfloat16,float32 > $R/tune.txt 2>&1
echo "tune $SECONDS" | tee -a $R/times.txt; cat $R/tune.txt; save
PYTHONPATH=$NEW timeout 80 python3 benchmarks/gpu_checklist.py --budget-minutes 9 --out $R/ck --only env,parallel > $R/checklist.txt 2>&1
echo "parallel $SECONDS" | tee -a $R/times.txt; cat $R/ck/09-parallel.md; save
