#!/bin/bash
# One loan, the third call: GPT-2 small's training step under torch.compile's CUDA graphs
# (mode="reduce-overhead"), unpatched and patched, profiled, with Inductor's performance hints
# logged (why a graph is not captured, or captured again).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../../.."
unset TRITON_INTERPRET
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:$PWD/.peers:/tmp/site
R=/tmp/res; mkdir -p $R
save() { tar czf $OUT/res.tgz -C /tmp res 2>/dev/null; }
SECONDS=0
TORCH_LOGS=perf_hints timeout 170 python3 benchmarks/gpu_checklist.py --budget-minutes 60 --out $R/train-gpt2-small \
  --only env,training --train-models gpt2-small --train-profile --train-variants unpatched+graphs,addnorm+graphs \
  > $R/train-gpt2-small.txt 2>&1
echo "training gpt2-small $SECONDS" | tee -a $R/times.txt; cat $R/train-gpt2-small/11-training.md
grep -i -E "cudagraph|skipping|re-record|rerecord" $R/train-gpt2-small.txt | sort | uniq -c | sort -rn | head -30; save
