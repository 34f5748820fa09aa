#!/usr/bin/env bash
# Creates the Python environment the PyTorch binding and its tests use:
# a virtual environment in ./.venv (or $TQDECODE_VENV) with the PyTorch the
# binding is built against (2.11, the CUDA 13.0 wheel from PyPI, which also
# runs without a GPU), pytest, numpy and scikit-build-core (the build
# backend of pyproject.toml, for the packaging test). Idempotent: an
# environment that already imports them is kept. scripts/build.sh builds the binding, and
# ctest runs python/tests, whenever this environment exists.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/packages.sh

venv="${TQDECODE_VENV:-.venv}"
requirements=(torch==2.11.0 pytest numpy scikit-build-core)

if [ -x "$venv/bin/python3" ] && "$venv/bin/python3" -c "import torch, pytest, numpy, scikit_build_core" 2>/dev/null; then
  exit 0
fi
python3 -c "import venv, ensurepip" 2>/dev/null || ensure_packages /usr/lib/python3/dist-packages/pip:python3-venv
echo "python_env.sh: creating $venv with ${requirements[*]} (about 5 GB, a few minutes)"
python3 -m venv "$venv"
"$venv/bin/python3" -m pip install --quiet --disable-pip-version-check "${requirements[@]}"
