#!/usr/bin/env bash
# Re-creates tests/data/hf/ (the Hugging Face fixtures: ONNX exports of tiny transformers
# models by current PyTorch exporters, and PyTorch's reference numbers). Makes the virtual
# environment .venv-hf/ with pinned PyPI packages first (about 4 GB: PyPI's torch wheel
# pulls CUDA libraries; nothing of it is used at build or test time). Run by hand; the
# outputs are committed. Usage: tools/make_hf_fixtures.sh [--only MODEL ...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-hf
PKGS=(torch==2.15.0 onnx==1.23.2 onnxscript==0.7.2 transformers==5.25.0 safetensors numpy)
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "${PKGS[@]}"
"$VENV/bin/python" tools/export_hf_fixtures.py "$@"
