#!/usr/bin/env bash
# Create .venv with nascompress and everything it needs, from scratch.
# torch is installed FIRST and pinned exactly: any looser requirement lets pip replace the CPU
# build with a multi-GB CUDA build (on a CUDA machine the same pin takes the CUDA build).
# Also installs the real default dataset (Debian package dataset-fashion-mnist) if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q torch==2.13.0 numpy
.venv/bin/python -m pip install -q -e ".[test]"
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist
fi
echo "nascompress is installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
