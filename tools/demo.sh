#!/usr/bin/env bash
# The main job on real data: sets up and builds kiln, prepares the data sets, then
#  1. trains the MLP example on scikit-learn's digits (real handwritten digits) and
#  2. trains the tiny GPT example on the Jargon File (English text, Debian's jargon-text),
# printing the loss falling and the final eval metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/build.sh
bash tools/prepare_test_data.sh
KILN=${KILN:-build/bin/kiln}
OUT=${KILN_DEMO_OUT:-out}

echo "== 1/2: MLP on sklearn digits =="
$KILN train examples/mlp_digits/model.onnx \
  --train_data input=data/digits/x_train.npy --train_data labels=data/digits/y_train.npy \
  --eval_data input=data/digits/x_eval.npy --eval_data labels=data/digits/y_eval.npy \
  --per_device_train_batch_size 32 --per_device_eval_batch_size 32 --num_train_epochs 15 \
  --learning_rate 2e-3 --weight_decay 0.01 --lr_scheduler_type linear --warmup_ratio 0.05 \
  --logging_steps 50 --eval_steps 200 --seed 42 --output_dir "$OUT/mlp_digits"

echo "== 2/2: tiny GPT on the Jargon File (byte-level) =="
$KILN train examples/tiny_gpt/model.onnx \
  --train_data data/text/train.bin --eval_data data/text/val.bin --block_size 64 \
  --per_device_train_batch_size 16 --per_device_eval_batch_size 16 --max_steps 600 \
  --learning_rate 3e-3 --weight_decay 0.1 --lr_scheduler_type cosine --warmup_steps 30 \
  --logging_steps 50 --eval_steps 200 --seed 42 --output_dir "$OUT/tiny_gpt"
