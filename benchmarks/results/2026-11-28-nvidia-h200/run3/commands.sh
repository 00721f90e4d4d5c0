#!/bin/bash
# One loan: the model-level tests on CUDA tensors (patch(), the modules, torch.compile, autograd),
# then a training step under torch.compile's CUDA graphs (mode="reduce-overhead") beside eager,
# GPT-2 small and the Llama-shaped stack, then the host cost of one call.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../../.."
unset TRITON_INTERPRET
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:$PWD/.peers:/tmp/site
R=/tmp/res; mkdir -p $R
save() { tar czf $OUT/res.tgz -C /tmp res 2>/dev/null; }
SECONDS=0
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $R/nvidia-smi.txt 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/nvidia-smi.txt 2>&1
cat $R/nvidia-smi.txt
ADDNORM_TEST_DEVICE=cuda timeout 170 python3 -m pytest -v -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short \
  tests/test_patch_families.py tests/test_patch.py tests/test_compile.py tests/test_modules.py tests/test_autograd.py > $R/tests.txt 2>&1
echo "tests $SECONDS" | tee -a $R/times.txt; grep -E "^(FAILED|ERROR)| passed| failed" $R/tests.txt | tail -40
grep -c PASSED $R/tests.txt; save
CK="python3 benchmarks/gpu_checklist.py --budget-minutes 60"
for model in gpt2-small llama-2048x8; do
  timeout 140 $CK --out $R/train-$model --only env,training --train-models $model \
    --train-variants unpatched,addnorm,unpatched+graphs,addnorm+graphs > $R/train-$model.txt 2>&1
  echo "training $model $SECONDS" | tee -a $R/times.txt; cat $R/train-$model/11-training.md; tail -5 $R/train-$model.txt; save
done
timeout 45 $CK --out $R/host --only env,host > $R/host.txt 2>&1
echo "host $SECONDS" | tee -a $R/times.txt; cat $R/host/07-host.md; save
