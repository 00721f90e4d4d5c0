#!/bin/bash
# The x1 dtype test with x1 read at the stream's layout, the partials' sum by strip width, the
# device tests (branch backward prefetching), the kernel table after and before (HEAD's tree),
# then parallel blocks.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
R=/tmp/res; mkdir -p $R
save() { tar czf $OUT/res.tgz -C /tmp res 2>/dev/null; }
NEW=$PWD/src:$PWD/.peers; BASE=$PWD/.peers/base/src:$PWD/.peers
SECONDS=0
PYTHONPATH=$NEW ADDNORM_TEST_DEVICE=cuda timeout 80 python3 -m pytest -v -n 10 -p no:cacheprovider -p no:benchmark -rf --tb=short \
  tests/test_parallel_blocks.py tests/test_triton.py -k "another_dtype or prefetching or x1_stays or adds_x1" > $R/x1test.txt 2>&1
echo "x1test $SECONDS" | tee -a $R/times.txt; grep -E "FAILED|ERROR|AssertionError| passed| failed" $R/x1test.txt | head -20; save
PYTHONPATH=$NEW timeout 30 python3 .peers/sum_partials.py > $R/sum_partials.txt 2>&1
echo "sum_partials $SECONDS" | tee -a $R/times.txt; cat $R/sum_partials.txt; save
PYTHONPATH=$NEW ADDNORM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -v -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short \
  tests/test_triton.py tests/test_parallel_blocks.py tests/test_compat_flash_attn.py tests/test_dropout.py > $R/tests.txt 2>&1
echo "tests $SECONDS" | tee -a $R/times.txt; grep -E "FAILED|ERROR| passed| failed" $R/tests.txt | tail -15; save
PYTHONPATH=$NEW timeout 55 python3 benchmarks/gpu_checklist.py --budget-minutes 9 --out $R/new --only env,kernels > $R/new.txt 2>&1
echo "new $SECONDS" | tee -a $R/times.txt; save
PYTHONPATH=$BASE timeout 55 python3 benchmarks/gpu_checklist.py --budget-minutes 9 --out $R/base --only env,kernels > $R/base.txt 2>&1
echo "base $SECONDS" | tee -a $R/times.txt; paste -d' ' <(cut -d'|' -f2-4,7 $R/base/06-kernels.md) <(cut -d'|' -f7 $R/new/06-kernels.md); save
PYTHONPATH=$NEW timeout 90 python3 benchmarks/gpu_checklist.py --budget-minutes 9 --out $R/ck --only env,parallel > $R/checklist.txt 2>&1
echo "parallel $SECONDS" | tee -a $R/times.txt; cat $R/ck/09-parallel.md; save
