#!/bin/sh
# Exports the benchmark-only models (gpt_4l256: GPT 4 layers, n_embd 256, 8 heads, seq 128;
# gpt_8l256: the same with 8 layers; gpt_6l384: nanoGPT shakespeare-char size, 6 layers, n_embd 384,
# 6 heads, seq 256, vocab 65; tiny_gpt_dyn / gpt_4l256_dyn with a dynamic sequence
# axis of up to 256 tokens, vocab 256; resnet18_64: ResNet-18 width 16 at 64x64) into build/examples/ (git-ignored) with Debian's python3-torch 1.13.
# Leaves examples/ untouched. Usage: tools/prepare_bench_models.sh
set -e
cd "$(dirname "$0")/.."
exec /usr/bin/python3 tools/export_examples.py --bench
