#!/usr/bin/env bash
# Trains every example for 20 steps (fp32 and bf16, --backend compiled) with two kiln
# binaries and checks that their losses (metrics.jsonl) and trained weights
# (model.safetensors) are bit-identical. Used to check a refactoring against the commit
# before it (issue 30): build the older commit in a worktree and pass both binaries.
#   tools/check_bit_identical.sh OLD/build/bin/kiln build/bin/kiln [--gradient_accumulation_steps 2 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1 new=$2
shift 2
extra=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
digits="--train_data labels=data/digits/y_train.npy --per_device_train_batch_size 32"
declare -A flags=(
  [mlp_digits]="--train_data input=data/digits/x_train.npy $digits"
  [cnn_bn]="--train_data input=data/digits/x_train_img.npy $digits"
  [resnet18]="--train_data input=data/digits/x_train_rgb32.npy $digits"
  [tiny_gpt]="--train_data data/text/train.bin --block_size 64 --per_device_train_batch_size 8"
)
fail=0
for m in mlp_digits cnn_bn resnet18 tiny_gpt; do
  for prec in fp32 bf16; do
    p=""; [ "$prec" = bf16 ] && p="--bf16"
    for which in old new; do
      bin=$old; [ "$which" = new ] && bin=$new
      "$bin" train "examples/$m/model.onnx" ${flags[$m]} $p --backend compiled --max_steps 20 --logging_steps 1 \
        --learning_rate 1e-3 --warmup_steps 3 --no_cache --output_dir "$work/$m-$prec-$which" "${extra[@]}" > "$work/$m-$prec-$which.log" 2>&1 ||
        { echo "$m $prec: $which failed: $(tail -1 "$work/$m-$prec-$which.log")"; fail=1; continue 2; }
      grep -o '"loss":[^,}]*' "$work/$m-$prec-$which/metrics.jsonl" > "$work/$m-$prec-$which.losses"
    done
    if cmp -s "$work/$m-$prec-old.losses" "$work/$m-$prec-new.losses" &&
       cmp -s "$work/$m-$prec-old/model.safetensors" "$work/$m-$prec-new/model.safetensors"; then
      echo "$m $prec: bit-identical ($(wc -l < "$work/$m-$prec-new.losses") losses, weights)"
    else
      echo "$m $prec: DIFFERENT"; fail=1
    fi
  done
done
exit $fail
