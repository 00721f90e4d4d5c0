#!/bin/bash
# One loan, the second call: the model-level tests on CUDA tensors again (their bitwise checks
# now device-aware), whether the unpatched MiniMax generates from a padded batch on CUDA, then
# the training step eager and under torch.compile with each variant's GPU kernels profiled.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../../.."
unset TRITON_INTERPRET
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:$PWD/.peers:/tmp/site
R=/tmp/res; mkdir -p $R
save() { tar czf $OUT/res.tgz -C /tmp res 2>/dev/null; }
SECONDS=0
ADDNORM_TEST_DEVICE=cuda timeout 60 python3 - > $R/minimax.txt 2>&1 <<'PY'
import sys
sys.path.insert(0, "tests")
import conftest  # noqa: F401  (the default device: CUDA)
import torch
from tiny_models import hf_inputs, hf_model
m = hf_model("minimax").eval()
p = hf_inputs("minimax")["input_ids"][:, :5]
mask = torch.ones_like(p)
mask[0, :2] = 0
try:
    with torch.no_grad():
        out = m.generate(p, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    print("unpatched minimax generates:", out.tolist())
except RuntimeError as err:
    print("unpatched minimax raises:", type(err).__name__, err)
PY
cat $R/minimax.txt | tail -3; echo "minimax $SECONDS" | tee -a $R/times.txt
ADDNORM_TEST_DEVICE=cuda timeout 150 python3 -m pytest -v -n 15 -p no:cacheprovider -p no:benchmark -rf --tb=short \
  tests/test_patch_families.py tests/test_patch.py tests/test_compile.py tests/test_modules.py tests/test_autograd.py > $R/tests.txt 2>&1
echo "tests $SECONDS" | tee -a $R/times.txt; grep -E "^(FAILED|ERROR)| passed| failed" $R/tests.txt | tail -20; save
CK="python3 benchmarks/gpu_checklist.py --budget-minutes 60"
for model in llama-2048x8 gpt2-small; do
  timeout 150 $CK --out $R/train-$model --only env,training --train-models $model --train-profile \
    --train-variants unpatched,addnorm,unpatched+compile,addnorm+compile > $R/train-$model.txt 2>&1
  echo "training $model $SECONDS" | tee -a $R/times.txt; cat $R/train-$model/11-training.md; tail -3 $R/train-$model.txt; save
done
