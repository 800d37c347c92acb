#!/bin/bash
# Issue 7's benchmark table (docs/performance.md): for each benchmark model and precision,
# kiln bench --backend eager,compiled (steps alternate in one process), then PyTorch
# eager (tools/bench_torch.py, Debian's python3-torch) and kiln compiled alone.
# Needs build/bin/kiln and build/examples/gpt_4l256 (tools/prepare_bench_models.sh).
# Usage: bash tools/bench_issue7.sh
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive
for spec in mlp_digits:32:examples tiny_gpt:8:examples gpt_4l256:8:build/examples resnet18:8:examples; do
  IFS=: read -r m b dir <<< "$spec"
  for prec in fp32 bf16; do
    flag=""; [ "$prec" = bf16 ] && flag="--bf16"
    steps=10; tsteps=""; [ "$m" = gpt_4l256 ] && steps=5 && tsteps="--steps 5"
    common="$dir/$m/model.onnx --per_device_train_batch_size $b $flag --learning_rate 1e-3 --weight_decay 0.01 --bench_steps $steps"
    echo "== $m $prec b=$b"
    build/bin/kiln bench $common --backend eager,compiled 2>&1 | grep -E "^eager|^compiled|allocations"
    /usr/bin/python3 tools/bench_torch.py "$m" --batch "$b" --precision "$prec" --threads 2 \
        --learning_rate 1e-3 --weight_decay 0.01 $tsteps 2>&1 | grep median_s
    echo "compiled alone: $(build/bin/kiln bench $common --backend compiled 2>&1 | grep 'median step')"
  done
done
