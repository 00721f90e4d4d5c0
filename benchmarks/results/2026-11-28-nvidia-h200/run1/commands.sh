#!/bin/bash
# One loan: the checklist's checks and kernel table on this tree, the training step (unpatched,
# addnorm's patch, Liger's), the wall clock per shape, then the device tests in what is left.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:$PWD/.peers:/tmp/site
R=/tmp/res; mkdir -p $R
save() { tar czf $OUT/res.tgz -C /tmp res 2>/dev/null; }
SECONDS=0
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $R/nvidia-smi.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/nvidia-smi.txt 2>&1
CK="python3 benchmarks/gpu_checklist.py --budget-minutes 60"
timeout 150 $CK --out $R/ck --only env,invariance,dweight,graphs,kernels,host,dropout > $R/ck.txt 2>&1
echo "checks $SECONDS" | tee -a $R/times.txt; cat $R/ck.txt; save
timeout 150 $CK --out $R/train --only env,training > $R/train.txt 2>&1
echo "training $SECONDS" | tee -a $R/times.txt; cat $R/train/11-training.md; save
for shape in 16384x4096 65536x768 4096x4096; do
  timeout 65 $CK --out $R/wall-$shape --only wallclock --wall-shapes $shape > $R/wall-$shape.txt 2>&1
  echo "wall $shape $SECONDS" | tee -a $R/times.txt; save
done
left=$((550 - SECONDS)); [ $left -lt 40 ] && left=40
ADDNORM_TEST_DEVICE=cuda timeout $left python3 -m pytest -v -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short \
  tests/test_triton.py tests/test_parallel_blocks.py tests/test_compat_flash_attn.py tests/test_dropout.py tests/test_backend_contract.py > $R/tests.txt 2>&1
echo "tests $SECONDS" | tee -a $R/times.txt; grep -E "FAILED|ERROR| passed| failed" $R/tests.txt | tail -15
grep -c PASSED $R/tests.txt; save
