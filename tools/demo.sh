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

echo "== 1/2: MLP on sklearn digits (config: examples/mlp_digits/train_demo.json) =="
$KILN train examples/mlp_digits/model.onnx --config examples/mlp_digits/train_demo.json --output_dir "$OUT/mlp_digits" --overwrite_output_dir

echo "== 2/2: tiny GPT on the Jargon File, byte-level (config: examples/tiny_gpt/train_demo.json) =="
$KILN train examples/tiny_gpt/model.onnx --config examples/tiny_gpt/train_demo.json --output_dir "$OUT/tiny_gpt" --overwrite_output_dir
