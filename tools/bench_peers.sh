#!/bin/sh
# Peer benchmark (issue 37): kiln compiled and eager against PyTorch eager, torch.compile,
# ONNX Runtime Training and JAX, one training step of each example model on the CPU, engines
# interleaved in rounds. The models, engines, settings and the memory figures are described in
# tools/bench_peers.py's header; docs/performance.md ("Peer benchmark") has the command.
#
# A measuring tool only: nothing in the build or the tests uses it or its environment.
#
# Environment: a virtual environment build/peers-venv (build/ is git-ignored), made once and
# kept; this script re-runs pip only when the pinned requirements below change. Debian's
# /usr/bin/python3 (3.11, with venv and ensurepip) makes it; where that python lacks venv, a
# pyenv 3.11 does. Packages from PyPI (the only registry reachable here), pinned to the
# versions the tool was checked with:
#   torch 2.15.0      PyPI's default Linux wheel. It is the CUDA build and pulls the nvidia-*
#                     and triton wheels (the environment is about 7 GB); kept anyway because
#                     the CPU-only wheels live on PyTorch's own index, which is not reachable
#                     here, and disk is plentiful. Without a GPU `import torch` runs on the CPU
#                     (a "No CUDA runtime is found" line on stderr is harmless). torch.compile's
#                     CPU backend (Inductor C++) needs the system g++.
#   onnxruntime-training 1.19.2   the last release on PyPI (cp311 wheels exist).
#   onnx 1.16.2       ORT 1.19 loads ONNX IR version <= 10; onnx >= 1.18 stamps the optimizer
#                     graph that generate_artifacts builds with IR 11+ and ORT refuses it.
#   jax[cpu] 0.10.2, optax 0.2.8, numpy 2.4.6
#
# Usage: tools/bench_peers.sh [--models mlp_digits,tiny_gpt] [--precisions fp32,bf16]
#          [--batches 8,32] [--rounds 3] [--steps 10] [--warmup 3]
#          [--engines kiln_compiled,kiln_eager,torch,torch_compile,ort,jax] [--out FILE.md]
# Needs build/bin/kiln (bash tools/build.sh) and, for gpt_4l256 and gpt_6l384,
# bash tools/prepare_bench_models.sh. Every command it ran, with its output, is in
# build/peers-work/last_run.log.
set -e
cd "$(dirname "$0")/.."
VENV=build/peers-venv
REQS="torch==2.15.0 onnxruntime-training==1.19.2 onnx==1.16.2 jax[cpu]==0.10.2 optax==0.2.8 numpy==2.4.6"
STAMP=$VENV/.bench_peers_requirements

if [ ! -x "$VENV/bin/python" ]; then
    PY=/usr/bin/python3
    if ! $PY -c 'import venv, ensurepip' 2>/dev/null; then
        PY=$(ls -d "$HOME"/.pyenv/versions/3.11*/bin/python3 2>/dev/null | tail -n 1)
        [ -n "$PY" ] || { echo "bench_peers: no python 3.11 with venv (apt-get install python3-venv)" >&2; exit 1; }
    fi
    echo "bench_peers: creating $VENV with $PY" >&2
    mkdir -p build
    "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$REQS" ]; then
    echo "bench_peers: installing into $VENV: $REQS (several GB the first time)" >&2
    "$VENV/bin/pip" install --quiet --upgrade pip
    # shellcheck disable=SC2086  # REQS is a word list
    "$VENV/bin/pip" install --quiet $REQS
    echo "$REQS" > "$STAMP"
fi
exec "$VENV/bin/python" tools/bench_peers.py "$@"
