#!/bin/bash
# The x1 dtype test alone (long traceback), the prefetching backward's bits on the GPU, the
# device tests, then the backward with and without prefetch (plain, branch), narrow rows too.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
R=/tmp/res; mkdir -p $R
save() { tar czf $OUT/res.tgz -C /tmp res 2>/dev/null; }
NEW=$PWD/src:$PWD/.peers
SECONDS=0
PYTHONPATH=$NEW ADDNORM_TEST_DEVICE=cuda timeout 80 python3 -m pytest -v -n 8 -p no:cacheprovider -p no:benchmark -rf --tb=long \
  tests/test_parallel_blocks.py tests/test_triton.py -k "another_dtype or prefetching" > $R/x1test.txt 2>&1
echo "x1test $SECONDS" | tee -a $R/times.txt; grep -E "PASSED|FAILED|ERROR|AssertionError|assert " $R/x1test.txt | head -40; save
PYTHONPATH=$NEW timeout 150 python3 benchmarks/triton_tune.py --no-overhead --backward-only --prefetch --per-sm 8,12,16 --tiles 1024 \
  --shapes 65536x768,16384x1024,32768x4096,8192x8192,65536x256 --dtype bfloat16,float32 > $R/tune.txt 2>&1
echo "tune $SECONDS" | tee -a $R/times.txt; cat $R/tune.txt; save
PYTHONPATH=$NEW timeout 40 python3 benchmarks/triton_tune.py --no-overhead --branch-only --prefetch \
  --shapes 65536x768,16384x4096 --dtype bfloat16 > $R/branch.txt 2>&1
echo "branch $SECONDS" | tee -a $R/times.txt; cat $R/branch.txt; save
PYTHONPATH=$NEW ADDNORM_TEST_DEVICE=cuda timeout 150 python3 -m pytest -v -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short \
  tests/test_triton.py tests/test_parallel_blocks.py tests/test_compat_flash_attn.py tests/test_dropout.py > $R/tests.txt 2>&1
echo "tests $SECONDS" | tee -a $R/times.txt; grep -E "FAILED|ERROR| passed| failed" $R/tests.txt | tail -15; save
